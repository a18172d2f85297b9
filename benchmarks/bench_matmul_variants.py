"""Matmul launch variants on the GPU (none changes a row's bits): which `Variant` (warps per
block, features per warp, words in flight) streams the weights of each Qwen3-8B-shaped linear
fastest at 1 and 8 rows, 4-bit affine (group 64) and bf16. Also the cost of one launch in a
CUDA graph (a graph of back-to-back tiny launches). Its 4-bit figures are of the float32-x
kernel (cuda_kernels/matmul.py), which the engine now runs only for affine weights that do
not take int8 x; benchmarks/bench_qdot.py measures the int8-x kernel the others run.

Each figure: one CUDA graph holding one launch per weight copy, enough copies to be several
times the L2 (so the weights come from HBM), replayed 10 times, timed with events; TB/s =
weight bytes (codes + scales + biases) per second. Prints a table; records nothing.

    python benchmarks/bench_matmul_variants.py [--kinds q4,bf16] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
from graph_timing import graph_seconds

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "k": (1024, 4096), "lm_head": (151936, 4096),
          # 27B-class hybrid (hidden 5120, intermediate 17408): gate|up and down
          "gate_up_27b": (34816, 5120), "down_27b": (5120, 17408)}
WORKING_SET = 400 << 20  # bytes of weight copies per measurement (~8x the H200's L2)


def weight_copies(cp, kind: str, out_f: int, in_f: int):
    per_word = 8 if kind == "q4" else 2
    one = out_f * in_f // per_word * 4 * (1.125 if kind == "q4" else 1)
    copies = []
    for _ in range(max(2, int(WORKING_SET // one))):
        words = (cp.random.random((1, out_f, in_f // per_word)) * 2.0**32).astype(cp.uint32)
        if kind == "q4":
            scales = cp.random.random((1, out_f, in_f // 64), dtype=cp.float32) * 0.01
            copies.append((words, scales, -7.5 * scales))
        else:
            none = cp.zeros((1, 1, 1), cp.float32)
            copies.append((words & cp.uint32(0x3FFF3FFF), none, none))
    return copies, sum(int(p.nbytes) for p in copies[0])


def time_variant(cp, cuda, kind, variant, copies, rows: int, in_f: int, out_f: int) -> float:
    from cuda_kernels import matmul as mm
    from cuda_kernels.launch import _go

    group_words = 8 if kind == "q4" else 0
    kernel = mm.matmul_kernel(kind, variant, group_words)
    grid, block = mm.launch_shape(rows, out_f, variant)
    x = cp.random.standard_normal((rows, in_f), dtype=cp.float32)
    out = cp.empty((rows, out_f), cp.float32)
    ids = cp.zeros(1, cp.int32)
    dev = [cuda.as_cuda_array(a, sync=False) for a in (x, ids, out)]
    weights = [[cuda.as_cuda_array(a, sync=False) for a in parts] for parts in copies]

    def launch_all(stream) -> None:
        nstream = cuda.external_stream(stream.ptr)
        for w, s, b in weights:
            _go(kernel, grid, block, nstream, dev[0], w, s, b, dev[1], dev[2])

    return graph_seconds(cp, launch_all) / len(copies)


def launch_cost(cp, cuda, count: int = 400) -> float:
    """Seconds per node of a graph of `count` dependent tiny launches."""

    @cuda.jit
    def bump(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] += 1.0

    a = cp.zeros(256, cp.float32)
    da = cuda.as_cuda_array(a, sync=False)

    def launch_all(stream) -> None:
        nstream = cuda.external_stream(stream.ptr)
        for _ in range(count):
            bump[1, 256, nstream](da)

    return graph_seconds(cp, launch_all) / count


def candidates(rows: int) -> list:
    from cuda_kernels import matmul as mm

    out = []
    shapes = ((1, 8), (1, 16), (2, 8), (2, 16), (4, 4), (4, 8), (8, 4))  # no spills (ptxas -v)
    for warps, (feats, unroll) in itertools.product((4, 8), shapes):
        out.append(mm.Variant(rows if rows <= 2 else 4, feats, unroll if rows <= 2 else 1, True, warps))
    if rows <= 2:  # L2 prefetch steps ahead for the usual winners
        for warps, feats, unroll in ((4, 2, 8), (8, 2, 8), (4, 4, 4)):
            for ahead in (1, 2):
                out.append(mm.Variant(rows, feats, unroll, True, warps, ahead))
    return out


def label(v) -> str:
    return f"({v.warps},{v.feats},{v.unroll:2d},a{v.ahead})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="q4,bf16")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    import cupy as cp
    from numba import cuda

    from cuda_kernels import matmul as mm

    print(f"one launch in a graph: {launch_cost(cp, cuda) * 1e6:.2f} us", flush=True)
    best = []
    for kind in args.kinds.split(","):
        for name in args.shapes.split(","):
            out_f, in_f = SHAPES[name]
            copies, nbytes = weight_copies(cp, kind, out_f, in_f)
            for rows in (int(r) for r in args.rows.split(",")):
                path = "few" if rows <= mm.FEW_ROWS_MAX else "many"
                default = mm.plan(rows, out_f, path, True)
                results = []
                for variant in [default, *candidates(rows)]:
                    try:
                        sec = time_variant(cp, cuda, kind, variant, copies, rows, in_f, out_f)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"  {kind} {name} {variant}: {type(exc).__name__}: {exc}")
                        continue
                    results.append((sec, variant))
                    tag = "default" if variant is default else ""
                    print(f"  {kind:4} {name:8} rows={rows:2d} {label(variant)}: {sec * 1e6:8.1f} us "
                          f"{nbytes / sec / 1e12:5.2f} TB/s {tag}", flush=True)
                sec, v = min(results, key=lambda r: r[0])
                d = results[0][0]
                best.append((kind, name, rows, v, sec, d, nbytes))
            del copies
            cp.get_default_memory_pool().free_all_blocks()
    print("\nkind shape    rows  best (warps,feats,unroll,ahead)  best us  TB/s  default us  TB/s")
    for kind, name, rows, v, sec, d, nbytes in best:
        print(f"{kind:4} {name:8} {rows:4d}  {label(v):24} {sec * 1e6:14.1f} "
              f"{nbytes / sec / 1e12:5.2f}  {d * 1e6:10.1f} {nbytes / d / 1e12:5.2f}")
    assert np.isfinite([b[4] for b in best]).all()


if __name__ == "__main__":
    main()
