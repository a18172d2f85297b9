"""Prefix cache on the default model (CPU by default), with and without, alternating in one run.

  resumed chat: turn 1 carries a ~3,000-token prompt; turn 2 (turn 1 + its answer + a new
                question) is timed to its first token, on an engine that served turn 1
                (cache) and on one without the cache.
  shared system prompt: 8 concurrent requests with one ~2,000-token system prompt and
                their own questions; aggregate throughput (prompt + output tokens a second).

    python benchmarks/bench_prefix_cache.py [--device cpu] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tf_async import Engine

PARAGRAPH = ("The river runs past the old mill, where the miller keeps a ledger of every sack of "
             "grain, the weather of each morning and the names of the travellers who stop to "
             "rest. ")


def _text(num_tokens: int, eng: Engine, label: str) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < num_tokens:
        ids += eng.tokenizer.encode(f"{label} {i}. {PARAGRAPH}", add_special_tokens=False)
        i += 1
    return ids[:num_tokens]


async def _ttft(eng: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = eng.stream(prompt, max_tokens=8, ignore_eos=True)
    async for _ in stream:
        first = time.perf_counter() - t0
        await stream.aclose()
        return first
    raise AssertionError("no token")


async def resumed_chat(device: str, cache: bool, run: int) -> float:
    async with Engine(None, device=device, parallel=2, ctx=4096, prefix_cache=cache) as eng:
        turn1 = _text(3000, eng, f"run {run} note")
        done = await eng.complete(turn1, max_tokens=32, ignore_eos=True)
        turn2 = turn1 + done.token_ids + _text(30, eng, "question")
        return await _ttft(eng, turn2)


async def shared_system(device: str, cache: bool, run: int) -> float:
    async with Engine(None, device=device, parallel=8, ctx=4096, prefix_cache=cache) as eng:
        system = _text(2000, eng, f"run {run} rule")
        prompts = [system + _text(40, eng, f"question {i}") for i in range(8)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(eng.complete(p, max_tokens=32, ignore_eos=True)
                                      for p in prompts))
        wall = time.perf_counter() - t0
        return sum(len(p) + len(d.token_ids) for p, d in zip(prompts, done, strict=True)) / wall


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ttft: dict[bool, list[float]] = {True: [], False: []}
    rate: dict[bool, list[float]] = {True: [], False: []}
    for run in range(args.runs):
        for cache in (True, False) if run % 2 == 0 else (False, True):
            ttft[cache].append(await resumed_chat(args.device, cache, run))
            rate[cache].append(await shared_system(args.device, cache, run))
            print(f"run {run} cache={cache}: turn-2 TTFT {ttft[cache][-1]:.3f} s, "
                  f"8 streams {rate[cache][-1]:.0f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    agg = {k: statistics.median(v) for k, v in rate.items()}
    print(f"{'case':<44} {'cache':>10} {'no cache':>10} {'ratio':>7}")
    print(f"{'turn 2 after a 3,000-token turn 1: TTFT (s)':<44} {med[True]:>10.3f} "
          f"{med[False]:>10.3f} {med[False] / med[True]:>6.1f}x")
    print(f"{'8 streams, shared 2,000-token system (tok/s)':<44} {agg[True]:>10.0f} "
          f"{agg[False]:>10.0f} {agg[True] / agg[False]:>6.1f}x")
    print(f"(medians of {args.runs} alternating runs; device {args.device}; "
          f"raw TTFT {ttft}, raw tok/s {rate})")


if __name__ == "__main__":
    asyncio.run(main())
