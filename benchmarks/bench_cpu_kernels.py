"""Throughput of the CPU matmul and attention kernels at SmolLM2-135M shapes vs the machine's memory
bandwidth (a large NumPy copy measured in the same run).

    python benchmarks/bench_cpu_kernels.py [--reps N]

GB/s counts the weight bytes read (codes + scales + biases, or the float32 weights) once
per call; GFLOP/s counts 2 * rows * in * out.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from tf_async.backend.cpu import kernels
from tf_async.models.weights import AffineWeight, quantize_affine

SHAPES = [  # (out_features, in_features, bits): SmolLM2-135M projections and the 8-bit lm_head
    (576, 1536, 4),
    (1536, 576, 4),
    (576, 576, 4),
    (49152, 576, 8),
]
ROWS = (1, 4, 8, 64)
GROUP_SIZE = 32


def seconds_per_call(fn: Callable[[], None], reps: int) -> float:
    """Best of 3 timings of `reps` calls (after a warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def copy_bandwidth(num_bytes: int = 512 << 20) -> float:
    """GB/s of a large NumPy copy (read + write bytes)."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    t = seconds_per_call(lambda: np.copyto(dst, src), 3)
    return 2 * num_bytes / t / 1e9


def weight_bytes(w: AffineWeight) -> int:
    return w.codes.nbytes + w.scales.nbytes + w.biases.nbytes


def bench_affine(out_f: int, in_f: int, bits: int, reps: int, rng: np.random.Generator) -> None:
    w = quantize_affine(rng.standard_normal((out_f, in_f)).astype(np.float32), bits, GROUP_SIZE)
    for rows in ROWS:
        x = rng.standard_normal((rows, in_f)).astype(np.float32)
        out = np.empty((rows, out_f), np.float32)
        n = max(1, reps * 576 * 576 // (out_f * in_f))
        t = seconds_per_call(lambda x=x, out=out: kernels.matmul_affine(
            x, w.codes, w.scales, w.biases, bits, GROUP_SIZE, out), n)
        report(f"affine{bits} {out_f}x{in_f}", rows, t, weight_bytes(w), 2 * rows * in_f * out_f)


def bench_dense(out_f: int, in_f: int, reps: int, rng: np.random.Generator) -> None:
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    for rows in ROWS:
        x = rng.standard_normal((rows, in_f)).astype(np.float32)
        out = np.empty((rows, out_f), np.float32)
        n = max(1, reps * 576 * 576 // (out_f * in_f))
        t = seconds_per_call(lambda x=x, out=out: kernels.matmul_dense(x, w, out), n)
        report(f"dense {out_f}x{in_f}", rows, t, w.nbytes, 2 * rows * in_f * out_f)


def bench_attention(reps: int, rng: np.random.Generator) -> None:
    """Decode attention of one row (SmolLM2: 9 heads, 3 KV heads, head_dim 64) over f32 KV."""
    page_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    kv_layer = rng.standard_normal((2, 4096, num_kv_heads, head_dim)).astype(np.float32)
    block_table = np.arange(4096 // page_size, dtype=np.int32)[None]
    q = rng.standard_normal((1, num_heads, head_dim)).astype(np.float32)
    out = np.empty_like(q)
    for num_keys in (100, 1000, 4000):
        pos = np.array([num_keys - 1], np.int64)
        t = seconds_per_call(lambda pos=pos: kernels.paged_attention(
            q, kv_layer, 1.0, 1.0, block_table, np.zeros(1, np.int32), pos, page_size, 0.125,
            out), max(1, reps // 4))
        kv_bytes = 2 * num_keys * num_kv_heads * head_dim * 4
        report(f"attention f32 ctx {num_keys}", 1, t, kv_bytes,
               4 * num_keys * num_heads * head_dim)


def report(name: str, rows: int, seconds: float, num_bytes: int, flops: int) -> None:
    print(f"{name:<22} {rows:>5} {seconds * 1e6:>10.1f} {num_bytes / seconds / 1e9:>8.2f} "
          f"{flops / seconds / 1e9:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"memory bandwidth (NumPy copy, read+write): {copy_bandwidth():.2f} GB/s")
    print(f"{'kernel':<22} {'rows':>5} {'us/call':>10} {'GB/s':>8} {'GFLOP/s':>9}")
    for out_f, in_f, bits in SHAPES:
        bench_affine(out_f, in_f, bits, args.reps, rng)
    bench_dense(576, 1536, args.reps, rng)
    bench_attention(args.reps, rng)


if __name__ == "__main__":
    main()
