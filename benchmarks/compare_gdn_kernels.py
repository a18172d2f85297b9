"""Another tree's cuda_kernels/gdn.py (--old, e.g. a `git archive` of the previous commit)
against this one's: the batched conv and delta rule's outputs and states compared bit for bit
at 35B-A3B GDN shapes (1/8/32 streams with a frozen lane, a 64-row prompt, two 33-row runs).
A kernel change that should keep the bits is checked with it on a GPU (needs CuPy):

    python3 benchmarks/compare_gdn_kernels.py --old /tmp/old_tree/cuda_kernels/gdn.py
"""
import argparse
import importlib.util

import cupy as cp
import numpy as np

from cuda_kernels import gdn as new

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--old", required=True, help="the other tree's cuda_kernels/gdn.py")
spec = importlib.util.spec_from_file_location("old_gdn", parser.parse_args().old)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
rng = np.random.default_rng(0)
HK, HV, D, K = 16, 32, 128, 4
C = 2 * HK * D + HV * D
CASES = [("1 stream", 1, 4, [2]), ("8 streams", 8, 10, [3, 1, 0, 5, 9, 7, 2, 4]),
         ("32 streams", 32, 40, list(range(39, 7, -1))), ("prompt 64", 64, 4, [2] * 64),
         ("2 x 33 rows", 66, 4, [1] * 33 + [3] * 33)]


def _f32(shape, scale=1.0):
    return cp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)


def inputs(rows, slots, row_seq):
    fused = _f32((rows, C + 7), 0.3)  # q, k, v as views of one matmul's output, as the engine has them
    q = fused[:, :HK * D].reshape(rows, HK, D)
    k = fused[:, HK * D:2 * HK * D].reshape(rows, HK, D)
    q /= cp.linalg.norm(q, axis=-1, keepdims=True)
    k /= cp.linalg.norm(k, axis=-1, keepdims=True)
    frozen = cp.zeros(slots, cp.uint8)
    if 1 in row_seq:
        frozen[1] = 1
    return {"q": q, "k": k, "v": fused[:, 2 * HK * D:C].reshape(rows, HV, D),
            "g": -cp.abs(_f32((rows, HV))), "beta": cp.asarray(rng.uniform(0, 1, (rows, HV)), cp.float32),
            "states": _f32((slots, HV, D, D), 0.1), "conv_states": _f32((slots, K - 1, C)),
            "weight": _f32((C, K), 0.5), "x": _f32((rows, C)), "frozen": frozen,
            "row_seq": cp.asarray(row_seq, cp.int32)}


def run(mod, d, which):
    """(output bits, state bits) of one launch of `which` from module `mod`."""
    if which == "delta":
        state = d["states"].copy()
        out = cp.full((d["q"].shape[0], HV, D), cp.nan, cp.float32)
        mod.gated_delta_rule_batch(d["q"], d["k"], d["v"], d["g"], d["beta"], state, d["row_seq"],
                                   d["frozen"], out)
    else:
        state = d["conv_states"].copy()
        out = cp.full(d["x"].shape, cp.nan, cp.float32)
        mod.causal_conv1d_batch(d["x"], state, d["weight"], d["row_seq"], d["frozen"], out)
    cp.cuda.runtime.deviceSynchronize()
    return cp.asnumpy(out).view(np.uint32), cp.asnumpy(state).view(np.uint32)


print(f"{'case':>14} {'kernel':>6}  bits")
for name, rows, slots, seq in CASES:
    data = inputs(rows, slots, seq)
    for which in ("conv", "delta"):
        a, b = run(old, data, which), run(new, data, which)
        same = np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        print(f"{name:>14} {which:>6}  {'same' if same else 'DIFF'}", flush=True)
