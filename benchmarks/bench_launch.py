"""Host cost of one eager GPU op, in parts: where a non-graph round's time goes (bench_gpu's
"eager ms"). Each figure is microseconds of host time per call, the median of batches of calls
ended by one synchronize (the GPU work itself is a few microseconds).

    python benchmarks/bench_launch.py

  as_cuda_array        CuPy array -> Numba device array view (CudaOps._dev), per array
  numba launch, N args a Numba kernel launch with N pre-made device-array arguments
  CudaOps.rms_norm     the whole op: checks, allocation, views, launch
  cupy elementwise     a CuPy elementwise op (x * 2), for scale
"""

from __future__ import annotations

import statistics
import time


def per_call_us(fn, calls: int = 200, batches: int = 7) -> float:
    import cupy as cp

    fn()
    cp.cuda.runtime.deviceSynchronize()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        cp.cuda.runtime.deviceSynchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    import cupy as cp
    import numpy as np
    from numba import cuda

    from tf_async.backend.cuda_ops import CudaOps

    ops = CudaOps()
    x = cp.random.standard_normal((1, 4096), dtype=cp.float32)
    w = cp.ones(4096, cp.float32)

    @cuda.jit
    def touch(a, b, c, d, e, f):  # six arrays, like a matmul launch
        if cuda.grid(1) == 0:
            a[0, 0] = b[0] + c[0, 0] + d[0, 0] + e[0, 0] + f[0, 0]

    views = [cuda.as_cuda_array(x, sync=False), cuda.as_cuda_array(w, sync=False)]
    mats = [cuda.as_cuda_array(x, sync=False) for _ in range(4)]
    rows = [
        ("as_cuda_array", per_call_us(lambda: cuda.as_cuda_array(x, sync=False))),
        ("numba launch, 6 args", per_call_us(lambda: touch[1, 32](views[0], views[1], *mats))),
        ("CudaOps.rms_norm", per_call_us(lambda: ops.rms_norm(x, w, 1e-6))),
        ("cupy elementwise", per_call_us(lambda: x * np.float32(2.0))),
    ]
    print("\nhost us per call")
    for name, us in rows:
        print(f"  {name:24} {us:8.1f}")


if __name__ == "__main__":
    main()
