"""CPU paged attention, the per-(row, head) kernel (paged_attention_rows, session 11) against
the blocked one (paged_attention, session 13), at SmolLM2-135M shapes (9 query heads, 3 KV
heads, head_dim 64, bf16 KV, pages of 16 in a shuffled table): one layer's call for a whole
causal prompt of one stream, and one decode row.

    NUMBA_NUM_THREADS=2 python benchmarks/bench_cpu_attention.py [--reps 3] [--threads 1 2]
    NUMBA_NUM_THREADS=1 python benchmarks/bench_cpu_attention.py --prefill 3000 [--reps 2]

Prints the median of --reps timings per case (wall and CPU seconds of the process). --prefill
times a whole prompt of that many tokens through the Engine instead (default model, bf16 KV,
prefix cache off, steps of 512 tokens, one token generated), old and new kernel alternating,
with the CPU seconds spent inside the attention kernel (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from functools import partial

import numba
import numpy as np

from tf_async.backend.cpu import kernels
from tf_async.backend.cpu.ops import CpuOps
from tf_async.engine import threads

PAGE_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64
KERNELS = {"rows (old)": kernels.paged_attention_rows, "blocked (new)": kernels.paged_attention}


def arena(num_tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """bf16 KV of one stream holding num_tokens positions, its pages in shuffled order."""
    num_pages = -(-num_tokens // PAGE_SIZE)
    kv = CpuOps().alloc_kv(1, num_pages * PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, "bf16")
    pages = rng.permutation(num_pages).astype(np.int32)
    pos = np.arange(num_pages * PAGE_SIZE)
    slots = pages[pos // PAGE_SIZE].astype(np.int64) * PAGE_SIZE + pos % PAGE_SIZE
    k, v = (rng.standard_normal((pos.size, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
            for _ in range(2))
    CpuOps().kv_write(kv, 0, k, v, slots, None)
    return kv[0], pages[None]


def median_seconds(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """(median wall, median CPU) seconds of one call, after a warm-up call."""
    fn()
    walls, cpus = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def cases(rng: np.random.Generator) -> list[tuple[str, tuple]]:
    out = []
    for prompt in (256, 3000):
        kv_layer, table = arena(prompt, rng)
        q = rng.standard_normal((prompt, NUM_HEADS, HEAD_DIM)).astype(np.float32)
        pos = np.arange(prompt, dtype=np.int64)
        out.append((f"prompt {prompt} rows", (q, kv_layer, table, np.zeros(prompt, np.int32), pos)))
    kv_layer, table = arena(3001, rng)
    q = rng.standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    out.append(("decode 1 row at pos 3000",
                (q, kv_layer, table, np.zeros(1, np.int32), np.array([3000], np.int64))))
    return out


async def prefill_seconds(prompt_ids: list[int]) -> tuple[float, float]:
    from tf_async import Engine

    async with Engine(None, device="cpu", parallel=1, ctx=4096, kv_dtype="bf16", step_tokens=512,
                      prefix_cache=False) as engine:
        await engine.complete(prompt_ids[:600], max_tokens=1)  # compiles every kernel
        clock = kernels.paged_attention
        if isinstance(clock, AttentionClock):
            clock.seconds = 0.0  # the measured prompt only
        wall, cpu = time.perf_counter(), time.process_time()
        await engine.complete(prompt_ids, max_tokens=1)
        return time.perf_counter() - wall, time.process_time() - cpu


class AttentionClock:
    """kernels.paged_attention replaced by `kernel`, its CPU seconds (process) summed."""

    def __init__(self, kernel: Callable[..., None]):
        self.kernel, self.seconds = kernel, 0.0

    def __call__(self, *args: object) -> None:
        start = time.process_time()
        self.kernel(*args)
        self.seconds += time.process_time() - start


def bench_prefill(num_tokens: int, reps: int) -> None:
    """Old and new kernel alternating, through CpuOps.attention's call of
    kernels.paged_attention (patched for each run)."""
    prompt_ids = np.random.default_rng(0).integers(100, 40000, num_tokens).tolist()
    blocked = kernels.paged_attention
    print("| prefill | kernel | wall s | CPU s | CPU ms/token | attention CPU s |")
    print("|---|---|---|---|---|---|")
    times: dict[str, list[tuple[float, float, float]]] = {label: [] for label in KERNELS}
    for _ in range(reps):
        for label, kernel in KERNELS.items():
            clock = AttentionClock(kernel)
            kernels.paged_attention = clock
            wall, cpu = asyncio.run(prefill_seconds(prompt_ids))
            times[label].append((wall, cpu, clock.seconds))
    kernels.paged_attention = blocked
    for label, runs in times.items():
        wall, cpu, attention = (statistics.median(t[k] for t in runs) for k in range(3))
        print(f"| {num_tokens} tokens | {label} | {wall:.1f} | {cpu:.1f} | "
              f"{cpu / num_tokens * 1e3:.1f} | {attention:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefill", type=int, default=0, help="prompt tokens through the Engine")
    args = parser.parse_args()
    if args.prefill:
        bench_prefill(args.prefill, args.reps)
        return
    threads.choose_threading_layer()  # the engine's layer (tbb where it loads)
    print("| case | threads | kernel | wall ms (median) | CPU ms (median) | old/new (wall) |")
    print("|---|---|---|---|---|---|")
    for name, (q, kv_layer, table, row_seq, row_pos) in cases(np.random.default_rng(0)):
        for num_threads in args.threads:
            numba.set_num_threads(num_threads)
            walls = {}
            for label, kernel in KERNELS.items():
                call = partial(kernel, q, kv_layer, 1.0, 1.0, table, row_seq, row_pos, PAGE_SIZE,
                               0.125, np.empty_like(q))
                wall, cpu = median_seconds(call, args.reps)
                walls[label] = wall
                ratio = f"{walls['rows (old)'] / wall:.2f}x" if label != "rows (old)" else ""
                print(f"| {name} | {num_threads} | {label} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} "
                      f"| {ratio} |", flush=True)
    print("threading layer:", numba.threading_layer())


if __name__ == "__main__":
    main()
