"""Checks of every CUDA kernel against float64 NumPy references (and the CPU twins when
tf_async/backend/cpu/kernels.py exists).

Run under Numba's CUDA simulator: `NUMBA_ENABLE_CUDASIM=1 python tests/cuda_sim_check.py
[names...]` (the variable must be set before numba.cuda is imported, hence a separate
process; tests/test_cuda_sim.py does that). tests/test_gpu_kernels.py reuses the
references at real sizes on a GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

# ---------------------------------------------------------------- references (float64)


def bf16_bits_ref(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40) & 0xFFFF
    return rounded.astype(np.uint16)


def bf16_value_ref(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_table() -> np.ndarray:
    """Float value of each of the 256 E4M3FN codes (NaN for 0x7F, 0xFF)."""
    codes = np.arange(256)
    exp = (codes >> 3) & 15
    mant = (codes & 7).astype(np.float64)
    val = np.where(exp == 0, mant / 512.0, (1.0 + mant / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where(codes & 0x80, -val, val)
    val[(exp == 15) & ((codes & 7) == 7)] = np.nan
    return val


def e4m3_ref(y: np.ndarray) -> np.ndarray:
    """Nearest E4M3FN code, ties to the even code, saturating to +-448, NaN -> 0x7F."""
    table = e4m3_table()
    pos = np.arange(0x7F)  # non-negative finite codes 0..0x7E, increasing in value
    a = np.minimum(np.abs(y.astype(np.float64)), 448.0)
    idx = np.clip(np.searchsorted(table[pos], a), 1, 0x7E)
    lo, hi = table[idx - 1], table[idx]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (idx % 2 == 0))
    code = np.where(pick_hi, idx, idx - 1)
    code = np.where(a <= 0, 0, code)
    code = np.where(np.signbit(y), code | 0x80, code)
    return np.where(np.isnan(y), 0x7F, code).astype(np.uint8)


def kv_values_ref(kv_layer: np.ndarray, scales: tuple[float, float]) -> np.ndarray:
    """[2, slots, nkv, hd] of any KV dtype -> float64 values."""
    if kv_layer.dtype == np.float32:
        return kv_layer.astype(np.float64)
    if kv_layer.dtype == np.uint16:
        return bf16_value_ref(kv_layer).astype(np.float64)
    vals = e4m3_table()[kv_layer]
    return vals * np.array(scales, dtype=np.float64)[:, None, None, None]


def attention_ref(q, kv_layer, scales, block_table, row_seq, row_pos, page_size, sm_scale):
    vals = kv_values_ref(kv_layer, scales)
    rows, num_heads, head_dim = q.shape
    group = num_heads // kv_layer.shape[2]
    out = np.zeros((rows, num_heads, head_dim))
    for r in range(rows):
        pos = np.arange(row_pos[r] + 1)
        slots = block_table[row_seq[r], pos // page_size].astype(np.int64) * page_size + pos % page_size
        for h in range(num_heads):
            keys = vals[0, slots, h // group]
            s = keys @ q[r, h].astype(np.float64) * sm_scale
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ vals[1, slots, h // group]
    return out


def rms_norm_ref(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w


def rope_ref(x, positions, inv_freq, mscale):
    out = x.astype(np.float64).copy()
    half = inv_freq.shape[0]
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)
    cos, sin = (np.cos(ang) * mscale)[:, None, :], (np.sin(ang) * mscale)[:, None, :]
    x1, x2 = out[..., :half].copy(), out[..., half : 2 * half].copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out


def silu_mul_ref(gate, up):
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * up


def moe_route_ref(logits, top_k, norm):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, -1)
    if norm:
        w = w / w.sum(-1, keepdims=True)
    return ids.astype(np.int32), w


def argmax_ref(logits: np.ndarray) -> np.ndarray:
    """The device's greedy token of each row: the first id of the largest non-NaN logit (a NaN
    never wins, a -inf does); a row of NaN only: 0."""
    out = np.zeros(logits.shape[0], np.int64)
    for r, row in enumerate(logits):
        real = np.flatnonzero(~np.isnan(row))
        if real.size:
            out[r] = real[np.argmax(row[real])]
    return out


def int8_x_ref(x: np.ndarray) -> np.ndarray:
    """x as the int8-activation matmul sees it (cuda_kernels/qdot.py), float64: per chunk of
    32, the exact x * (127 / amax) to the nearest integer (ties to even) times amax / 127."""
    rows, k = x.shape
    chunks = np.ascontiguousarray(x, np.float32).reshape(rows, k // 32, 32)
    amax = np.abs(chunks).max(-1)
    d = amax / np.float32(127.0)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(chunks.astype(np.float64) * inv[..., None].astype(np.float64)), -127, 127)
    return (q * d[..., None].astype(np.float64)).reshape(rows, k)


def affine_x_ref(x: np.ndarray, group_size: int) -> np.ndarray:
    """The x an affine matmul multiplies: int8_x_ref(x) where the int8-activation kernel
    takes the weight (cuda_kernels.qdot.supports), x itself otherwise."""
    from cuda_kernels import qdot

    return int8_x_ref(x) if qdot.supports(x.shape[1], group_size) else x.astype(np.float64)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


# ---------------------------------------------------------------- inputs


def affine_weight(rng: np.random.Generator, experts: int, out_f: int, in_f: int, bits: int, gs: int):
    """Random packed codes and scales: (codes, scales, biases, dequantized float64)."""
    per_word = 32 // bits
    q = rng.integers(0, 1 << bits, size=(experts, out_f, in_f), dtype=np.uint32)
    words = q.reshape(experts, out_f, in_f // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    codes = np.bitwise_or.reduce(words << shifts, axis=-1).astype(np.uint32)
    scales = rng.uniform(0.001, 0.02, size=(experts, out_f, in_f // gs)).astype(np.float32)
    biases = rng.uniform(-0.1, 0.1, size=(experts, out_f, in_f // gs)).astype(np.float32)
    deq = q.astype(np.float64) * np.repeat(scales, gs, -1) + np.repeat(biases, gs, -1)
    return codes, scales, biases, deq


def paged_setup(rng: np.random.Generator, seqs: int, max_pages: int, page_size: int, nkv: int, hd: int):
    """A shuffled page table over a pool with spare pages, and random f32 K/V in it."""
    num_pages = seqs * max_pages + 2
    perm = rng.permutation(num_pages)[: seqs * max_pages]
    block_table = perm.reshape(seqs, max_pages).astype(np.int32)
    kv = rng.standard_normal((2, num_pages * page_size, nkv, hd)).astype(np.float32)
    return block_table, kv


def to_kv_dtype(kv: np.ndarray, kind: str, scales: tuple[float, float]) -> np.ndarray:
    if kind == "f32":
        return kv.copy()
    if kind == "bf16":
        return bf16_bits_ref(kv)
    return np.stack([e4m3_ref(kv[0] / scales[0]), e4m3_ref(kv[1] / scales[1])])


# ---------------------------------------------------------------- simulator checks


def check_matmul(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    rows, in_f, out_f = 3, 256, 9
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    for kind, bits in (("q4", 4), ("q8", 8)):
        codes, scales, biases, deq = affine_weight(rng, 1, out_f, in_f, bits, 64)
        results = {}
        for path in ("few", "many"):
            out = np.full((rows, out_f), np.nan, np.float32)
            placeholder = np.zeros(1, np.int32)
            launch.matmul(kind, x, codes, scales, biases, 64, placeholder, out, path=path)
            results[path] = out
            assert rel_err(out, affine_x_ref(x, 64) @ deq[0].T) < 1e-5, (kind, path)
        assert np.array_equal(results["few"], results["many"]), kind
    _check_dense_matmul(rng, x, out_f)
    for case in matmul_cases(rng, rows=7, out_f=5):
        _check_matmul_invariance(*case)
    _check_full_steps(rng)
    _check_tensor_core_matmul(rng)
    _check_tensor_core_routing()
    _check_few_rows_tensor_core_matmul(rng)


def _check_tensor_core_matmul(rng: np.random.Generator) -> None:
    """The tensor-core path of int8-x weights (cuda_kernels/qmma.py, mma emulated) gives the
    few-rows path's bits (cuda_kernels/qdot.py) for every epilogue, at chunk counts that leave
    some warps without a last chunk, a partial feature block and a partial row block, and at
    more than 32 rows (the prompt-sized tiles)."""
    from cuda_kernels import launch

    for kind, bits, in_f, gs, out_f, rows, epilogue in (
        ("q8", 8, 1088, 32, 19, 5, "store"), ("q4", 4, 1280, 64, 34, 11, "swiglu"),
        ("q4", 4, 352, 32, 9, 3, "add"), ("q4", 4, 128, 128, 17, 37, "store"),
    ):
        codes, scales, biases, deq = affine_weight(rng, 1, out_f, in_f, bits, gs)
        x = rng.standard_normal((rows, in_f)).astype(np.float32)
        width = out_f // 2 if epilogue == "swiglu" else out_f
        start = rng.standard_normal((rows, width)).astype(np.float32)
        outs = {}
        for path in ("few", "mma"):
            outs[path] = start.copy() if epilogue == "add" else np.full((rows, width), np.nan, np.float32)
            launch.matmul(kind, x, codes, scales, biases, gs, np.zeros(1, np.int32), outs[path], path=path,
                          epilogue=epilogue)
        assert np.array_equal(outs["few"], outs["mma"]), (kind, in_f, epilogue)
        if epilogue == "store":
            assert rel_err(outs["mma"], affine_x_ref(x, gs) @ deq[0].T) < 1e-5, (kind, in_f)


def _check_few_rows_tensor_core_matmul(rng: np.random.Generator) -> None:
    """The few-rows tensor-core path (cuda_kernels/qmma_few.py, mma and shuffles emulated)
    gives qdot's bits for every epilogue: chunk counts that leave warps without a last step
    (36 and 44 chunks: 4 and 12 past a whole step), groups of 1, 2 and 4 chunks, partial
    feature blocks, 1 to 11 rows (11: two row blocks), in plan()'s variant (32 features a
    block, the block's x through the ring); also 16 rows a block (2-step rings), 32 features
    a block with the weights through the ring, and session 23's 16-feature ring."""
    from cuda_kernels import qmma_few as qf

    _check_few_rows_cases(rng, ((1152, 64, 19, 3, "store"), (1024, 32, 34, 11, "swiglu"),
                                (1408, 128, 16, 1, "add")))
    try:
        qf.VARIANT = qf.FewVariant(1, 2, stages=2)
        _check_few_rows_cases(rng, ((1152, 64, 19, 13, "store"),))
        qf.VARIANT = qf.FewVariant(2, 1, stages=2)  # 32 features a block (swiglu: 16 outputs)
        _check_few_rows_cases(rng, ((1152, 64, 50, 5, "store"), (1024, 32, 68, 2, "swiglu")))
        qf.VARIANT = qf.FewVariant(1, 1)  # 16 features a block, the weights through the ring
        _check_few_rows_cases(rng, ((1152, 64, 19, 3, "store"), (1024, 32, 34, 11, "swiglu"),
                                    (1408, 128, 16, 1, "add")))
        qf.VARIANT = qf.FewVariant(1, 2, stages=2, x_ring=True)  # 16 rows a block
        _check_few_rows_cases(rng, ((1152, 64, 19, 13, "store"),))
    finally:
        qf.VARIANT = None
    assert not qf.supports("q8", 3, 1024, 64) and not qf.supports("q4", 17, 1024, 64)
    assert not qf.supports("q4", 3, 1088, 64)  # the cp.async ring: whole 4-chunk sets
    _check_few_rows_refusals(rng)
    assert qf.MIN_ROWS == 5 and qf.TAKE_MAX == 16  # routed where measured faster (H100)
    assert qf.takes("q4", 8, 5120, 64) and qf.takes("q4", 5, 17408, 64) and qf.takes("q4", 16, 5120, 64)
    assert not qf.takes("q4", 4, 5120, 64) and not qf.takes("q4", 17, 5120, 64)
    assert not qf.takes("q8", 8, 5120, 64) and not qf.takes("q4", 8, 1088, 64)


def _check_few_rows_refusals(rng: np.random.Generator) -> None:
    """An explicit path='mma_few' it cannot take is refused with a clear error: a K that is
    not whole 4-chunk sets, and x scales off their 16-byte alignment."""
    from cuda_kernels import launch

    codes, scales, biases, _ = affine_weight(rng, 1, 16, 1088, 4, 64)
    x = rng.standard_normal((3, 1088)).astype(np.float32)
    out = np.full((3, 16), np.nan, np.float32)
    for xq, xs in ((None, None), (np.zeros((3, 1152), np.int8), np.zeros((3, 73), np.float32)[:, 1:])):
        w = (codes, scales, biases) if xq is None else affine_weight(rng, 1, 16, 1152, 4, 64)[:3]
        try:
            launch.matmul("q4", x if xq is None else None, *w, 64, np.zeros(1, np.int32),
                          out if xq is None else np.zeros((3, 16), np.float32), path="mma_few",
                          xq=xq, xs=xs, x_ready=xq is not None)
        except ValueError as exc:
            assert "few-rows tensor-core path" in str(exc), exc
        else:
            raise AssertionError("path='mma_few' took a launch it cannot run")


def _check_few_rows_cases(rng: np.random.Generator, cases) -> None:
    from cuda_kernels import launch
    from cuda_kernels import qmma_few as qf

    for in_f, gs, out_f, rows, epilogue in cases:
        codes, scales, biases, deq = affine_weight(rng, 1, out_f, in_f, 4, gs)
        x = rng.standard_normal((rows, in_f)).astype(np.float32)
        width = out_f // 2 if epilogue == "swiglu" else out_f
        start = rng.standard_normal((rows, width)).astype(np.float32)
        assert qf.supports("q4", rows, in_f, gs)
        outs = {}
        for path in ("few", "mma_few"):
            outs[path] = start.copy() if epilogue == "add" else np.full((rows, width), np.nan, np.float32)
            launch.matmul("q4", x, codes, scales, biases, gs, np.zeros(1, np.int32), outs[path], path=path,
                          epilogue=epilogue)
        assert np.array_equal(outs["few"], outs["mma_few"]), (qf.plan(rows, gs // 32), in_f, gs, epilogue)
        if epilogue == "store":
            assert rel_err(outs["mma_few"], affine_x_ref(x, gs) @ deq[0].T) < 1e-5, in_f


def _check_tensor_core_routing() -> None:
    """Which launches qmma takes from qdot (only speed depends on it): by default 17-32 rows
    where K <= LONG_K and every prompt-sized launch; with WIDE_ROWS_MIN set, few-row launches
    with wide outputs too."""
    from cuda_kernels import qmma

    assert qmma.WIDE_ROWS_MIN is None
    assert not qmma.takes(16, 5120, 34816) and not qmma.takes(8, 4096, 24576)
    assert qmma.takes(17, 4096, 1024) and not qmma.takes(17, 17408, 5120)
    assert qmma.takes(33, 17408, 5120)
    qmma.WIDE_ROWS_MIN = 12
    try:
        assert qmma.takes(16, 5120, 34816) and qmma.takes(12, 4096, qmma.WIDE_OUT)
        assert not qmma.takes(11, 5120, 34816)  # fewer rows than the minimum
        assert not qmma.takes(16, 5120, qmma.WIDE_OUT - 1)  # narrow outputs
        assert not qmma.takes(16, qmma.LONG_K + 32, 34816)  # long K
    finally:
        qmma.WIDE_ROWS_MIN = None


def _check_full_steps(rng: np.random.Generator) -> None:
    """Rows long enough for the three kinds of step of every unroll (8 words a lane and
    feature at one row, 4 at two): whole steps whose next step is whole (loaded untested),
    a whole step whose next is partial, the partial one: each row alone, in pairs and in
    the many path."""
    x = rng.standard_normal((3, 4608)).astype(np.float32)  # 576 q4 words
    parts = affine_weight(rng, 1, 5, 4608, 4, 64)
    many = _sim_matmul("q4", x, parts[:3], 64, path="many")
    assert rel_err(many, affine_x_ref(x, 64) @ parts[3][0].T) < 1e-5
    for start, count in ((0, 1), (2, 1), (1, 2)):
        got = _sim_matmul("q4", x[start : start + count], parts[:3], 64)
        assert np.array_equal(got, many[start : start + count]), (start, count)


def _check_dense_matmul(rng: np.random.Generator, x: np.ndarray, out_f: int) -> None:
    from cuda_kernels import launch

    w = rng.standard_normal((1, out_f, x.shape[1])).astype(np.float32)
    dummy = np.zeros((1, 1, 1), np.float32)
    out = np.full((x.shape[0], out_f), np.nan, np.float32)
    launch.matmul("f32", x, w, dummy, dummy, 1 << 30, np.zeros(1, np.int32), out)
    assert rel_err(out, x @ w[0].T.astype(np.float64)) < 1e-5
    wb = bf16_bits_ref(w)
    out = np.full((x.shape[0], out_f), np.nan, np.float32)
    launch.matmul("bf16", x, wb.view(np.uint32), dummy, dummy, 1 << 30, np.zeros(1, np.int32), out)
    assert rel_err(out, x @ bf16_value_ref(wb[0]).T.astype(np.float64)) < 1e-5


def matmul_cases(rng: np.random.Generator, rows: int, out_f: int, scale: int = 1):
    """(name, kind, x, parts, group_size, float64 reference) for every weight kind, at sizes
    that end in a partial step (88*scale words a row, not a multiple of 32 lanes x unroll),
    plus a non-power-of-two group (the division kernel) and a row shorter than a warp."""
    x_rows = rng.standard_normal((rows, 704 * scale)).astype(np.float32)
    cases = []
    for kind, bits, in_f, gs in (("q4", 4, 704 * scale, 64), ("q8", 8, 352 * scale, 32),
                                 ("q4", 4, 576 * scale, 96), ("q8", 8, 64, 32), ("q4", 4, 176 * scale, 16)):
        codes, scales, biases, deq = affine_weight(rng, 1, out_f, in_f, bits, gs)  # gs 16: f32 x
        cases.append((f"{kind} gs{gs} in{in_f}", kind, x_rows[:, :in_f].copy(),
                      (codes, scales, biases), gs, affine_x_ref(x_rows[:, :in_f], gs) @ deq[0].T))
    dummy = np.zeros((1, 1, 1), np.float32)
    for kind, in_f in (("bf16", 176 * scale), ("f32", 88 * scale)):
        w = rng.standard_normal((1, out_f, in_f)).astype(np.float32)
        bits = bf16_bits_ref(w) if kind == "bf16" else None
        values = bf16_value_ref(bits) if kind == "bf16" else w
        words = bits.view(np.uint32) if kind == "bf16" else w
        cases.append((kind, kind, x_rows[:, :in_f].copy(), (words, dummy, dummy), 1 << 30,
                      x_rows[:, :in_f] @ values[0].T.astype(np.float64)))
    return cases


def _sim_matmul(kind: str, x: np.ndarray, parts: tuple, gs: int,
                path: str | None = None) -> np.ndarray:
    from cuda_kernels import launch

    out = np.full((x.shape[0], parts[0].shape[1]), np.nan, np.float32)
    launch.matmul(kind, x, *parts, gs, np.zeros(1, np.int32), out, path=path)
    return out


def _check_matmul_invariance(name, kind, x, parts, gs, ref) -> None:
    """Every row bit-identical whatever the rows sharing the launch, the path (rows per
    block, features per warp) and the alignment of x (vector or scalar loads)."""
    many = _sim_matmul(kind, x, parts, gs, path="many")
    assert rel_err(many, ref) < 1e-5, (name, rel_err(many, ref))
    subsets = ((0, 1, None), (6, 1, None), (2, 2, None), (1, 4, None), (3, 3, "few"))
    for start, count, path in subsets:
        part = _sim_matmul(kind, x[start : start + count], parts, gs, path)
        assert np.array_equal(part, many[start : start + count]), (name, start, count, path)
    shifted = np.empty(2 * x.shape[1] + 1, np.float32)[1:].reshape(2, x.shape[1])  # 4 bytes off 16
    shifted[...] = x[4:6]
    assert np.array_equal(_sim_matmul(kind, shifted, parts, gs), many[4:6]), (name, "unaligned x")


def check_grouped_matmul(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    rows, in_f, out_f, experts = 4, 256, 8, 3
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    codes, scales, biases, deq = affine_weight(rng, experts, out_f, in_f, 4, 32)
    ids = np.array([2, 0, 2, 1], np.int32)
    out = np.full((rows, out_f), np.nan, np.float32)
    launch.matmul("q4", x, codes, scales, biases, 32, ids, out, grouped=True)
    x_seen = affine_x_ref(x, 32)
    ref = np.stack([deq[ids[r]] @ x_seen[r] for r in range(rows)])
    assert rel_err(out, ref) < 1e-5
    single = np.full((1, out_f), np.nan, np.float32)
    launch.matmul("q4", x[1:2], codes[:1], scales[:1], biases[:1], 32, ids, single, path="few")
    assert np.array_equal(single[0], out[1]), "grouped row differs from the plain few-rows row"
    _check_grouped_x_repeat(rng)
    _check_sorted_expert_matmul(rng)


def _check_grouped_x_repeat(rng: np.random.Generator) -> None:
    """MoE slots reading their token's row of x (x_repeat = top_k) == the grouped launch on
    top_k copies of each row, plain and with the swiglu epilogue; a wrong row count is refused."""
    from cuda_kernels import launch

    tokens, top_k, in_f, out_f, experts = 3, 2, 128, 8, 4
    x = rng.standard_normal((tokens, in_f)).astype(np.float32)
    codes, scales, biases, _ = affine_weight(rng, experts, out_f, in_f, 4, 32)
    ids = rng.integers(0, experts, tokens * top_k).astype(np.int32)
    for epilogue, width in (("store", out_f), ("swiglu", out_f // 2)):
        copies = np.full((tokens * top_k, width), np.nan, np.float32)
        launch.matmul("q4", np.repeat(x, top_k, axis=0), codes, scales, biases, 32, ids, copies,
                      grouped=True, path="few", epilogue=epilogue)
        once = np.full_like(copies, np.nan)
        launch.matmul("q4", x, codes, scales, biases, 32, ids, once, grouped=True, path="few",
                      epilogue=epilogue, x_repeat=top_k)
        assert np.array_equal(once, copies), ("x_repeat", epilogue)
    try:
        launch.matmul("q4", x, codes, scales, biases, 32, ids, np.empty((5, out_f), np.float32),
                      grouped=True, path="few", x_repeat=top_k)
    except ValueError:
        pass
    else:
        raise AssertionError("x_repeat with a wrong row count was not refused")


def _check_sorted_expert_matmul(rng: np.random.Generator) -> None:
    """MoE rows sorted by expert on the tensor cores (launch.sorted_expert_matmul, the blocks
    of expert_tiles) give every row the bits of the grouped few-rows launch: runs longer
    than a block, a partial feature block, an expert with no rows, chunks some warps lack."""
    from cuda_kernels import launch
    from cuda_kernels.expert_tiles import expert_tiles

    for kind, bits, in_f, gs, out_f, ids in (
        ("q4", 4, 352, 32, 19, [0] * 20 + [3] * 5 + [1] * 12),
        ("q8", 8, 192, 64, 9, [2, 0, 2, 2, 1, 0, 2, 2, 2, 2]),
    ):
        experts = 4
        codes, scales, biases, _ = affine_weight(rng, experts, out_f, in_f, bits, gs)
        expert_ids = rng.permutation(np.asarray(ids, np.int32))
        x = rng.standard_normal((expert_ids.shape[0], in_f)).astype(np.float32)
        want = np.full((x.shape[0], out_f), np.nan, np.float32)
        launch.matmul(kind, x, codes, scales, biases, gs, expert_ids, want, grouped=True)
        xq, xs = launch._quantize(kind, x, None, None, None)
        order, tiles = expert_tiles(np, expert_ids, experts, 16)
        assert tiles.shape == (x.shape[0] // 16 + experts, 3)
        runs = tiles[tiles[:, 1] < tiles[:, 2]]
        assert (runs[:, 2] - runs[:, 1]).max() <= 16 and (expert_ids[order][runs[:, 1]] == runs[:, 0]).all()
        got_sorted = np.full_like(want, np.nan)
        launch.sorted_expert_matmul(kind, xq[order], xs[order], codes, scales, biases, gs, tiles,
                                    got_sorted)
        got = np.empty_like(want)
        got[order] = got_sorted
        assert np.array_equal(got, want), (kind, np.argwhere(got != want)[:4].tolist())


def check_embed(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    codes, scales, biases, deq = affine_weight(rng, 1, 12, 64, 4, 32)
    ids = np.array([3, 11, 0], np.int64)
    out = np.full((3, 64), np.nan, np.float32)
    launch.embed_affine(codes[0], scales[0], biases[0], 4, 32, ids, out)
    assert rel_err(out, deq[0][ids]) < 1e-6


@contextmanager
def _quick_barriers() -> Iterator[None]:
    """The simulator runs a block as Python threads that poll at every syncthreads; a short
    GIL switch interval makes those barriers several times faster (same results)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _attend(q, kv_layer, scales, block_table, row_seq, row_pos, page_size, sm_scale, **kw):
    from cuda_kernels import launch

    out = np.full(q.shape, np.nan, np.float32)
    launch.attention(q, kv_layer, np.float32(scales[0]), np.float32(scales[1]), block_table, row_seq, row_pos,
                     page_size, np.float32(sm_scale), out, **kw)
    return out


def check_attention(rng: np.random.Generator) -> None:
    """Several key chunks (cuda_kernels/attention.py under the simulator: chunks of 8 keys up to
    32 keys, of 16 up to 64): row_pos 0, at the last key of a chunk, at the first key of the
    next, past the switch to longer chunks; every
    KV dtype against float64; a row alone == the same row in a batch == the same row in a batch
    with a wider block table, a one-block-per-row grid and row slices, bit for bit."""
    from cuda_kernels import attention as attn

    chunk = attn.KEY_TILE
    assert attn.chunk_keys(chunk) == chunk and attn.chunk_keys(33) == 2 * chunk
    page_size, nkv, hd, nh = 4, 2, 16, 4
    block_table, kv_f32 = paged_setup(rng, seqs=2, max_pages=10, page_size=page_size, nkv=nkv, hd=hd)
    row_seq = np.array([0, 1, 1, 0, 1], np.int32)
    row_pos = np.array([0, chunk - 1, chunk, 32, 39], np.int64)
    q = rng.standard_normal((5, nh, hd)).astype(np.float32)
    wide = np.concatenate([block_table, rng.permutation(block_table.size)[:2 * 7].reshape(2, 7).astype(np.int32)
                           % block_table.max()], axis=1)
    scales = (0.02, 0.03)
    with _quick_barriers():
        for kind in ("f32", "bf16", "fp8"):
            kv_layer = to_kv_dtype(kv_f32 * 4.0, kind, scales)
            args = (kv_layer, scales, block_table, row_seq, row_pos, page_size, 0.25)
            out = _attend(q, *args)
            ref = attention_ref(q, kv_layer, scales, block_table, row_seq, row_pos, page_size, 0.25)
            assert rel_err(out, ref) < 1e-5, (kind, rel_err(out, ref))
            for r in (0, 2, 3) if kind == "bf16" else (3,):
                solo = _attend(q[r : r + 1], kv_layer, scales, block_table, row_seq[r : r + 1], row_pos[r : r + 1],
                               page_size, 0.25)
                assert np.array_equal(solo[0], out[r]), f"{kind}: attention row {r} depends on the batch"
            if kind != "bf16":
                continue
            # Grid and table width never change a row: a wider table (more chunk blocks), one
            # chunk block per row (each walks all its chunks), row slices of a small scratch.
            rows = np.array([3, 1, 4, 0, 2])
            wider = _attend(q[rows], kv_layer, scales, wide, row_seq[rows], row_pos[rows], page_size, 0.25)
            assert np.array_equal(wider, out[rows]), "attention row depends on the table width"
            saved = attn.TARGET_BLOCKS, attn.SCRATCH_BUDGET_BYTES
            try:
                attn.TARGET_BLOCKS = 1
                attn.SCRATCH_BUDGET_BYTES = 1
                sliced = _attend(q, *args)
            finally:
                attn.TARGET_BLOCKS, attn.SCRATCH_BUDGET_BYTES = saved
            assert np.array_equal(sliced, out), "attention row depends on the grid or the row slices"
            _check_attention_cpu_twin(q, kv_layer, block_table, row_seq, row_pos, page_size, out)
    _check_attention_prompt(rng)


def _check_attention_cpu_twin(q, kv_layer, block_table, row_seq, row_pos, page_size, out) -> None:
    try:
        from tf_async.backend.cpu import kernels as cpu
    except ImportError:
        return
    host = np.full_like(q, np.nan)
    cpu.paged_attention(q, kv_layer, 1.0, 1.0, block_table, row_seq, row_pos, page_size, 0.25, host)
    assert rel_err(out, host) < 1e-5, rel_err(out, host)


def _check_attention_prompt(rng: np.random.Generator) -> None:
    """A prompt-style launch: consecutive causal rows of one stream crossing chunk boundaries,
    against float64, and one row of it alone, bit for bit."""
    chunk = 16  # keys per chunk under the simulator for rows of 33..64 keys
    page_size, nkv, hd, nh = 4, 1, 32, 2
    block_table, kv_f32 = paged_setup(rng, seqs=1, max_pages=9, page_size=page_size, nkv=nkv, hd=hd)
    row_pos = np.arange(chunk - 3, 2 * chunk + 2, dtype=np.int64)
    row_seq = np.zeros(row_pos.shape[0], np.int32)
    q = rng.standard_normal((row_pos.shape[0], nh, hd)).astype(np.float32)
    kv_layer = to_kv_dtype(kv_f32, "fp8", (0.01, 0.02))
    with _quick_barriers():
        out = _attend(q, kv_layer, (0.01, 0.02), block_table, row_seq, row_pos, page_size, 0.2)
        ref = attention_ref(q, kv_layer, (0.01, 0.02), block_table, row_seq, row_pos, page_size, 0.2)
        assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
        r = 4  # row_pos == chunk + 1
        solo = _attend(q[r : r + 1], kv_layer, (0.01, 0.02), block_table, row_seq[:1], row_pos[r : r + 1],
                       page_size, 0.2)
        assert np.array_equal(solo[0], out[r]), "prompt row depends on the other rows"
        _check_attention_int8_out(q, kv_layer, block_table, row_seq, row_pos, page_size, out)


def check_attention_tiled(rng: np.random.Generator) -> None:
    """The tiled prompt kernel (cuda_kernels/attention_tiled.py) gives attention.py's bits:
    causal rows of one stream crossing chunk boundaries and the switch to longer chunks, and a
    launch mixing two streams' rows with decode rows (blocks serving two sequences), every KV
    dtype, GQA."""
    page_size, nkv, hd, nh = 4, 2, 16, 4  # chunks of 8 keys up to 32 keys, then of 16
    block_table, kv_f32 = paged_setup(rng, seqs=3, max_pages=10, page_size=page_size, nkv=nkv, hd=hd)
    prompt = np.array([6, 7, 8, 30, 31, 32, 33, 36], np.int64)  # one stream's rows
    mixed_pos = np.array([5, 9, 28, 33, 0, 17], np.int64)
    mixed_seq = np.array([0, 0, 1, 1, 2, 1], np.int32)
    with _quick_barriers():
        for kind, (row_seq, row_pos) in (("bf16", (np.zeros(prompt.shape[0], np.int32), prompt)),
                                          ("fp8", (mixed_seq, mixed_pos)), ("f32", (mixed_seq, mixed_pos))):
            kv_layer = to_kv_dtype(kv_f32, kind, (0.01, 0.02))
            q = rng.standard_normal((row_pos.shape[0], nh, hd)).astype(np.float32)
            args = (kv_layer, (0.01, 0.02), block_table, row_seq, row_pos, page_size, 0.2)
            plain = _attend(q, *args, tiled=False)
            tiled = _attend(q, *args, tiled=True)
            assert np.array_equal(plain, tiled), (kind, np.argwhere(plain != tiled)[:4].tolist())


def _check_attention_int8_out(q, kv_layer, block_table, row_seq, row_pos, page_size, out) -> None:
    """The launch that also writes its rows as int8 x: the same float32 rows and the bits of
    quantize_rows of them."""
    from cuda_kernels import launch

    rows, width = q.shape[0], q.shape[1] * q.shape[2]
    xq, xs = np.full((rows, width), 77, np.int8), np.full((rows, 2 * width // 32), np.nan, np.float32)
    fused = _attend(q, kv_layer, (0.01, 0.02), block_table, row_seq, row_pos, page_size, 0.2,
                    int8_out=(True, xq, xs))
    assert np.array_equal(fused, out), "attention with int8 output changed its float32 rows"
    ref_q, ref_s = launch._quantize("q4", out.reshape(rows, width), None, None, None)
    assert np.array_equal(xq, ref_q) and np.array_equal(xs.view(np.uint32), ref_s.view(np.uint32)), \
        "attention's int8 output differs from quantize_rows of its rows"


def check_attention_wide_heads(rng: np.random.Generator) -> None:
    """head_dim 160 (the 256 variant) with a GQA group of 16 (several blocks per KV head), and
    head_dim 128 (fp8) / 256 (bf16) over several chunks."""
    page_size, nkv, hd, nh = 8, 1, 160, 16
    block_table, kv_f32 = paged_setup(rng, seqs=1, max_pages=3, page_size=page_size, nkv=nkv, hd=hd)
    row_seq = np.array([0], np.int32)
    row_pos = np.array([19], np.int64)
    q = rng.standard_normal((1, nh, hd)).astype(np.float32)
    with _quick_barriers():
        out = _attend(q, kv_f32, (1.0, 1.0), block_table, row_seq, row_pos, page_size, 0.1)
        ref = attention_ref(q, kv_f32, (1.0, 1.0), block_table, row_seq, row_pos, page_size, 0.1)
        assert rel_err(out, ref) < 1e-5
        for hd, kind in ((128, "fp8"), (256, "bf16")):
            block_table, kv_f32 = paged_setup(rng, seqs=1, max_pages=5, page_size=page_size, nkv=1, hd=hd)
            row_seq = np.array([0, 0], np.int32)
            row_pos = np.array([16, 37], np.int64)
            q = rng.standard_normal((2, 2, hd)).astype(np.float32)
            scales = (0.03, 0.05)
            kv_layer = to_kv_dtype(kv_f32, kind, scales)
            out = _attend(q, kv_layer, scales, block_table, row_seq, row_pos, page_size, hd**-0.5)
            ref = attention_ref(q, kv_layer, scales, block_table, row_seq, row_pos, page_size, hd**-0.5)
            assert rel_err(out, ref) < 1e-5, (hd, kind, rel_err(out, ref))
            solo = _attend(q[1:], kv_layer, scales, block_table, row_seq[1:], row_pos[1:], page_size, hd**-0.5)
            assert np.array_equal(solo[0], out[1]), (hd, kind, "attention row depends on the batch")


def check_kv_write(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    rows, nkv, hd, slots_total = 3, 2, 8, 20
    k = (rng.standard_normal((rows, nkv, hd)) * 50).astype(np.float32)
    v = (rng.standard_normal((rows, nkv, hd)) * 50).astype(np.float32)
    k[0, 0, :4] = [np.nan, 1e6, -0.0, 1e-9]
    slots = np.array([7, 0, 19], np.int64)
    scales = (0.5, 0.25)
    for kind, dtype in (("f32", np.float32), ("bf16", np.uint16), ("fp8", np.uint8)):
        kv_layer = np.zeros((2, slots_total, nkv, hd), dtype)
        launch.kv_write(k, v, kv_layer, slots, np.float32(scales[0]), np.float32(scales[1]))
        want = np.zeros_like(kv_layer)
        want[:, slots] = to_kv_dtype(np.stack([k, v]), kind, scales)
        same = (want == kv_layer) | (kv_layer != kv_layer)  # NaN stays NaN in f32
        assert same.all(), kind


def check_e4m3_exhaustive(rng: np.random.Generator) -> None:
    """Every code's midpoints and neighbours round like the reference."""
    from cuda_kernels import launch

    table = e4m3_table()
    finite = np.sort(table[np.isfinite(table) & (table >= 0)])
    mids = (finite[1:] + finite[:-1]) / 2
    probe = np.concatenate([finite, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [500.0, 1e30]])
    probe = np.concatenate([probe, -probe]).astype(np.float32)
    k = probe.reshape(1, 1, -1)
    kv_layer = np.zeros((2, 1, 1, probe.size), np.uint8)
    launch.kv_write(k, k, kv_layer, np.zeros(1, np.int64), np.float32(1), np.float32(1))
    assert np.array_equal(kv_layer[0, 0, 0], e4m3_ref(probe))


def check_zero_pages(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    kv = rng.integers(1, 200, size=(2, 2, 6 * 4, 2, 4)).astype(np.uint8)
    before = kv.copy()
    launch.zero_pages(kv.reshape(4, 24, 8), np.array([1, 4], np.int32), 4)
    want = before.copy()
    want[:, :, 4:8] = 0
    want[:, :, 16:20] = 0
    assert np.array_equal(kv, want)


def _check_held_rms_norm(rng: np.random.Generator) -> None:
    """The rms_norm kernels that hold a row in registers give the bits of the general one,
    at widths that fill their last slot partly and wholly (and past MAX_HELD: the general one)."""
    from cuda_kernels import norm

    assert norm.rms_norm_kernel(norm.MAX_HELD * norm.NORM_THREADS + 1) is norm.rms_norm
    for dim in (5, 128, 200, 1000):
        x = rng.standard_normal((2, dim)).astype(np.float32)
        w = rng.standard_normal(dim).astype(np.float32)
        held, general = np.full_like(x, np.nan), np.full_like(x, np.nan)
        kernel = norm.rms_norm_kernel(dim)
        assert kernel is not norm.rms_norm
        kernel[2, norm.NORM_THREADS](x, w, np.float32(1e-6), held)
        norm.rms_norm[2, norm.NORM_THREADS](x, w, np.float32(1e-6), general)
        assert np.array_equal(held, general), dim


def check_norm_rope_silu(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    x = rng.standard_normal((3, 200)).astype(np.float32)
    w = rng.standard_normal(200).astype(np.float32)
    out = np.full_like(x, np.nan)
    launch.rms_norm(x, w, np.float32(1e-6), out)
    assert rel_err(out, rms_norm_ref(x, w, 1e-6)) < 1e-6
    _check_held_rms_norm(rng)
    q = rng.standard_normal((3, 2, 12)).astype(np.float32)
    pos = np.array([0, 5, 70000], np.int64)
    inv_freq = (10000.0 ** (-np.arange(0, 8, 2) / 8)).astype(np.float32)
    want = rope_ref(q, pos, inv_freq, 1.1)
    launch.rope(q, pos, inv_freq, 1.1)
    assert rel_err(q, want) < 1e-6
    gate, up = rng.standard_normal((2, 2, 33)).astype(np.float32)
    out = np.full_like(gate, np.nan)
    launch.silu_mul(gate, up, out)
    assert rel_err(out, silu_mul_ref(gate, up)) < 1e-6


def check_fused_layer_ops(rng: np.random.Generator) -> None:
    """The fused decode ops give the bits of the ops they replace: matmul epilogues 'add'
    (residual) and 'swiglu' (gate|up), and attn_inputs == rms_norm + rope + kv_write."""
    from cuda_kernels import launch

    rows, in_f, inter = 3, 256, 10
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    placeholder = np.zeros(1, np.int32)
    codes, scales, biases, _ = affine_weight(rng, 1, 2 * inter, in_f, 4, 64)
    for path in ("few", "many"):
        plain = np.full((rows, 2 * inter), np.nan, np.float32)
        launch.matmul("q4", x, codes, scales, biases, 64, placeholder, plain, path=path)
        resid = rng.standard_normal((rows, 2 * inter)).astype(np.float32)
        added = resid.copy()
        launch.matmul("q4", x, codes, scales, biases, 64, placeholder, added, path=path, epilogue="add")
        assert np.array_equal(added, resid + plain), path
        fused = np.full((rows, inter), np.nan, np.float32)
        launch.matmul("q4", x, codes, scales, biases, 64, placeholder, fused, path=path, epilogue="swiglu")
        want = np.full((rows, inter), np.nan, np.float32)
        launch.silu_mul(np.ascontiguousarray(plain[:, :inter]), np.ascontiguousarray(plain[:, inter:]), want)
        assert np.array_equal(fused, want), path
    _check_norm_quantize(rng)
    _check_attn_inputs(rng)


def _check_norm_quantize(rng: np.random.Generator) -> None:
    """rms_norm_quantize gives the bits of rms_norm, then quantize_rows (both byte orders)."""
    from cuda_kernels import launch

    x = rng.standard_normal((3, 320)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(320)).astype(np.float32)
    normed = np.full_like(x, np.nan)
    launch.rms_norm(x, w, np.float32(1e-6), normed)
    for kind in ("q4", "q8"):
        want_q, want_s = launch._quantize(kind, normed, None, None, None)
        xq, xs = np.full(x.shape, 99, np.int8), np.full(want_s.shape, np.nan, np.float32)
        launch.rms_norm_quantize(x, w, np.float32(1e-6), kind == "q4", xq, xs)
        assert np.array_equal(xq, want_q) and np.array_equal(xs, want_s), kind


def _check_attn_inputs(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    rows, nh, nkv, hd, num_slots = 3, 4, 2, 16, 12
    qkv = rng.standard_normal((rows, (nh + 2 * nkv) * hd)).astype(np.float32)
    q_norm, k_norm = (1 + 0.1 * rng.standard_normal((2, hd))).astype(np.float32)
    pos, slots = np.array([0, 9, 70000], np.int64), np.array([5, 0, 11], np.int64)
    inv_freq = (10000.0 ** (-np.arange(0, 12, 2) / 12)).astype(np.float32)  # partial rotary
    scales, eps, mscale = (np.float32(0.5), np.float32(0.25)), np.float32(1e-6), 1.1
    for kind, dtype, use_norm in (("f32", np.float32, True), ("bf16", np.uint16, False), ("fp8", np.uint8, True)):
        if True:
            q_sep = qkv[:, : nh * hd].reshape(rows, nh, hd).copy()
            k_sep = qkv[:, nh * hd : (nh + nkv) * hd].reshape(rows, nkv, hd).copy()
            v_sep = qkv[:, (nh + nkv) * hd :].reshape(rows, nkv, hd).copy()
            if use_norm:
                for t, w in ((q_sep, q_norm), (k_sep, k_norm)):
                    flat = t.reshape(-1, hd)
                    normed = np.full_like(flat, np.nan)
                    launch.rms_norm(flat, w, eps, normed)
                    t[...] = normed.reshape(t.shape)
            launch.rope(q_sep, pos, inv_freq, mscale)
            launch.rope(k_sep, pos, inv_freq, mscale)
            want_kv = np.zeros((2, num_slots, nkv, hd), dtype)
            launch.kv_write(k_sep, v_sep, want_kv, slots, *scales)
            kv_layer = np.zeros_like(want_kv)
            q_out = np.full((rows, nh, hd), np.nan, np.float32)
            launch.attn_inputs(qkv, q_norm, k_norm, use_norm, eps, pos, inv_freq, mscale, kv_layer, slots,
                               *scales, q_out)
            assert np.array_equal(q_out, q_sep), (kind, use_norm)
            assert np.array_equal(kv_layer.view(np.uint8), want_kv.view(np.uint8)), (kind, use_norm)


def check_moe(rng: np.random.Generator) -> None:
    from cuda_kernels import launch

    logits = rng.standard_normal((5, 8)).astype(np.float32)
    logits[1, [2, 5]] = 3.0  # an exact tie: the lower id first
    for norm in (False, True):
        ids = np.full((5, 3), -1, np.int32)
        weights = np.full((5, 3), np.nan, np.float32)
        launch.moe_route(logits, 3, norm, ids, weights)
        want_ids, want_w = moe_route_ref(logits, 3, norm)
        assert np.array_equal(ids, want_ids) and rel_err(weights, want_w) < 1e-6
    # a warp a row: more experts than lanes, ties across lanes, rows past one block's warps
    wide = rng.standard_normal((7, 45)).astype(np.float32)
    wide[2, [3, 35, 36]] = 4.0
    wide[6, :] = 0.5  # all tied: ids ascending
    wide_ids, wide_w = np.full((7, 4), -1, np.int32), np.full((7, 4), np.nan, np.float32)
    launch.moe_route(wide, 4, True, wide_ids, wide_w)
    want_ids, want_w = moe_route_ref(wide, 4, True)
    assert np.array_equal(wide_ids, want_ids) and rel_err(wide_w, want_w) < 1e-6
    _check_moe_route_256(rng)
    _check_moe_route_wide(rng)
    y = rng.standard_normal((15, 150)).astype(np.float32)  # two column blocks
    out = np.full((5, 150), np.nan, np.float32)
    launch.moe_combine(y, weights, out)
    ref = np.einsum("rj,rjh->rh", weights.astype(np.float64), y.reshape(5, 3, 150).astype(np.float64))
    assert rel_err(out, ref) < 1e-6


def _check_moe_route_256(rng: np.random.Generator) -> None:
    """A decode row's routing at real width: 256 experts, top 8 (each lane holds 8 experts and
    one pick), norm on and off; rows past the first block's warps; a row alone == in a batch."""
    from cuda_kernels import launch, moe

    logits = (rng.standard_normal((5, 256)) * 2).astype(np.float32)
    logits[0, [31, 32, 200]] = 20.0  # a tie of three picks across lanes
    logits[3, :] = -1.0  # all tied: ids 0..7, weights 1/256 (1/8 normalised)
    for norm in (False, True):
        ids, weights = np.full((5, 8), -1, np.int32), np.full((5, 8), np.nan, np.float32)
        launch.moe_route(logits, 8, norm, ids, weights)
        want_ids, want_w = moe_route_ref(logits, 8, norm)
        assert np.array_equal(ids, want_ids) and rel_err(weights, want_w) < 1e-6, norm
        assert list(ids[0, :3]) == [31, 32, 200] and list(ids[3]) == list(range(8)), norm
        if norm:
            solo_ids, solo_w = np.full((1, 8), -1, np.int32), np.full((1, 8), np.nan, np.float32)
            launch.moe_route(logits[4:5], 8, norm, solo_ids, solo_w)
            assert np.array_equal(solo_ids, ids[4:5]) and np.array_equal(solo_w, weights[4:5])
    try:
        launch.moe_route(logits, moe.ROUTE_MAX_TOP_K + 1, True, np.zeros((5, 33), np.int32),
                         np.zeros((5, 33), np.float32))
    except ValueError as exc:
        assert "top_k" in str(exc)
    else:
        raise AssertionError("moe_route took more picks than a warp has lanes")


def _check_moe_route_wide(rng: np.random.Generator) -> None:
    """More experts than a warp keeps in registers (600 > ROUTE_SHARED: ids 512.. are read from
    logits each time a lane looks for its next), top 8: one lane giving its four first picks
    from registers and past them in turn, a tie between a register expert and one past them
    (the lower id first), a row whose last experts are -inf, and top 32 (every lane a slot)."""
    from cuda_kernels import launch, moe

    experts = moe.ROUTE_SHARED + 88
    logits = (rng.standard_normal((3, experts)) * 2).astype(np.float32)
    logits[0, [3, 35, 67, 515]] = [30.0, 29.0, 28.0, 28.5]  # lane 3 gives picks 1-4
    logits[1, [517, 5]] = 25.0  # same lane, same weight: 5 before 517
    logits[2, 300:] = -np.inf
    for top_k in (8, 32):
        for norm in (False, True):
            ids = np.full((3, top_k), -1, np.int32)
            weights = np.full((3, top_k), np.nan, np.float32)
            launch.moe_route(logits, top_k, norm, ids, weights)
            want_ids, want_w = moe_route_ref(logits, top_k, norm)
            assert np.array_equal(ids, want_ids) and rel_err(weights, want_w) < 1e-6, (top_k, norm)
    assert list(ids[0, :4]) == [3, 35, 515, 67] and list(ids[1, :2]) == [5, 517]


def _check_split_argmax(rng: np.random.Generator) -> None:
    """argmax over several parts (argmax_parts, then argmax_reduce): argmax_ref's tokens (the
    first maximum; NaN never wins; a row of -inf or NaN: 0), ties across parts, and any number
    of parts (empty ones past the row's end too) giving the same tokens."""
    from cuda_kernels import launch

    vocab = 20000
    rows, parts = launch.argmax_scratch_shape(6, vocab)
    span = -(-vocab // parts)
    assert parts == 5 and rows == 6
    logits = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    logits[0, vocab - 3] = 50.0  # the maximum in the last part
    logits[1, [span + 7, 3 * span + 2]] = 50.0  # a tie across two parts: the lower id
    logits[1, 4 * span + 1] = 50.0
    logits[2, :] = -np.inf  # token 0
    logits[3, ::2] = np.nan  # NaNs never win: the real maximum does
    logits[3, 2 * span + 1] = 40.0
    logits[4, :] = np.nan  # token 0
    logits[5, :] = np.nan  # NaN and -inf only: the first -inf
    logits[5, [2 * span + 9, 4 * span]] = -np.inf
    want = argmax_ref(logits)
    assert list(want[:3]) == [vocab - 3, span + 7, 0] and list(want[3:]) == [2 * span + 1, 0, 2 * span + 9]
    out = np.full(6, -1, np.int64)
    launch.argmax(logits, out)
    assert np.array_equal(out, want), (out, want)
    # The scratch passed in, and other splits (2 parts; 7 parts of a 10-id row: two empty)
    small = np.array([[np.nan, -np.inf, 3.0, 7.0, 7.0, np.nan, 1.0, 7.0, -np.inf, 2.0],
                      [np.nan] * 8 + [-np.inf, np.nan]], np.float32)
    for x, n, want_x in ((logits[:2], 2, want[:2]), (small, 7, [3, 8])):
        values, ids = np.full((x.shape[0], n), np.nan, np.float32), np.full((x.shape[0], n), -1, np.int64)
        got = np.full(x.shape[0], -1, np.int64)
        launch.argmax(x, got, part_values=values, part_ids=ids)
        assert list(got) == list(want_x), (n, got, want_x)
    assert list(ids[0, 5:]) == [10, 10] and list(values[0, 5:]) == [-np.inf, -np.inf]  # empty parts
    try:
        launch.argmax(logits, out, part_values=np.zeros((6, 5), np.float32))
    except ValueError as exc:
        assert "part_ids" in str(exc)
    else:
        raise AssertionError("argmax took half its scratch")


def check_sampling(rng: np.random.Generator) -> None:
    from cuda_kernels import launch, sampling

    rows, vocab = 3, 300
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    logits[1, 17] = logits[1, 250] = 40.0  # tie: lowest id wins
    out = np.full(rows, -1, np.int64)
    launch.argmax(logits, out)
    assert np.array_equal(out, [np.argmax(logits[0]), 17, np.argmax(logits[2])])
    _check_split_argmax(rng)
    temps = np.array([0.0, 1.0, 0.7], np.float32)
    top_ks = np.array([0, 1, 5], np.int32)
    top_ps = np.array([1.0, 1.0, 0.9], np.float32)
    seeds = np.array([1, 2, 3], np.uint64)
    positions = np.array([4, 5, 6], np.int64)
    launch.sample(logits, temps, top_ks, top_ps, seeds, positions, out)
    assert out[0] == np.argmax(logits[0]) and out[1] in (17, 250)  # top-k keeps exact ties
    logits[1, 250] = 0.0
    one = np.full(1, -1, np.int64)
    launch.sample(logits[1:2], temps[1:2], top_ks[1:2], top_ps[1:2], seeds[1:2], positions[1:2], one)
    assert one[0] == 17
    assert out[2] == _sample_ref(logits[2], 0.7, 5, 0.9, sampling.uniform_host(3, 6))


def _sample_ref(logits: np.ndarray, temp: float, top_k: int, top_p: float, u: float) -> int:
    z = logits.astype(np.float64) / temp
    order = np.argsort(-z, kind="stable")
    order = order[:top_k] if top_k > 0 else order
    p = np.exp(z[order] - z[order[0]])
    keep = np.searchsorted(np.cumsum(p) / p.sum(), top_p) + 1
    kept = order[:keep]
    # the kernel draws in thread-major order (thread t owns ids t, t+256, ...)
    kept = kept[np.lexsort((kept, kept % 256))]
    pk = np.exp(z[kept] - z.max())
    return int(kept[np.searchsorted(np.cumsum(pk), u * pk.sum(), side="right")])


def check_cpu_twins(rng: np.random.Generator) -> None:
    """Same inputs through the CPU twins (tf_async/backend/cpu/kernels.py): conversions
    bit-identical, arithmetic within float32 rounding."""
    from cuda_kernels import launch
    from tf_async.backend.cpu import kernels as cpu

    k = (rng.standard_normal((2, 2, 8)) * 30).astype(np.float32)
    v = (rng.standard_normal((2, 2, 8)) * 30).astype(np.float32)
    slots = np.array([3, 1], np.int64)
    for dtype in (np.uint16, np.uint8):
        dev = np.zeros((2, 5, 2, 8), dtype)
        host = np.zeros_like(dev)
        launch.kv_write(k, v, dev, slots, np.float32(0.5), np.float32(0.25))
        cpu.kv_write(k, v, host, slots, 0.5, 0.25)
        assert np.array_equal(dev, host), dtype
    _check_cpu_int8_matmul(rng)
    _check_cpu_attention_and_route(rng)


def _simulated() -> bool:
    from cuda_kernels.env import SIMULATOR

    return SIMULATOR


def _check_cpu_int8_matmul(rng: np.random.Generator) -> None:
    """The int8-activation matmul and its CPU twin: the same int8 x, scales and output bits
    (q4 and q8, more chunks than lanes, a zero chunk, exact rounding ties)."""
    from cuda_kernels import launch, qdot
    from tf_async.backend.cpu import kernels as cpu

    x = rng.standard_normal((2, 1152)).astype(np.float32)
    x[0, 32:64] = 0.0
    x[1, :4] = [127.0, 0.5, -1.5, 2.5]  # amax 127: x * inv hits ties at .5
    for kind, bits, gs in (("q4", 4, 64), ("q8", 8, 32)):
        codes, scales, biases, _ = affine_weight(rng, 1, 6, x.shape[1], bits, gs)
        xq_dev, xq_host = np.full(x.shape, 99, np.int8), np.full(x.shape, 99, np.int8)
        xs_dev, xs_host = (np.full((2, 2 * x.shape[1] // 32), np.nan, np.float32) for _ in range(2))
        dev, host = np.full((2, 6), np.nan, np.float32), np.full((2, 6), np.nan, np.float32)
        launch.matmul(kind, x, codes, scales, biases, gs, np.zeros(1, np.int32), dev, xq=xq_dev, xs=xs_dev)
        cpu.quantize_rows_int8(x, bits == 4, xq_host, xs_host)
        cpu.matmul_affine_int8x(xq_host, xs_host, codes[0], scales[0], biases[0], bits, gs, host)
        assert np.array_equal(xq_dev, xq_host) and np.array_equal(xs_dev, xs_host), kind
        # The simulator's cuda.fma rounds twice: bits equal only on a GPU (test_gpu_kernels.py)
        assert np.array_equal(dev, host) if not _simulated() else rel_err(dev, host) < 1e-6, kind
        assert list(xq_host[1, [qdot.x_position(kind == "q4", j) for j in range(4)]]) == [127, 0, -2, 2], kind


def _check_cpu_attention_and_route(rng: np.random.Generator) -> None:
    from cuda_kernels import launch
    from tf_async.backend.cpu import kernels as cpu

    block_table, kv = paged_setup(rng, seqs=1, max_pages=3, page_size=4, nkv=1, hd=8)
    kv = bf16_bits_ref(kv)
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    args = (np.float32(1), np.float32(1), block_table, np.zeros(2, np.int32), np.array([3, 9], np.int64), 4)
    dev, host = np.full_like(q, np.nan), np.full_like(q, np.nan)
    launch.attention(q, kv, *args, np.float32(0.3), dev)
    cpu.paged_attention(q, kv, 1.0, 1.0, *args[2:], 0.3, host)
    assert rel_err(dev, host) < 1e-5
    logits = rng.standard_normal((3, 6)).astype(np.float32)
    ids_dev, ids_host = np.zeros((3, 2), np.int32), np.zeros((3, 2), np.int32)
    w_dev, w_host = np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
    launch.moe_route(logits, 2, True, ids_dev, w_dev)
    cpu.moe_route(logits, 2, True, ids_host, w_host)
    assert np.array_equal(ids_dev, ids_host) and rel_err(w_dev, w_host) < 1e-6


def dflash_conv_ref(x, taps, base, group_size):
    """float64 grouped dynamic causal convolution (docs/DFLASH.md)."""
    rows, hidden = x.shape
    out = np.zeros((rows, hidden))
    for t in range(rows):
        for o in range(base.shape[0]):
            if t >= o:
                tap = np.repeat(taps[t, o].astype(np.float64), group_size)
                out[t] += (base[o].astype(np.float64) + tap) * x[t - o]
    return out


def dflash_attention_ref(q, keys, values, visible, sm_scale):
    rows, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = np.zeros(q.shape)
    for b in range(rows):
        seen = np.flatnonzero(visible[b])
        for h in range(num_heads):
            s = keys[seen, h // group].astype(np.float64) @ q[b, h].astype(np.float64) * sm_scale
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ values[seen, h // group].astype(np.float64)
    return out


def dflash_chain_ref(cand_ids, cand_values, projected, predecessor, successor, anchor):
    path, prev = [], anchor
    for t in range(cand_ids.shape[0]):
        pair = successor[cand_ids[t]].astype(np.float64) @ (
            predecessor[prev].astype(np.float64) * projected[t].astype(np.float64))
        prev = int(cand_ids[t][int(np.argmax(cand_values[t] + pair))])
        path.append(prev)
    return np.asarray(path, np.int64)


def check_dflash(rng: np.random.Generator) -> None:
    """The DFlash kernels (cuda_kernels/dflash.py) against float64 references and their CPU
    twins (tf_async/backend/cpu/dflash.py): the grouped convolution (kernel 2, groups of 4),
    block attention with a sliding mask and GQA, the top-k (ties: lower id) and the chain."""
    from cuda_kernels import dflash as dev
    from tf_async.backend.cpu import dflash as cpu

    x = rng.standard_normal((5, 16)).astype(np.float32)
    taps = rng.standard_normal((5, 2, 4)).astype(np.float32)
    base = rng.standard_normal((2, 16)).astype(np.float32)
    outs = [np.full_like(x, np.nan) for _ in range(2)]
    dev.grouped_conv(x, taps, base, 4, outs[0])
    cpu.grouped_conv(x, taps, base, 4, outs[1])
    ref = dflash_conv_ref(x, taps, base, 4)
    assert rel_err(outs[0], ref) < 1e-6 and rel_err(outs[1], ref) < 1e-6
    _check_dflash_attention(rng, dev, cpu)
    _check_dflash_selector(rng, dev, cpu)
    _check_dflash_split_topk(rng, dev)


def _check_dflash_attention(rng: np.random.Generator, dev, cpu) -> None:
    rows, nh, nkv, hd, ring = 3, 4, 2, 8, 6
    q = rng.standard_normal((rows, nh, hd)).astype(np.float32)
    keys = rng.standard_normal((ring + rows, nkv, hd)).astype(np.float32)
    values = rng.standard_normal((ring + rows, nkv, hd)).astype(np.float32)
    qpos = np.arange(10, 10 + rows)
    kpos = np.concatenate([np.arange(10 - ring, 10), qpos])
    diff = qpos[:, None] - kpos[None, :]
    visible = (np.abs(diff) < 5).astype(np.uint8)  # a window of 5, non-causal in the block
    outs = [np.full_like(q, np.nan) for _ in range(2)]
    with _quick_barriers():
        dev.block_attention(q, keys, values, visible, 0.3, np.zeros((rows, nh, ring + rows), np.float32),
                            outs[0])
    cpu.block_attention(q, keys, values, visible, 0.3, outs[1])
    ref = dflash_attention_ref(q, keys, values, visible, 0.3)
    assert rel_err(outs[0], ref) < 1e-5 and rel_err(outs[1], ref) < 1e-5


def _check_dflash_split_topk(rng: np.random.Generator, dev) -> None:
    """The two-phase top-k (segments, then their candidates) gives the one-pass kernel's ids
    and values: ties across segments, -inf, NaN, fewer finite values than top_k in a
    segment and in a whole row, a vocabulary that is not a whole number of segments."""
    saved = dev.TOPK_SEGMENT_MIN
    dev.TOPK_SEGMENT_MIN = 16  # many segments at the simulator's sizes
    try:
        for vocab, top_k in ((97, 7), (40, 3)):
            logits = rng.standard_normal((4, vocab)).astype(np.float32)
            logits[0, [7, vocab // 2, vocab // 2 + 1, vocab - 1]] = 9.0  # ties across segments: lower id first
            logits[1, ::3] = np.float32(1.5)  # many ties
            logits[2, :] = np.nan
            logits[2, [3, vocab - 2]] = [-np.inf, 0.25]  # two values left, then sentinels
            logits[3, 5:] = -np.inf
            logits[3, 1] = np.nan
            segments = dev.topk_segments(vocab)[0]
            assert segments > 1
            outs = []
            for scratch in (None, (np.zeros((4, segments, top_k), np.int64),
                                   np.zeros((4, segments, top_k), np.float32))):
                ids, vals = np.zeros((4, top_k), np.int64), np.zeros((4, top_k), np.float32)
                with _quick_barriers():
                    dev.topk_rows(logits, top_k, ids, vals, None, scratch)
                outs.append((ids, vals))
            assert np.array_equal(outs[0][0], outs[1][0]), (vocab, top_k, outs)
            assert np.array_equal(outs[0][1].view(np.uint32), outs[1][1].view(np.uint32)), (vocab, top_k)
            assert list(outs[0][0][2, :3]) == [vocab - 2, 3, vocab]  # then sentinels
    finally:
        dev.TOPK_SEGMENT_MIN = saved


def _check_dflash_selector(rng: np.random.Generator, dev, cpu) -> None:
    rows, vocab, top_k, rank = 3, 300, 5, 8
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[0, [7, 40, 41, 299]] = 9.0  # ties: lower id first
    logits[1, 5] = -np.inf
    ids = [np.zeros((rows, top_k), np.int64) for _ in range(2)]
    vals = [np.zeros((rows, top_k), np.float32) for _ in range(2)]
    with _quick_barriers():
        dev.topk_rows(logits, top_k, ids[0], vals[0])
    cpu.topk_rows(logits, top_k, ids[1], vals[1])
    assert np.array_equal(ids[0], ids[1]) and np.array_equal(vals[0], vals[1])
    assert list(ids[0][0, :4]) == [7, 40, 41, 299]
    projected = rng.standard_normal((rows, rank)).astype(np.float32)
    books = [rng.standard_normal((vocab, rank)).astype(np.float32) for _ in range(2)]
    paths = [np.zeros(rows, np.int64) for _ in range(2)]
    with _quick_barriers():
        dev.select_chain(ids[0], vals[0], projected, books[0], books[1], 17, paths[0])
    cpu.select_chain(ids[1], vals[1], projected, books[0], books[1], 17, paths[1])
    ref = dflash_chain_ref(ids[1], vals[1], projected, books[0], books[1], 17)
    assert np.array_equal(paths[0], ref) and np.array_equal(paths[1], ref), (paths, ref)


CHECKS: dict[str, Callable[[np.random.Generator], None]] = {
    "matmul": check_matmul,
    "grouped_matmul": check_grouped_matmul,
    "embed": check_embed,
    "attention": check_attention,
    "attention_wide_heads": check_attention_wide_heads,
    "attention_tiled": check_attention_tiled,
    "kv_write": check_kv_write,
    "e4m3_exhaustive": check_e4m3_exhaustive,
    "zero_pages": check_zero_pages,
    "norm_rope_silu": check_norm_rope_silu,
    "moe": check_moe,
    "fused_layer_ops": check_fused_layer_ops,
    "sampling": check_sampling,
    "cpu_twins": check_cpu_twins,
    "dflash": check_dflash,
}


def main(names: list[str]) -> int:
    rng = np.random.default_rng(int(time.time()))
    for name in names or list(CHECKS):
        start = time.perf_counter()
        CHECKS[name](rng)
        print(f"ok {name} {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
