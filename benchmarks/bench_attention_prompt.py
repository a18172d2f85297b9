"""Prompt attention on the GPU: attention.py's per-row partial kernel against the tiled kernel
(cuda_kernels/attention_tiled.py), one prompt step of n rows of one stream over its own n keys
(Qwen3-8B heads: 32 query heads, 8 KV heads, head_dim 128, bf16 KV), GPU ms of one launch pair
(partial + combine) as a CUDA-graph replay; and whether the outputs' bits agree (they must).

    python benchmarks/bench_attention_prompt.py [--rows 512,2048,8192]
"""

from __future__ import annotations

import argparse

import numpy as np
from graph_timing import graph_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="512,2048,8192")
    args = parser.parse_args()
    import cupy as cp
    from numba import cuda

    from cuda_kernels import attention as attn
    from cuda_kernels import launch

    nh, nkv, hd, page_size = 32, 8, 128, 16
    print(f"{'rows':>6} {'plain ms':>9} {'tiled ms':>9} {'x':>6} bits")
    for rows in (int(r) for r in args.rows.split(",")):
        pages = -(-rows // page_size)
        table = cp.arange(pages, dtype=cp.int32)[None]
        kv = (cp.random.standard_normal((2, pages * page_size, nkv, hd), dtype=cp.float32)
              .view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 bits
        q = cp.random.standard_normal((rows, nh, hd), dtype=cp.float32)
        row_seq, row_pos = cp.zeros(rows, cp.int32), cp.arange(rows, dtype=cp.int64)
        shape = attn.scratch_shape(rows, nh, hd, pages, page_size)
        scratch = cp.empty(shape, cp.float32)
        outs, times = [], []
        for tiled in (False, True):
            out = cp.full((rows, nh, hd), np.nan, cp.float32)
            dev = [cuda.as_cuda_array(a, sync=False) for a in (q, kv, table, row_seq, row_pos, scratch, out)]

            def record(stream, dev=dev, tiled=tiled) -> None:
                launch.attention(dev[0], dev[1], np.float32(1), np.float32(1), dev[2], dev[3], dev[4], page_size,
                                 np.float32(hd**-0.5), dev[6], cuda.external_stream(stream.ptr), scratch=dev[5],
                                 tiled=tiled)

            times.append(graph_seconds(cp, record))
            outs.append(out)
        same = bool(cp.array_equal(outs[0], outs[1]))
        print(f"{rows:6d} {times[0] * 1e3:9.2f} {times[1] * 1e3:9.2f} {times[0] / times[1]:6.2f} "
              f"{'same' if same else 'DIFF'}", flush=True)


if __name__ == "__main__":
    main()
