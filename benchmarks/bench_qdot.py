"""The 4-bit matmul on 8-bit activations (cuda_kernels/qdot.py) against the f32-activation
kernel (cuda_kernels/matmul.py) at Qwen3-8B shapes: GPU us a launch, side by side in one run.

Each figure: a CUDA graph of one launch per weight copy (enough copies to be ~8x the L2, so
the weights come from HBM), replayed 10 times (benchmarks/graph_timing.py). "quant" is one
quantize_rows launch of x (the qdot kernel's input), timed the same way; "qdot+quant" adds it.
Also the error of each kernel against float64 on the same inputs. Prints a table.

    python benchmarks/bench_qdot.py [--rows 1,8] [--shapes qkv,o,gate_up,down,lm_head]
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matmul_variants import SHAPES, time_variant, weight_copies
from graph_timing import graph_seconds


def qdot_variants(rows: int, out_f: int) -> list:
    """The planned variant of this shape first, then the candidates."""
    from cuda_kernels import matmul as mm
    from cuda_kernels import qdot

    if rows > 2:
        # 16 rows a block read each weight half as often as 8 (prompt steps); ptxas (sm_90):
        # (8,4) 228 registers, (16,2) 186, (16,4) 252, (32,2) spills
        return [qdot.plan(rows, out_f, "many"), mm.Variant(4, 4, 1, True), mm.Variant(8, 4, 1, True),
                mm.Variant(8, 2, 1, True), mm.Variant(8, 4, 1, True, 8), mm.Variant(16, 2, 1, True),
                mm.Variant(16, 2, 1, True, 8)]
    out = [qdot.plan(rows, out_f, "few")]
    for warps, feats, unroll in ((4, 1, 4), (4, 2, 1), (4, 2, 4), (4, 4, 1), (4, 4, 2), (8, 2, 2), (8, 1, 4)):
        out.append(mm.Variant(rows, feats, unroll, True, warps))
    return out


def quantized(cp, cuda, x, kind: str = "q4"):
    from cuda_kernels import qdot
    from cuda_kernels.launch import _go

    rows, k = x.shape
    xq = cp.empty((rows, k), cp.int8)
    xs = cp.empty((rows, 2 * k // qdot.CHUNK), cp.float32)
    dev = [cuda.as_cuda_array(a, sync=False) for a in (x, xq, xs)]
    grid, block = qdot.quantize_shape(rows, k)

    def run(nstream) -> None:
        _go(qdot.quantize_rows, grid, block, nstream, dev[0], kind == "q4", dev[1], dev[2])

    return xq, xs, run


def time_qdot(cp, cuda, variant, copies, x, out_f: int) -> tuple[float, float, object]:
    from cuda_kernels import matmul as mm
    from cuda_kernels import qdot
    from cuda_kernels.launch import _go

    rows = x.shape[0]
    xq, xs, quant = quantized(cp, cuda, x)
    kernel = qdot.qdot_kernel("q4", variant, 2)
    grid, block = mm.launch_shape(rows, out_f, variant)
    out = cp.empty((rows, out_f), cp.float32)
    ids = cp.zeros(1, cp.int32)
    dev = [cuda.as_cuda_array(a, sync=False) for a in (xq.view(cp.uint32), xs, ids, out)]
    weights = [[cuda.as_cuda_array(a, sync=False) for a in parts] for parts in copies]

    def launch_all(stream) -> None:
        nstream = cuda.external_stream(stream.ptr)
        quant(nstream)
        for w, s, b in weights:
            _go(kernel, grid, block, nstream, dev[0], dev[1], w, s, b, dev[2], dev[3])

    total = graph_seconds(cp, launch_all) / len(copies)

    def quant_all(stream) -> None:
        nstream = cuda.external_stream(stream.ptr)
        for _ in range(len(copies)):
            quant(nstream)

    return total, graph_seconds(cp, quant_all) / len(copies), out


def errors(cp, cuda, copies, x, out_f: int, variant) -> tuple[float, float]:
    """Relative errors against float64 of the f32 kernel and of the qdot kernel (copy 0)."""
    from cuda_kernels import launch

    w, s, b = copies[0]
    codes = cp.asnumpy(w[0])
    shifts = np.arange(8, dtype=np.uint32) * 4
    q = ((codes[:, :, None] >> shifts) & 15).reshape(out_f, -1).astype(np.float64)
    deq = q * np.repeat(cp.asnumpy(s[0]), 64, -1) + np.repeat(cp.asnumpy(b[0]), 64, -1)
    ref = cp.asnumpy(x).astype(np.float64) @ deq.T
    out = cp.full((x.shape[0], out_f), np.nan, cp.float32)
    launch.matmul("q4", x, w, s, b, 64, cp.zeros(1, cp.int32), out)
    _, _, qout = time_qdot(cp, cuda, variant, copies[:1], x, out_f)
    rel = [float(np.linalg.norm(cp.asnumpy(o) - ref) / np.linalg.norm(ref)) for o in (out, qout)]
    return rel[0], rel[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    args = parser.parse_args()
    import cupy as cp
    from numba import cuda

    from cuda_kernels import matmul as mm

    lines = []
    for name in args.shapes.split(","):
        out_f, in_f = SHAPES[name]
        copies, nbytes = weight_copies(cp, "q4", out_f, in_f)
        for rows in (int(r) for r in args.rows.split(",")):
            x = cp.random.standard_normal((rows, in_f), dtype=cp.float32)
            path = "few" if rows <= mm.FEW_ROWS_MAX else "many"
            base = time_variant(cp, cuda, "q4", mm.plan(rows, out_f, path, True), copies, rows, in_f, out_f)
            results = []
            for variant in qdot_variants(rows, out_f):
                total, quant, _ = time_qdot(cp, cuda, variant, copies, x, out_f)
                results.append((total - quant, quant, variant))
                print(f"  {name:8} rows={rows:2d} f32-x {base * 1e6:7.1f} us  qdot "
                      f"({variant.rows_tile},{variant.warps},{variant.feats},{variant.unroll}) "
                      f"{(total - quant) * 1e6:7.1f} us {nbytes / (total - quant) / 1e12:5.2f} TB/s"
                      f"  quant {quant * 1e6:5.2f} us", flush=True)
            sec, quant, best = min(results, key=lambda r: r[0])
            err = errors(cp, cuda, copies, x, out_f, best)
            lines.append((name, rows, base, results[0][0], sec, best, quant, nbytes, err))
        del copies
        cp.get_default_memory_pool().free_all_blocks()
    print("\nshape    rows  f32-x us  TB/s  qdot planned us  best us (rows,warps,feats,unroll)  TB/s  "
          "quant us  err f32-x  err qdot")
    for name, rows, base, planned, sec, v, quant, nbytes, (e0, e1) in lines:
        print(f"{name:8} {rows:4d} {base * 1e6:9.1f} {nbytes / base / 1e12:5.2f} {planned * 1e6:16.1f} "
              f"{sec * 1e6:8.1f} ({v.rows_tile},{v.warps},{v.feats},{v.unroll}){'':17} "
              f"{nbytes / sec / 1e12:5.2f} {quant * 1e6:9.2f} {e0:10.2e} {e1:9.2e}")


if __name__ == "__main__":
    main()
