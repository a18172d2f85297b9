"""The tensor-core affine matmul (cuda_kernels/qmma.py) against qdot's CUDA-core kernel
(cuda_kernels/qdot.py) at Qwen3-8B shapes, 4-bit group 64: GPU us a launch side by side in one
run, and whether every output's bits agree (they must: qmma reproduces qdot's reduction);
at 1..16 rows also the few-rows tensor-core kernel (cuda_kernels/qmma_few.py, "few").

Each figure: a CUDA graph of one launch per weight copy (enough copies to be ~8x the L2, so the
weights come from HBM), replayed 10 times (benchmarks/graph_timing.py); x is already int8
(quantize_rows runs once, outside the timing). "TB/s" is weight bytes over time; "Tops" is
2 * rows * out * in over time.

    python benchmarks/bench_qmma.py [--rows 8,32,512,2048] [--shapes qkv,o,gate_up,down]
        [--variants 1:1:4,1:4:4,2:4:2]
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_matmul_variants import SHAPES, weight_copies
from bench_qdot import quantized
from graph_timing import graph_seconds


def run_kernel(cp, cuda, copies, xq, xs, out, launch_one) -> float:
    dev = [cuda.as_cuda_array(a, sync=False) for a in (xq.view(cp.uint32), xs, out)]
    weights = [[cuda.as_cuda_array(a, sync=False) for a in parts] for parts in copies]

    def launch_all(stream) -> None:
        nstream = cuda.external_stream(stream.ptr)
        for w, s, b in weights:
            launch_one(nstream, dev, w, s, b)

    return graph_seconds(cp, launch_all) / len(copies)


def qdot_launcher(cuda, rows: int, out_f: int):
    from cuda_kernels import matmul as mm
    from cuda_kernels import qdot
    from cuda_kernels.launch import _go

    variant = qdot.plan(rows, out_f, "many" if rows > mm.FEW_ROWS_MAX else "few")
    kernel = qdot.qdot_kernel("q4", variant, 2)
    grid, block = mm.launch_shape(rows, out_f, variant)
    ids = cuda.to_device(np.zeros(1, np.int32))

    def launch_one(nstream, dev, w, s, b) -> None:
        _go(kernel, grid, block, nstream, dev[0], dev[1], w, s, b, ids, dev[2])

    return launch_one


def qmma_launcher(rows: int, out_f: int, variant):
    from cuda_kernels import qmma
    from cuda_kernels.launch import _go

    kernel = qmma.qmma_kernel("q4", variant, 2)
    grid, block = qmma.launch_shape(rows, out_f, variant)

    def launch_one(nstream, dev, w, s, b) -> None:
        _go(kernel, grid, block, nstream, dev[0], dev[1], w, s, b, dev[2])

    return launch_one


def few_launcher(rows: int, out_f: int, in_f: int, variant=None):
    from cuda_kernels import qmma_few
    from cuda_kernels.launch import _go

    variant = variant or qmma_few.plan(rows)
    kernel = qmma_few.qmma_few_kernel(variant, 2)
    grid, block = qmma_few.launch_shape(rows, out_f, variant)

    def launch_one(nstream, dev, w, s, b) -> None:
        _go(kernel, grid, block, nstream, dev[0], dev[1], w, s, b, dev[2])

    return launch_one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,512,2048")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--variants", default="")
    parser.add_argument("--few-variants", default="",
                        help="more qmma_few variants, ftiles:rtiles:max_registers:stages[:x_ring], comma-separated")
    args = parser.parse_args()
    import cupy as cp
    from numba import cuda

    from cuda_kernels import qmma, qmma_few

    few_extra = [qmma_few.FewVariant(*map(int, v.split(":"))) for v in args.few_variants.split(",") if v]
    extra = [qmma.MmaVariant(*map(int, v.split(":"))) for v in args.variants.split(",") if v]
    print(f"{'shape':8} {'rows':>5} {'qdot us':>9} {'qmma us':>9} {'x':>6} {'TB/s':>6} {'Tops':>6} bits  "
          + "  ".join(f"{v.ftiles}:{v.rtiles}:{v.unroll} us" for v in extra)
          + f"  {'few us':>8} {'few x':>6} {'TB/s':>6} bits  "
          + "  ".join(f"{v.ftiles}:{v.rtiles}:{v.max_registers}:{v.stages}:{int(v.x_ring)}" for v in few_extra))
    for name in args.shapes.split(","):
        out_f, in_f = SHAPES[name]
        copies, nbytes = weight_copies(cp, "q4", out_f, in_f)
        for rows in (int(r) for r in args.rows.split(",")):
            x = cp.random.standard_normal((rows, in_f), dtype=cp.float32)
            xq, xs, quant = quantized(cp, cuda, x)
            quant(cuda.external_stream(cp.cuda.get_current_stream().ptr))
            base_out = cp.full((rows, out_f), np.nan, cp.float32)
            t_qdot = run_kernel(cp, cuda, copies[:2] if rows > 512 else copies, xq, xs, base_out,
                                qdot_launcher(cuda, rows, out_f))
            run_kernel(cp, cuda, copies[:1], xq, xs, base_out, qdot_launcher(cuda, rows, out_f))
            times, same = [], True
            for variant in [qmma.plan(rows), *extra]:
                out = cp.full((rows, out_f), np.nan, cp.float32)
                launcher = qmma_launcher(rows, out_f, variant)
                times.append(run_kernel(cp, cuda, copies, xq, xs, out, launcher))
                run_kernel(cp, cuda, copies[:1], xq, xs, out, launcher)
                cp.cuda.get_current_stream().synchronize()
                same = same and bool(cp.array_equal(out, base_out))
            t = times[0]
            few = ""
            if qmma_few.supports("q4", rows, in_f, 64):
                few_times, few_same = [], True
                for fv in [None, *few_extra]:
                    if fv is not None and not qmma_few.fits(fv):
                        few_times.append(float("nan"))
                        continue
                    out = cp.full((rows, out_f), np.nan, cp.float32)
                    launcher = few_launcher(rows, out_f, in_f, fv)
                    few_times.append(run_kernel(cp, cuda, copies, xq, xs, out, launcher))
                    run_kernel(cp, cuda, copies[:1], xq, xs, out, launcher)
                    cp.cuda.get_current_stream().synchronize()
                    few_same = few_same and bool(cp.array_equal(out, base_out))
                t_few = few_times[0]
                few = (f"  {t_few * 1e6:8.1f} {t_qdot / t_few:6.2f} {nbytes / t_few / 1e12:6.2f} "
                       f"{'same' if few_same else 'DIFF'}  " + "  ".join(f"{f * 1e6:8.1f}" for f in few_times[1:]))
            print(f"{name:8} {rows:5d} {t_qdot * 1e6:9.1f} {t * 1e6:9.1f} {t_qdot / t:6.2f} "
                  f"{nbytes / t / 1e12:6.2f} {2 * rows * out_f * in_f / t / 1e12:6.1f} {'same' if same else 'DIFF'}  "
                  + "  ".join(f"{s * 1e6:9.1f}" for s in times[1:]) + few, flush=True)


if __name__ == "__main__":
    main()
