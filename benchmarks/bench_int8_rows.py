"""One-row int8-x matmuls (`tf_async.backend.cpu.int8_matmul.matmul`) at the default model's
shapes on one thread: the median time of a decode-sized call, for A/B runs of the kernel.

    python benchmarks/bench_int8_rows.py [--label NAME]
    PYTHONPATH=/path/to/old/tree python benchmarks/bench_int8_rows.py --label old

Run old and new alternately in separate processes: this machine's speed moves between minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from tf_async.backend.cpu import int8_matmul

SHAPES = ((1536, 576, 4), (576, 1536, 4), (960, 576, 4), (49152, 576, 8))  # out, in, bits
GROUP_SIZE = 32


def median_us(out_f: int, in_f: int, bits: int, rng: np.random.Generator) -> float:
    per_word = 32 // bits
    codes = rng.integers(0, 2**32, (out_f, in_f // per_word), dtype=np.uint64).astype(np.uint32)
    scales = rng.standard_normal((out_f, in_f // GROUP_SIZE)).astype(np.float32)
    biases = scales.copy()
    x = rng.standard_normal((1, in_f)).astype(np.float32)
    out = np.empty((1, out_f), np.float32)

    def call() -> None:
        int8_matmul.matmul(x, (codes,), (scales,), (biases,), bits, GROUP_SIZE, out)

    for _ in range(20):
        call()
    times = []
    for _ in range(200 if out_f < 10000 else 30):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="this tree")
    args = parser.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    cells = [f"{o}x{i}/{b} {median_us(o, i, b, rng):.1f} us" for o, i, b in SHAPES]
    print(args.label, " | ".join(cells))


if __name__ == "__main__":
    main()
