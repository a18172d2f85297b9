"""Per-lane memory of a DFlash2 drafter for a 27B-shaped Qwen3.5 target (docs/PERFORMANCE.md).

    python benchmarks/dflash_memory.py [--parallel 8]

The drafter's shapes are the public DFlash2 checkpoint's (z-lab/dflash
tests/fixtures/dflash2-config.json: 5 layers, 8 KV heads of 128, every layer sliding with
window 2048, block 16) with the target's hidden size. Its context ring (K/V of every drafter
layer, f32, row p % capacity) lives in an area borrowed from the lane's run: 0 fixed a lane.
"""

from __future__ import annotations

import argparse

from tf_async.engine.area import AreaLayout, align_up, mib

TARGET_27B = {"hidden_size": 5120, "num_layers": 64, "kv_layers": 16, "num_kv_heads": 4, "head_dim": 256}
DFLASH2 = {"num_layers": 5, "num_kv_heads": 8, "head_dim": 128, "sliding_window": 2048}


def lines(parallel: int, ctx: int) -> list[str]:
    t, d = TARGET_27B, DFLASH2
    capacity = min(ctx, d["sliding_window"])  # every layer slides: the window bounds the ring
    area = AreaLayout(d["num_layers"], d["num_kv_heads"], d["head_dim"], t["hidden_size"], capacity, "f32")
    kv_row = t["kv_layers"] * 2 * t["num_kv_heads"] * t["head_dim"] * 2  # bf16 target KV
    return [f"27B + DFlash2, --parallel {parallel} --ctx {ctx}: ring {capacity} rows x "
            f"{d['num_layers']} layers f32 = {mib(area.ring_bytes)} (+ {area.state_bytes} B state)",
            "  fixed a lane: 0 MiB (the area is borrowed from the lane's run when the drafter opens)",
            f"  in the run a lane: target KV {mib(kv_row * ctx)} (bf16) + DFlash2 area "
            f"{mib(area.num_bytes)}; arena drafter region {mib(parallel * align_up(area.num_bytes))}"]


def kept_rows_line(page_size: int) -> str:
    """With a prefix cache: the drafter's ctx rows kept beside every page of the pool
    (engine/drafters/dflash_pages.py, f32, H a position), against the target's bf16 KV."""
    t = TARGET_27B
    row = t["hidden_size"] * 4
    kv_row = t["kv_layers"] * 2 * t["num_kv_heads"] * t["head_dim"] * 2
    return (f"prefix cache, pages of {page_size}: kept ctx rows {page_size * row // 1024} KiB a "
            f"page ({row // 1024} KiB a position; target KV {kv_row // 1024} KiB a position: "
            f"+{100 * row / kv_row:.0f}% of the pool)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()
    for ctx in (16384, 32768):
        print("\n".join(lines(args.parallel, ctx)))
    print(kept_rows_line(args.page_size))


if __name__ == "__main__":
    main()
