"""Launches to profile under Nsight Compute on a GPU: the batch-1 q4 matmul of Qwen3-8B's
gate|up shape (weights 24576 x 4096, group 64) and its decode attention (32 q heads, 8 KV
heads, head_dim 128, bf16 KV) at 72 and 2048 keys, each launched a few times.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats --section SchedulerStats \\
        python3 benchmarks/profile_kernels.py

With --few-rows N (N int8-x rows, 27B gate|up shape 34816 x 5120): instead, qdot's launch of N
rows and qmma's (each of --qmma-variants, ftiles:rtiles:unroll), each a few times: the
few-row matmul that 8-stream decode and verify rounds wait on (docs/KERNELS.md), and
qmma_few's (each of --few-variants, ftiles:rtiles:max_registers:stages).
"""

from __future__ import annotations

import numpy as np


def few_rows(rows: int, variants: str, few_variants: str) -> None:
    import cupy as cp
    from bench_matmul_variants import SHAPES
    from bench_qdot import quantized
    from bench_qmma import few_launcher, qdot_launcher, qmma_launcher
    from numba import cuda

    from cuda_kernels import qmma, qmma_few

    out_f, in_f = SHAPES["gate_up_27b"]
    rng = np.random.default_rng(0)
    words = cp.asarray(rng.integers(0, 2**32, (1, out_f, in_f // 8), dtype=np.uint32))
    scales = cp.asarray((rng.random((1, out_f, in_f // 64)) * 0.01).astype(np.float32))
    weights = [cuda.as_cuda_array(a) for a in (words, scales, -7.5 * scales)]
    xq, xs, quant = quantized(cp, cuda, cp.asarray(rng.standard_normal((rows, in_f)).astype(np.float32)))
    stream = cuda.external_stream(cp.cuda.get_current_stream().ptr)
    quant(stream)
    out = cp.empty((rows, out_f), cp.float32)
    dev = [cuda.as_cuda_array(a) for a in (xq.view(cp.uint32), xs, out)]
    launchers = [qdot_launcher(cuda, rows, out_f)]
    for v in variants.split(","):
        if v:
            launchers.append(qmma_launcher(rows, out_f, qmma.MmaVariant(*map(int, v.split(":")))))
    for v in few_variants.split(","):
        if v:
            launchers.append(few_launcher(rows, out_f, in_f, qmma_few.FewVariant(*map(int, v.split(":")))))
    for launch_one in launchers:
        for _ in range(3):
            launch_one(stream, dev, *weights)
    cp.cuda.runtime.deviceSynchronize()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--few-rows", type=int, default=0)
    parser.add_argument("--qmma-variants", default="2:2:2,2:1:2,1:1:4")
    parser.add_argument("--few-variants", default="1:1:0:3", help="qmma_few's, ftiles:rtiles:max_registers:stages")
    args = parser.parse_args()
    if args.few_rows:
        few_rows(args.few_rows, args.qmma_variants, args.few_variants)
        return
    import cupy as cp
    from numba import cuda

    from cuda_kernels import launch

    rng = np.random.default_rng(0)
    out_f, in_f = 24576, 4096
    words = cp.asarray(rng.integers(0, 2**32, (1, out_f, in_f // 8), dtype=np.uint32))
    scales = cp.asarray((rng.random((1, out_f, in_f // 64)) * 0.01).astype(np.float32))
    biases = -7.5 * scales
    x = cp.asarray(rng.standard_normal((1, in_f)).astype(np.float32))
    out = cp.empty((1, out_f), cp.float32)
    ids = cp.zeros(1, cp.int32)
    dev = [cuda.as_cuda_array(a) for a in (x, words, scales, biases, ids, out)]
    for _ in range(3):
        launch.matmul("q4", *dev[:4], 64, *dev[4:])
    page, nkv, hd, nh = 16, 8, 128, 32
    for keys in (72, 2048):
        pages = -(-keys // page)
        kv = cp.asarray(rng.integers(0, 0x3F00, (2, pages * page, nkv, hd), dtype=np.uint16))
        q = cp.asarray(rng.standard_normal((1, nh, hd)).astype(np.float32))
        table = cp.asarray(np.arange(pages, dtype=np.int32)[None])
        seq, pos = cp.zeros(1, cp.int32), cp.asarray(np.array([keys - 1], np.int64))
        o = cp.empty_like(q)
        args = [cuda.as_cuda_array(a) for a in (q, kv, table, seq, pos)]
        for _ in range(3):
            launch.attention(args[0], args[1], np.float32(1), np.float32(1), *args[2:], page,
                             np.float32(hd**-0.5), cuda.as_cuda_array(o))
    cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
