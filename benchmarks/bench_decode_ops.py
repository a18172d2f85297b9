"""GPU time of each op of a batch-1 decode round of the Qwen3-8B shape, 36 launches of each
(one per layer, separate buffers) captured in a CUDA graph and replayed: where a round's
time goes besides the matmuls (benchmarks/bench_matmul_variants.py times those).

    python benchmarks/bench_decode_ops.py [--rows 1] [--context 72,2048]
"""

from __future__ import annotations

import argparse

import numpy as np
from graph_timing import graph_seconds

LAYERS, H, NH, NKV, HD, PAGE = 36, 4096, 32, 8, 128, 16


def graph_us(cp, fn) -> float:
    """Microseconds per call of fn(layer) for LAYERS calls captured in one graph."""

    def record(stream) -> None:  # the ops launch on CuPy's current stream
        for layer in range(LAYERS):
            fn(layer)

    return graph_seconds(cp, record, replays=20) * 1e6 / LAYERS


def context_ops(ops, rows: int, ctx: int, qkv, norm, inv_freq) -> list:
    cp = ops.xp
    pages = -(-ctx // PAGE)
    kv = ops.alloc_kv(LAYERS, pages * PAGE * rows, NKV, HD, "bf16")
    kv[...] = cp.random.randint(0, 0x3F00, kv.shape, dtype=cp.uint16)
    table = cp.asarray(np.arange(rows * pages, dtype=np.int32).reshape(rows, pages))
    pos = cp.asarray(np.full(rows, ctx - 1, np.int64))
    slots = cp.asarray((np.arange(rows) * pages * PAGE + ctx - 1).astype(np.int64))
    seq = cp.asarray(np.arange(rows, dtype=np.int32))
    q = ops.attn_inputs(qkv[0], norm, norm, 1e-6, pos, inv_freq, 1.0, kv, 0, slots, None, NH)
    return [(f"attn_inputs ctx={ctx}", graph_us(cp, lambda i: ops.attn_inputs(
                qkv[i], norm, norm, 1e-6, pos, inv_freq, 1.0, kv, i, slots, None, NH))),
            (f"attention ctx={ctx}", graph_us(cp, lambda i: ops.attention(
                q, kv, i, None, table, seq, pos, PAGE, 0.088)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", default="72,2048")
    args = parser.parse_args()
    from tf_async.backend.cuda_ops import CudaOps

    ops = CudaOps()
    cp, rows = ops.xp, args.rows
    rng = np.random.default_rng(0)
    h = [cp.asarray(rng.standard_normal((rows, H)).astype(np.float32)) for _ in range(LAYERS)]
    w = cp.asarray((1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    qkv = [cp.asarray(rng.standard_normal((rows, (NH + 2 * NKV) * HD)).astype(np.float32)) for _ in range(LAYERS)]
    norm = cp.asarray(np.ones(HD, np.float32))
    inv_freq = cp.asarray((1e6 ** (-np.arange(0, HD, 2) / HD)).astype(np.float32))
    results = []
    with ops.unchecked():
        results.append(("rms_norm", graph_us(cp, lambda i: ops.rms_norm(h[i], w, 1e-6))))
        for ctx in (int(c) for c in args.context.split(",")):
            results += context_ops(ops, rows, ctx, qkv, norm, inv_freq)
    results.append(("h += x (cupy)", graph_us(cp, lambda i: h[i].__iadd__(h[(i + 1) % LAYERS]))))
    print(f"\nrows={rows}: GPU us per launch (graph replay, {LAYERS} launches each)")
    for name, us in results:
        print(f"  {name:24} {us:8.2f} us   x36 = {36 * us / 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
