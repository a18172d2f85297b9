"""Numba threading layer and thread count of the CPU kernels: aggregate decode tok/s of the
default model through the in-process Engine, 1 then 8 concurrent greedy streams of 32 tokens,
one fresh process per (layer, threads) cell (the layer is fixed per process).

    python benchmarks/bench_threads.py [--layers omp workqueue] [--threads 2 1] [--repeats 2]

Run it on a machine whose cores are shared with other work to see the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time


async def measure(clients: int) -> float:
    from tf_async import Engine

    async with Engine(device="cpu", parallel=8, ctx=1024) as engine:
        await engine.warm_up()
        started = time.perf_counter()
        await asyncio.gather(*(engine.complete(f"Story {i}: a lighthouse keeper", max_tokens=32,
                                               ignore_eos=True) for i in range(clients)))
        return clients * 32 / (time.perf_counter() - started)


def cell(layer: str, threads: int, clients: int, timeout_s: float) -> str:
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer, "NUMBA_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--one", str(clients)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"> {timeout_s:.0f} s"
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=["omp", "workqueue"])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds a cell")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(f"{asyncio.run(measure(args.one)):.1f}")
        return
    print("| layer | threads | 1 stream tok/s | 8 streams tok/s |\n|---|---|---|---|")
    for _ in range(args.repeats):
        for layer in args.layers:
            for threads in args.threads:
                cells = [cell(layer, threads, clients, args.timeout) for clients in (1, 8)]
                print(f"| {layer} | {threads} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
