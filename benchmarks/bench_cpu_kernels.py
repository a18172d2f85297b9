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
from functools import partial

import numpy as np

from tf_async.backend.cpu import kernels
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.weights import AffineWeight, Linear, quantize_affine

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
        t = seconds_per_call(partial(kernels.matmul_affine, x, w.codes, w.scales, w.biases,
                                     bits, GROUP_SIZE, out), n)
        report(f"affine{bits} {out_f}x{in_f}", rows, t, weight_bytes(w), 2 * rows * in_f * out_f)


def bench_dense(out_f: int, in_f: int, reps: int, rng: np.random.Generator) -> None:
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    for rows in ROWS:
        x = rng.standard_normal((rows, in_f)).astype(np.float32)
        out = np.empty((rows, out_f), np.float32)
        n = max(1, reps * 576 * 576 // (out_f * in_f))
        t = seconds_per_call(partial(kernels.matmul_dense, x, w, out), n)
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
        t = seconds_per_call(partial(kernels.paged_attention, q, kv_layer, 1.0, 1.0, block_table,
                                     np.zeros(1, np.int32), pos, page_size, 0.125, out),
                             max(1, reps // 4))
        kv_bytes = 2 * num_keys * num_kv_heads * head_dim * 4
        report(f"attention f32 ctx {num_keys}", 1, t, kv_bytes,
               4 * num_keys * num_heads * head_dim)


def bench_decode_step(rng: np.random.Generator, context: int = 100) -> None:
    """One SmolLM2-135M decode step (30 layers, 4-bit projections, 8-bit lm_head, one row)
    through CpuOps, Python overhead included."""
    ops = CpuOps()
    hidden, inter, heads, kv_heads, hd, page_size = 576, 1536, 9, 3, 64, 16

    def q4(out_f: int, in_f: int) -> Linear:
        w = (rng.standard_normal((out_f, in_f)) * 0.05).astype(np.float32)
        return ops.upload_linear(quantize_affine(w, 4, GROUP_SIZE))

    layers = [[q4(576, 576), q4(192, 576), q4(192, 576), q4(576, 576), q4(inter, hidden),
               q4(inter, hidden), q4(hidden, inter)] for _ in range(30)]
    lm_head = ops.upload_linear(quantize_affine(
        (rng.standard_normal((49152, hidden)) * 0.05).astype(np.float32), 8, GROUP_SIZE))
    norm = np.ones(hidden, np.float32)
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32)
    kv = ops.alloc_kv(30, 4096, kv_heads, hd, "f32")
    table = np.arange(4096 // page_size, dtype=np.int32)[None]
    pos, row_seq = np.array([context], np.int64), np.zeros(1, np.int32)
    slots = pos.copy()

    def step() -> None:
        h = rng.standard_normal((1, hidden)).astype(np.float32)
        for i, (wq, wk, wv, wo, wg, wu, wd) in enumerate(layers):
            a = ops.rms_norm(h, norm, 1e-5)
            q = ops.linear(a, wq).reshape(1, heads, hd)
            k, v = (ops.linear(a, w).reshape(1, kv_heads, hd) for w in (wk, wv))
            ops.rope(q, pos, inv_freq, 1.0)
            ops.rope(k, pos, inv_freq, 1.0)
            ops.kv_write(kv, i, k, v, slots, None)
            o = ops.attention(q, kv, i, None, table, row_seq, pos, page_size, 0.125)
            h = h + ops.linear(o.reshape(1, hidden), wo)
            a = ops.rms_norm(h, norm, 1e-5)
            h = h + ops.linear(ops.silu_mul(ops.linear(a, wg), ops.linear(a, wu)), wd)
        ops.linear(ops.rms_norm(h, norm, 1e-5), lm_head)

    t = seconds_per_call(step, 10)
    print(f"decode step (SmolLM2-135M shapes, ctx {context}): {t * 1e3:.2f} ms "
          f"= {1 / t:.1f} tokens/s")


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
    bench_decode_step(rng)


if __name__ == "__main__":
    main()
