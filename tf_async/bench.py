"""`tf-async bench`: prefill and aggregate decode throughput of the engine (prints a table)."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from .api import Engine

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


async def run_bench(model: str | None, *, device: str, parallels: list[int], max_tokens: int,
                    kv_dtype: str = "f32", repeats: int = 3, drafter: str | None = None,
                    cuda_graphs: bool = True, decode_steps: int = 1) -> list[dict[str, Any]]:
    from .engine.build import load_model

    ckpt = await asyncio.to_thread(load_model, model)
    rows = []
    for parallel in parallels:
        async with Engine(ckpt, device=device, parallel=parallel, ctx=1024, kv_dtype=kv_dtype,
                          step_tokens=256, drafter=drafter, cuda_graphs=cuda_graphs,
                          decode_steps=decode_steps) as eng:
            await eng.complete(PROMPT, max_tokens=4)  # compile / warm up
            streams = max(parallels)
            runs = [await decode_rate(eng, streams, max_tokens) for _ in range(repeats)]
            prefill = [await prefill_rate(eng, 256) for _ in range(repeats)]
        rows.append({"parallel": parallel, "streams": streams,
                     "decode_tok_s": statistics.median(r[0] for r in runs),
                     "prefill_tok_s": statistics.median(prefill)})
    return rows


def main_bench(args: Any) -> int:
    rows = asyncio.run(run_bench(args.model, device=args.device, parallels=args.parallel,
                                 max_tokens=args.max_tokens, kv_dtype=args.kv_dtype,
                                 drafter=args.drafter, cuda_graphs=args.cuda_graphs,
                                 decode_steps=args.decode_steps))
    base = rows[0]["decode_tok_s"]
    print(f"{'parallel':>8} {'streams':>7} {'decode tok/s':>13} {'x parallel=' + str(rows[0]['parallel']):>14} {'prefill tok/s':>14}")
    for r in rows:
        print(f"{r['parallel']:>8} {r['streams']:>7} {r['decode_tok_s']:>13.1f} "
              f"{r['decode_tok_s'] / base:>14.2f} {r['prefill_tok_s']:>14.1f}")
    return 0
