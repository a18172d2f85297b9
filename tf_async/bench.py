"""`tf-async bench`: prefill and aggregate decode throughput of the engine (prints a table)."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time
from dataclasses import dataclass
from typing import Any

from .api import Engine
from .errors import BadInputError

PROMPT = "Write a short story about a robot who learns to paint. Make it vivid and kind."


async def decode_rate(engine: Engine, num_streams: int, max_tokens: int) -> tuple[float, float]:
    """(aggregate tokens/s, per-stream tokens/s) of `num_streams` concurrent streams, measured
    from submission to the last token (short prompts: prefill is a small part of it)."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.complete(f"{PROMPT} ({i})", max_tokens=max_tokens,
                                                  ignore_eos=True) for i in range(num_streams)))
    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    return rate, rate / num_streams


async def prefill_rate(engine: Engine, num_tokens: int) -> float:
    ids = (engine.tokenizer.encode(PROMPT * 40))[:num_tokens]
    t0 = time.perf_counter()
    await engine.complete(ids, max_tokens=1)
    return num_tokens / (time.perf_counter() - t0)


@dataclass(slots=True, frozen=True)
class BenchRow:
    """One engine of `num_lanes` lanes serving `num_streams` concurrent streams."""

    num_lanes: int
    num_streams: int
    decode_tok_s: float  # all streams together, submission to last token (median of repeats)
    prefill_tok_s: float  # one 256-token prompt alone

    @property
    def ms_per_token(self) -> float:
        """Time between two tokens of one running stream (each running stream gets 1/lanes
        of the aggregate rate)."""
        return 1000.0 * min(self.num_lanes, self.num_streams) / self.decode_tok_s


async def run_bench(model: str | None, *, device: str, parallels: list[int], max_tokens: int,
                    kv_dtype: str = "f32", repeats: int = 3, drafter: str | None = None,
                    cuda_graphs: bool = True, decode_steps: int = 1,
                    tensor_parallel: int = 1) -> list[BenchRow]:
    from .engine.build import load_model

    ckpt = await asyncio.to_thread(load_model, model)
    rows = []
    streams = max(parallels)
    for parallel in parallels:
        async with Engine(ckpt, device=device, parallel=parallel, ctx=1024, kv_dtype=kv_dtype,
                          step_tokens=256, drafter=drafter, cuda_graphs=cuda_graphs,
                          decode_steps=decode_steps, tensor_parallel=tensor_parallel) as eng:
            await eng.warm_up()  # as serve does: kernels, and every decode row count's graph
            runs = [await decode_rate(eng, streams, max_tokens) for _ in range(repeats)]
            prefill = [await prefill_rate(eng, 256) for _ in range(repeats)]
        rows.append(BenchRow(parallel, streams, statistics.median(r[0] for r in runs),
                             statistics.median(prefill)))
    return rows


COLUMNS = (("lanes", 5), ("streams", 7), ("decode tok/s", 12), ("speed-up", 8),
           ("ms/token", 8), ("prefill tok/s", 13))


def format_table(rows: list[BenchRow], max_tokens: int) -> str:
    """The table `tf-async bench` prints, with a legend saying what each column is."""
    base = rows[0]
    lines = [
        f"Each row: an engine with `lanes` lanes (--parallel) serving `streams` concurrent "
        f"streams of {max_tokens} tokens.",
        "decode tok/s: all streams together; speed-up: against the first row "
        f"({base.num_lanes} lane(s)); ms/token: between two tokens of one running stream; "
        "prefill tok/s: one 256-token prompt alone.",
        "  ".join(f"{name:>{width}}" for name, width in COLUMNS),
    ]
    for r in rows:
        cells = (r.num_lanes, r.num_streams, f"{r.decode_tok_s:.1f}",
                 f"{r.decode_tok_s / base.decode_tok_s:.2f}x", f"{r.ms_per_token:.1f}",
                 f"{r.prefill_tok_s:.1f}")
        lines.append("  ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS,
                                                                              strict=True)))
    return "\n".join(lines)


def write_plot(rows: list[BenchRow], path: str, title: str) -> None:
    """Throughput and per-stream latency against the number of lanes, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInputError("--plot needs matplotlib: pip install matplotlib "
                            "(or pip install -e '.[plot]')", param="plot") from None
    lanes = [r.num_lanes for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(lanes, [r.decode_tok_s for r in rows], "o-", label="decode (all streams)")
    left.plot(lanes, [r.prefill_tok_s for r in rows], "s--", label="prefill (256 tokens)")
    left.set(xlabel="lanes (--parallel)", ylabel="tokens/s", title="throughput")
    left.legend()
    right.plot(lanes, [r.ms_per_token for r in rows], "o-")
    right.set(xlabel="lanes (--parallel)", ylabel="ms between tokens",
              title="latency of one running stream")
    for axis in (left, right):
        axis.set_xticks(lanes)
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_bench(args: Any) -> int:
    if args.plot is not None:
        _check_plot_path(args.plot)
    rows = asyncio.run(run_bench(args.model, device=args.device, parallels=args.parallel,
                                 max_tokens=args.max_tokens, kv_dtype=args.kv_dtype,
                                 drafter=args.drafter, cuda_graphs=args.cuda_graphs,
                                 decode_steps=args.decode_steps,
                                 tensor_parallel=args.tensor_parallel))
    print(format_table(rows, args.max_tokens))
    if args.plot is not None:
        write_plot(rows, args.plot, f"tf-async bench ({args.device}, {rows[0].num_streams} "
                                    f"streams of {args.max_tokens} tokens)")
        print(f"plot written to {args.plot}")
    return 0


def _check_plot_path(path: str) -> None:
    """Fail before the (long) run, not after: matplotlib importable, a .png name."""
    if not path.lower().endswith(".png"):
        raise BadInputError(f"--plot writes a PNG: give a name ending in .png, not {path}",
                            param="plot")
    if importlib.util.find_spec("matplotlib") is None:
        raise BadInputError("--plot needs matplotlib: pip install matplotlib "
                            "(or pip install -e '.[plot]')", param="plot")
