"""CPU kernels and CpuOps: values vs float64 NumPy references, bit-exact batch invariance,
paged == contiguous KV, KV dtype conversions, and argument validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from tf_async.backend.cpu import int8_matmul, kernels
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.weights import AffineWeight, DenseWeight, LinearParts, quantize_affine

OPS = CpuOps()  # the default: affine matmuls on int8 x where the weight fits
FLOAT_X = CpuOps(int8_x=False)  # affine matmuls on float32 x (kernels.matmul_affine)


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def assert_batch_invariant(run: Callable[[np.ndarray], np.ndarray], rows: int, seed: int = 0) -> None:
    """run(row_indices) -> outputs of those rows, in that order. Every row must be
    bit-identical alone, in the full batch and in a shuffled batch."""
    full = run(np.arange(rows))
    order = rng_for(seed).permutation(rows)
    shuffled = run(order)
    for position, r in enumerate(order):
        assert np.array_equal(shuffled[position], full[r], equal_nan=True), f"row {r} shuffled"
    for r in range(rows):
        assert np.array_equal(run(np.array([r]))[0], full[r], equal_nan=True), f"row {r} alone"
    pair = np.array([rows - 1, 0])
    assert np.array_equal(run(pair), full[pair], equal_nan=True)


# --------------------------------------------------------------------------- matmuls
# fast paths (whole 16-byte blocks, 2**k per group) and the generic one (4-16, 4-96, 8-8)
AFFINE_CASES = [(4, 32), (4, 64), (4, 128), (4, 16), (4, 96), (8, 16), (8, 32), (8, 64), (8, 8)]


@pytest.mark.parametrize(("bits", "group_size"), AFFINE_CASES)
def test_matmul_affine_matches_reference(bits: int, group_size: int) -> None:
    rng = rng_for(bits * 100 + group_size)
    in_features = 7 * group_size  # an odd number of groups (and of code blocks)
    w = quantize_affine(randn(rng, 37, in_features), bits, group_size)
    x = randn(rng, 5, in_features)
    out = FLOAT_X.linear(x, w)
    ref = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (4, 96), (8, 32), (8, 128)])
def test_int8_x_matmul_twin_matches_reference_and_is_batch_invariant(bits: int, group_size: int) -> None:
    """CpuOps(int8_x=True), the CPU twin of the GPU's int8-x numerics (cuda_kernels/qdot.py):
    its int8 x is float64's nearest integer of x * 127 / amax per chunk of 32 (a zero chunk,
    ties), its output that x times the dequantized weight, every row alone == in the batch;
    weights whose groups are not whole chunks keep float32 x."""
    from tests.cuda_sim_check import int8_x_ref

    rng = rng_for(bits * 1000 + group_size)
    in_features = 5 * max(group_size, 64)
    w = quantize_affine(randn(rng, 37, in_features), bits, group_size)
    x = randn(rng, 6, in_features)
    x[0, 32:64] = 0.0
    x[1, :3] = [127.0, 0.5, -1.5]  # amax 127: x * inv lands on ties
    ops = CpuOps(int8_x=True)
    xq, xs = np.empty(x.shape, np.int8), np.empty((6, in_features // 16), np.float32)
    kernels.quantize_rows_int8(x, bits == 4, xq, xs)
    order = [kernels.int8_x_position(bits == 4, j) for j in range(32)]
    levels = xq.reshape(6, -1, 32)[:, :, order].reshape(6, -1).astype(np.float64)
    d = np.repeat(xs[:, 0::2].astype(np.float64), 32, axis=1)
    np.testing.assert_array_equal(levels * d, int8_x_ref(x))
    out = ops.linear(x, w)
    ref = int8_x_ref(x) @ w.dequantize().astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-5)
    assert_batch_invariant(lambda rows: ops.linear(x[rows], w), 6)
    odd = quantize_affine(randn(rng, 5, 48), bits, 16)  # groups of 16: float32 x
    x48 = np.ascontiguousarray(x[:, :48])
    np.testing.assert_array_equal(ops.linear(x48, odd), FLOAT_X.linear(x48, odd))


def _int8_x_reference(x: np.ndarray, w: AffineWeight) -> np.ndarray:
    """kernels' twin of the GPU's qdot (quantize_rows_int8, matmul_affine_int8x): the bits
    that int8_matmul must give."""
    xq, xs = np.empty(x.shape, np.int8), np.empty((x.shape[0], x.shape[1] // 16), np.float32)
    kernels.quantize_rows_int8(x, w.bits == 4, xq, xs)
    out = np.full((x.shape[0], w.out_features), np.nan, np.float32)
    kernels.matmul_affine_int8x(xq, xs, w.codes, w.scales, w.biases, w.bits, w.group_size, out)
    return out


# in_features of 1 chunk, 3 (a pair and a lone one), 7, 9 (a block and one), 18 (the default
# model: 2 blocks and a pair), 48 (6 blocks); groups of 1, 2, 4, 8 chunks where they fit
INT8_SHAPES = [(32, 32), (96, 32), (224, 32), (288, 32), (576, 32), (576, 64), (1536, 32),
               (1536, 128), (256, 256), (512, 64)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("in_features", "group_size"), INT8_SHAPES)
def test_int8_matmul_gives_the_twins_bits(bits: int, in_features: int, group_size: int) -> None:
    """The default CPU matmul of affine weights (int8_matmul: byte SIMD, 8 chunks a vector)
    gives kernels.matmul_affine_int8x's bits (the GPU's numerics and order), row for row,
    whatever the rows of the call (1 .. 9: the 4-row tiles and the rows left over)."""
    rng = rng_for(bits * 7919 + in_features + group_size)
    w = quantize_affine(randn(rng, 37, in_features), bits, group_size)
    x = randn(rng, 9, in_features) * np.float32(3.0)
    x[2, :32] = 0.0  # a zero chunk: d = 0
    x[3, :3] = [400.0, -400.0, 0.5]
    out = OPS.linear(x, w)
    assert np.array_equal(out.view(np.uint32), _int8_x_reference(x, w).view(np.uint32))
    for rows in (1, 4, 5):
        assert np.array_equal(OPS.linear(x[-rows:], w).view(np.uint32), out[-rows:].view(np.uint32))


def half_exact(w: AffineWeight) -> AffineWeight:
    """w with its scales and biases rounded to float16 values (as a GGUF block's d and m are)."""
    def rounded(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).astype(np.float32)

    return dataclasses.replace(w, scales=rounded(w.scales), biases=rounded(w.biases))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("in_features", "group_size"), INT8_SHAPES)
def test_int8_matmul_reads_float16_scales_for_the_same_bits(bits: int, in_features: int,
                                                           group_size: int) -> None:
    """Scales and biases that are float16 values run from float16 copies (compact_scales: a
    decode step reads half the bytes of them) and give the float32 arrays' bits, row for row;
    one value that float16 cannot hold keeps the float32 arrays."""
    rng = rng_for(bits * 104729 + in_features + group_size)
    w = half_exact(quantize_affine(randn(rng, 37, in_features), bits, group_size))
    x = randn(rng, 9, in_features) * np.float32(3.0)
    scales, biases = int8_matmul.compact_scales((w.scales,), (w.biases,))
    assert scales[0].dtype == biases[0].dtype == np.uint16
    for rows in (9, 1, 4, 5):
        out = np.full((rows, 37), np.nan, np.float32)
        int8_matmul.matmul(x[-rows:], (w.codes,), scales, biases, bits, group_size, out)
        expected = _int8_x_reference(x[-rows:], w)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32)), rows
    assert np.array_equal(OPS.linear(x, w).view(np.uint32), _int8_x_reference(x, w).view(np.uint32))
    w.biases[3, 0] = np.float32(1 / 3)
    kept = int8_matmul.compact_scales((w.scales,), (w.biases,))
    assert kept[0][0] is w.scales and kept[1][0] is w.biases


def test_only_kept_plans_compact_their_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """An uploaded weight's plan makes its float16 copies once, for every call; a weight made
    per call (an expert's view) is not copied at all (that would cost a conversion a call)."""
    calls: list[int] = []
    compact = int8_matmul.compact_scales
    monkeypatch.setattr(int8_matmul, "compact_scales",
                        lambda s, b: calls.append(len(s)) or compact(s, b))
    rng = rng_for(17)
    w = half_exact(quantize_affine(randn(rng, 21, 64), 4, 32))
    x = randn(rng, 2, 64)
    ops = CpuOps(int8_x=True)
    per_call = [ops.linear(x, w) for _ in range(3)]
    assert calls == []
    ops.upload_linear(w)
    kept = [ops.linear(x, w) for _ in range(3)]
    assert calls == [1]
    for out in per_call + kept:
        assert np.array_equal(out.view(np.uint32), _int8_x_reference(x, w).view(np.uint32))


@pytest.mark.parametrize("switch", ["TF_ASYNC_CPU_AVX2", "TF_ASYNC_CPU_VNNI"])
def test_int8_matmul_plain_llvm_twin_gives_the_same_bits(tmp_path, switch: str) -> None:
    """Without AVX2 (TF_ASYNC_CPU_AVX2=0: plain LLVM vectors for maddubs, phaddw, madd and the
    8-bit sign trick), and with AVX2 but without VNNI (TF_ASYNC_CPU_VNNI=0: the 8-bit sign
    trick instead of vpdpbusd), the same integers and so the same bits, in a fresh process
    with its own Numba cache."""
    import os
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from tf_async.backend.cpu import int8_matmul\n"
        "from tests.test_cpu_kernels import INT8_SHAPES, _int8_x_reference, half_exact, randn, rng_for\n"
        "from tf_async.backend.weights import quantize_affine\n"
        f"assert not int8_matmul.{switch.rsplit('_', 1)[1]}\n"
        "for bits in (4, 8):\n"
        "    for in_f, gs in INT8_SHAPES:\n"
        "        rng = rng_for(in_f + gs + bits)\n"
        "        w = quantize_affine(randn(rng, 21, in_f), bits, gs)\n"
        "        x = randn(rng, 6, in_f)\n"
        "        out = np.empty((6, 21), np.float32)\n"
        "        int8_matmul.matmul(x, (w.codes,), (w.scales,), (w.biases,), bits, gs, out)\n"
        "        assert np.array_equal(out.view(np.uint32), _int8_x_reference(x, w).view(np.uint32)), (bits, in_f, gs)\n"
        "        w = half_exact(w)\n"
        "        scales, biases = int8_matmul.compact_scales((w.scales,), (w.biases,))\n"
        "        int8_matmul.matmul(x, (w.codes,), scales, biases, bits, gs, out)\n"
        "        assert np.array_equal(out.view(np.uint32), _int8_x_reference(x, w).view(np.uint32)), (bits, in_f, gs)\n"
        "print('same bits')\n")
    env = {**os.environ, switch: "0", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same bits" in done.stdout


def test_matmul_dense_and_bias_match_reference() -> None:
    rng = rng_for(1)
    w, bias, x = randn(rng, 33, 70), randn(rng, 33), randn(rng, 2, 3, 70)
    out = OPS.linear(x, DenseWeight(w), bias)
    assert out.shape == (2, 3, 33)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + bias
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("ops", [OPS, FLOAT_X], ids=["int8_x", "float_x"])
@pytest.mark.parametrize(("bits", "group_size"), [*AFFINE_CASES, (0, 0)])
def test_matmuls_are_batch_invariant(bits: int, group_size: int, ops: CpuOps) -> None:
    rng = rng_for(7 + bits)
    dense = randn(rng, 70, 384)
    w = DenseWeight(dense) if bits == 0 else quantize_affine(dense, bits, group_size)
    x = randn(rng, 11, 384)
    assert_batch_invariant(lambda rows: ops.linear(x[rows], w), 11)


@pytest.mark.parametrize("ops", [OPS, FLOAT_X], ids=["int8_x", "float_x"])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 32), (8, 128), (4, 48), (4, 96)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 80])
def test_fused_parts_equal_the_parts_one_by_one(bits: int, group_size: int, rows: int,
                                                ops: CpuOps) -> None:
    """q|k|v and gate|up in one call (one parallel region over every part's features) give
    each column the bits of its part's own matmul, in its place (group 48, and 96 on int8 x:
    part by part)."""
    rng = rng_for(bits * 1000 + group_size + rows)
    in_f = {48: 192, 96: 288}.get(group_size, 256)
    parts = tuple(quantize_affine(randn(rng, n, in_f), bits, group_size) for n in (96, 32, 48))
    x = randn(rng, rows, in_f)
    fused = ops.linear(x, LinearParts(parts))
    alone = np.concatenate([ops.linear(x, p) for p in parts], axis=-1)
    assert fused.shape == (rows, 176)
    assert np.array_equal(fused.view(np.uint32), alone.view(np.uint32))
    gate, up = parts[0], quantize_affine(randn(rng, 96, in_f), bits, group_size)
    swiglu = ops.swiglu_linear(x, LinearParts((gate, up)))
    expected = ops.silu_mul(ops.linear(x, gate), ops.linear(x, up))
    assert np.array_equal(swiglu.view(np.uint32), expected.view(np.uint32))


def test_embed_dense_and_affine() -> None:
    rng = rng_for(2)
    table = randn(rng, 50, 64)
    ids = np.array([3, 0, 49, 3], np.int64)
    assert np.array_equal(OPS.embed(DenseWeight(table), ids), table[ids])
    for bits in (4, 8):
        w = quantize_affine(table, bits, 32)
        np.testing.assert_allclose(OPS.embed(w, ids), w.dequantize()[ids], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- row-wise ops
def test_rms_norm_any_rank_and_batch_invariant() -> None:
    rng = rng_for(3)
    x, w = randn(rng, 2, 5, 96), randn(rng, 96)
    out = OPS.rms_norm(x, w, 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w
    assert out.shape == x.shape
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    flat = x.reshape(10, 96)
    assert_batch_invariant(lambda rows: OPS.rms_norm(flat[rows], w, 1e-6), 10)


def rope_reference(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
                   mscale: float) -> np.ndarray:
    half = inv_freq.shape[0]
    angle = positions[:, None].astype(np.float64) * inv_freq.astype(np.float64)[None, :]
    cos, sin = (np.cos(angle) * mscale)[:, None, :], (np.sin(angle) * mscale)[:, None, :]
    out = x.astype(np.float64).copy()
    a, b = out[..., :half].copy(), out[..., half:2 * half].copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:2 * half] = b * cos + a * sin
    return out


@pytest.mark.parametrize(("rot", "mscale"), [(32, 1.0), (16, 1.25)])
def test_rope_matches_reference_and_keeps_tail(rot: int, mscale: float) -> None:
    rng = rng_for(rot)
    x = randn(rng, 6, 3, 32)
    positions = np.array([0, 1, 7, 100, 4095, 3], np.int64)
    inv_freq = (10000.0 ** (-np.arange(0, rot, 2) / rot)).astype(np.float32)
    y = x.copy()
    OPS.rope(y, positions, inv_freq, mscale)
    np.testing.assert_allclose(y, rope_reference(x, positions, inv_freq, mscale),
                               rtol=1e-5, atol=1e-5)
    assert np.array_equal(y[..., rot:], x[..., rot:])  # dims >= rot untouched

    def run(rows: np.ndarray) -> np.ndarray:
        part = x[rows].copy()
        OPS.rope(part, positions[rows], inv_freq, mscale)
        return part

    assert_batch_invariant(run, 6)


def test_silu_mul_matches_reference() -> None:
    rng = rng_for(4)
    gate, up = randn(rng, 3, 40) * 4, randn(rng, 3, 40)
    g = gate.astype(np.float64)
    np.testing.assert_allclose(OPS.silu_mul(gate, up), g / (1 + np.exp(-g)) * up,
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows, width", [(1, 37), (5, 1536)])
def test_silu_mul_halves_has_silu_mul_bits(rows, width) -> None:
    """swiglu_linear's kernel on gate|up side by side (vectorised) against silu_mul on the
    halves: the same bits, including gates far out on both sides (exp clamped)."""
    from tf_async.backend.cpu import kernels

    gate_up = randn(rng_for(rows), rows, 2 * width) * 30
    want = np.full((rows, width), np.nan, np.float32)
    kernels.silu_mul(np.ascontiguousarray(gate_up[:, :width]),
                     np.ascontiguousarray(gate_up[:, width:]), want)
    got = np.full((rows, width), np.nan, np.float32)
    kernels.silu_mul_halves(gate_up, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# --------------------------------------------------------------------------- conversions
def e4m3_value_table() -> np.ndarray:
    """All 256 E4M3FN values in float64 from the format definition (NaN at 0x7F/0xFF)."""
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, mant = (code >> 3) & 15, code & 7
        mag = mant / 8 * 2.0**-6 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7)
        values[code] = np.nan if (exp == 15 and mant == 7) else sign * mag
    return values


def e4m3_reference(x: float) -> int:
    """Nearest finite E4M3FN code (ties to even mantissa), saturating; brute force."""
    table = e4m3_value_table()
    x = float(np.clip(x, -448.0, 448.0))
    finite = [c for c in range(256) if not np.isnan(table[c]) and (c & 0x80) == (0x80 if np.signbit(x) else 0)]
    dist = np.array([abs(table[c] - x) for c in finite])
    best = [finite[i] for i in np.flatnonzero(dist == dist.min())]
    return min(best, key=lambda c: (c & 1, c))


def test_e4m3_edge_values() -> None:
    assert kernels.from_e4m3(0x7E) == 448.0
    assert np.isnan(kernels.from_e4m3(0x7F)) and np.isnan(kernels.from_e4m3(0xFF))
    assert kernels.from_e4m3(0x08) == 2.0**-6
    assert kernels.from_e4m3(0x01) == 2.0**-9
    assert kernels.from_e4m3(0x38) == 1.0
    assert kernels.to_e4m3(500.0) == 0x7E
    assert kernels.to_e4m3(-1000.0) == 0xFE
    assert kernels.to_e4m3(0.0009) == 0x00
    assert kernels.to_e4m3(np.inf) == 0x7E
    assert kernels.to_e4m3(np.nan) == 0x7F


def test_e4m3_all_codes_round_trip_and_random_encoding() -> None:
    table = e4m3_value_table()
    for code in range(256):
        value = kernels.from_e4m3(code)
        if np.isnan(table[code]):
            assert np.isnan(value)
            continue
        assert value == table[code]
        assert kernels.to_e4m3(value) == code
    rng = rng_for(5)
    samples = np.concatenate([rng.standard_normal(150) * 30, rng.standard_normal(50) * 0.01,
                              (table[:0x7E] + table[1:0x7F]) / 2])  # midpoints test ties
    for x in samples.astype(np.float32):
        assert kernels.to_e4m3(x) == e4m3_reference(float(x)), x


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits, nearest even, with Python integers."""
    out = []
    for u in x.astype(np.float32).view(np.uint32).tolist():
        keep, rest = u >> 16, u & 0xFFFF
        if rest > 0x8000 or (rest == 0x8000 and keep & 1):
            keep += 1
        out.append(keep)
    return np.array(out, np.uint16)


def test_bf16_conversion() -> None:
    rng = rng_for(6)
    x = np.concatenate([randn(rng, 200) * 1e3, np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0],
                                                        np.float32)])
    bits = np.array([kernels.to_bf16_bits(v) for v in x], np.uint16)
    assert np.array_equal(bits, bf16_reference(x))
    back = np.array([kernels.from_bf16_bits(b) for b in bits], np.float32)
    assert np.array_equal(back.view(np.uint32), bits.astype(np.uint32) << 16)
    assert kernels.bf16_round(np.float32(1.0 + 2**-8)) == 1.0  # tie -> even
    assert np.isnan(kernels.from_bf16_bits(kernels.to_bf16_bits(np.float32(np.nan))))


# --------------------------------------------------------------------------- KV cache
def decode_kv(stored: np.ndarray, scale: float) -> np.ndarray:
    if stored.dtype == np.float32:
        return stored.astype(np.float64)
    if stored.dtype == np.uint16:
        return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return e4m3_value_table()[stored] * scale


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "fp8"])
def test_kv_write_round_trip(kv_dtype: str) -> None:
    rng = rng_for(8)
    kv = OPS.alloc_kv(2, 16, 2, 8, kv_dtype)
    scales = np.array([[1.0, 1.0], [0.5, 2.0]], np.float32)
    k, v = randn(rng, 3, 2, 8), randn(rng, 3, 2, 8)
    slots = np.array([5, 0, 15], np.int64)
    OPS.kv_write(kv, 1, k, v, slots, scales)
    assert not kv[0].any() and not np.delete(kv[1], slots, axis=1).any()
    got_k, got_v = decode_kv(kv[1, 0, slots], 0.5), decode_kv(kv[1, 1, slots], 2.0)
    if kv_dtype == "f32":
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
    elif kv_dtype == "bf16":
        assert np.array_equal(kv[1, 0, slots].ravel(), bf16_reference(k.ravel()))
    else:
        codes = [e4m3_reference(float(np.float32(x) / np.float32(0.5))) for x in k.ravel()]
        assert np.array_equal(kv[1, 0, slots].ravel(), np.array(codes, np.uint8))
        np.testing.assert_allclose(got_v, v, rtol=0.07, atol=2.0 * 2**-9)


def test_zero_pages_zeroes_exactly_those_pages() -> None:
    kv = OPS.alloc_kv(3, 8 * 4, 2, 4, "bf16")
    kv[:] = 7
    OPS.zero_pages(kv, np.array([1, 6], np.int32), 4)
    page_of_slot = np.arange(32) // 4
    zeroed = np.isin(page_of_slot, [1, 6])
    assert not kv[:, :, zeroed].any()
    assert (kv[:, :, ~zeroed] == 7).all()


def attention_reference(q: np.ndarray, kv_layer: np.ndarray, scales: tuple[float, float],
                        block_table: np.ndarray, row_seq: np.ndarray, row_pos: np.ndarray,
                        page_size: int, sm_scale: float) -> np.ndarray:
    keys, values = decode_kv(kv_layer[0], scales[0]), decode_kv(kv_layer[1], scales[1])
    group = q.shape[1] // kv_layer.shape[2]
    out = np.empty(q.shape)
    for r in range(q.shape[0]):
        pos = np.arange(row_pos[r] + 1)
        slots = block_table[row_seq[r], pos // page_size].astype(np.int64) * page_size + pos % page_size
        for h in range(q.shape[1]):
            k, v = keys[slots, h // group], values[slots, h // group]
            s = k @ q[r, h].astype(np.float64) * sm_scale
            p = np.exp(s - s.max())
            out[r, h] = p @ v / p.sum()
    return out


def filled_arena(kv_dtype: str, page_map: list[list[int]], num_pages: int, page_size: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Arena whose stream s, position p holds the same K/V whatever the page map."""
    rng = rng_for(seed)
    kv = OPS.alloc_kv(2, num_pages * page_size, 2, 16, kv_dtype)
    scales = np.array([[1.0, 1.0], [0.05, 0.1]], np.float32)
    for pages in page_map:
        tokens = len(pages) * page_size
        k, v = randn(rng, tokens, 2, 16), randn(rng, tokens, 2, 16)
        pos = np.arange(tokens)
        slots = np.array(pages, np.int64)[pos // page_size] * page_size + pos % page_size
        OPS.kv_write(kv, 1, k, v, slots, scales)
    return kv, scales


def table_of(page_map: list[list[int]]) -> np.ndarray:
    width = max(len(p) for p in page_map)
    return np.array([p + [-1] * (width - len(p)) for p in page_map], np.int32)


SCATTERED = [[5, 2, 9], [0, 7], [11, 3, 8, 1]]
CONTIGUOUS = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
ROW_SEQ = np.array([0, 2, 1, 2, 0, 2, 1], np.int32)
ROW_POS = np.array([11, 0, 6, 15, 3, 9, 2], np.int64)


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "fp8"])
def test_paged_attention_reference_invariance_and_paging(kv_dtype: str) -> None:
    page_size, sm_scale = 4, 0.25
    q = randn(rng_for(9), 7, 4, 16)
    kv, scales = filled_arena(kv_dtype, SCATTERED, 12, page_size, seed=10)
    table = table_of(SCATTERED)

    def run(rows: np.ndarray, arena: np.ndarray = kv, bt: np.ndarray = table) -> np.ndarray:
        return OPS.attention(q[rows], arena, 1, scales, bt, ROW_SEQ[rows], ROW_POS[rows],
                             page_size, sm_scale)

    out = run(np.arange(7))
    ref = attention_reference(q, kv[1], (0.05, 0.1), table, ROW_SEQ, ROW_POS, page_size, sm_scale)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_batch_invariant(run, 7)
    kv_c, _ = filled_arena(kv_dtype, CONTIGUOUS, 12, page_size, seed=10)
    assert np.array_equal(run(np.arange(7), kv_c, table_of(CONTIGUOUS)), out)


def test_long_attention_parallel_path_matches_single_rows() -> None:
    # The full call is big enough to run threaded; a short row alone runs serially.
    rng = rng_for(16)
    page_size, positions = 16, np.array([599, 10, 300, 598], np.int64)
    kv = OPS.alloc_kv(1, 40 * page_size, 2, 64, "bf16")
    pages = rng.permutation(40).astype(np.int32)
    slots = pages[np.arange(600) // page_size].astype(np.int64) * page_size + np.arange(600) % 16
    OPS.kv_write(kv, 0, randn(rng, 600, 2, 64), randn(rng, 600, 2, 64), slots, None)
    q, row_seq = randn(rng, 4, 8, 64), np.zeros(4, np.int32)

    def run(rows: np.ndarray) -> np.ndarray:
        return OPS.attention(q[rows], kv, 0, None, pages[None], row_seq[rows], positions[rows],
                             page_size, 0.125)

    ref = attention_reference(q, kv[0], (1.0, 1.0), pages[None], row_seq, positions, page_size,
                              0.125)
    np.testing.assert_allclose(run(np.arange(4)), ref, rtol=1e-4, atol=1e-5)
    assert_batch_invariant(run, 4)


# --------------------------------------------------------------------------- MoE
def test_moe_route_ties_order_and_normalisation() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    for norm in (False, True):
        ids = np.empty((2, 3), np.int32)
        weights = np.empty((2, 3), np.float32)
        kernels.moe_route(logits, 3, norm, ids, weights)
        assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
        probs = np.exp(logits[0] - 3.0) / np.exp(logits[0] - 3.0).sum()
        expect = probs[[1, 2, 4]] / (probs[[1, 2, 4]].sum() if norm else 1.0)
        np.testing.assert_allclose(weights[0], expect, rtol=1e-6)
        total = weights.sum(axis=1)
        assert np.allclose(total, 1.0) if norm else (total < 1.0).all()
    logits = np.array([[0.1, 2.0, -1.0, 0.7]], np.float32)
    out_ids = np.empty((1, 2), np.int32)
    kernels.moe_route(logits, 2, False, out_ids, np.empty((1, 2), np.float32))
    assert out_ids.tolist() == [[1, 3]]  # descending weight


def moe_reference(x: np.ndarray, router: np.ndarray, experts: Sequence[tuple[np.ndarray, ...]],
                  top_k: int) -> np.ndarray:
    logits = x.astype(np.float64) @ router.T
    out = np.zeros(x.shape)
    for r in range(x.shape[0]):
        p = np.exp(logits[r] - logits[r].max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:top_k]
        for e in top:
            g, u, d = (m.astype(np.float64) for m in experts[e])
            gate, up = x[r] @ g.T, x[r] @ u.T
            out[r] += p[e] / p[top].sum() * ((gate / (1 + np.exp(-gate)) * up) @ d.T)
    return out


def test_moe_matches_reference_and_is_batch_invariant() -> None:
    rng = rng_for(11)
    hidden, inter, num_experts = 64, 32, 4
    gate, up = randn(rng, num_experts, inter, hidden) / 8, randn(rng, num_experts, inter, hidden) / 8
    down, router = randn(rng, num_experts, hidden, inter) / 6, randn(rng, num_experts, hidden)
    x = randn(rng, 9, hidden)
    args = (DenseWeight(router), DenseWeight(gate), DenseWeight(up), DenseWeight(down), 2, True)
    out = OPS.moe(x, *args)
    experts = [(gate[e], up[e], down[e]) for e in range(num_experts)]
    np.testing.assert_allclose(out, moe_reference(x, router, experts, 2), rtol=1e-4, atol=1e-5)
    assert_batch_invariant(lambda rows: OPS.moe(x[rows], *args), 9)
    gate4, up4, down8 = (quantize_affine(gate, 4, 32), quantize_affine(up, 4, 32),
                         quantize_affine(down, 8, 32))
    q_args = (DenseWeight(router), gate4, up4, down8, 2, True)
    assert_batch_invariant(lambda rows: OPS.moe(x[rows], *q_args), 9)


# --------------------------------------------------------------------------- validation
def test_ops_reject_bad_arguments() -> None:
    w = quantize_affine(randn(rng_for(12), 8, 64), 4, 32)
    x = randn(rng_for(13), 2, 64)
    with pytest.raises(ValueError, match="dtype float32"):
        OPS.linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="in_features 64"):
        OPS.linear(x[:, :32].copy(), w)
    with pytest.raises(ValueError, match="C-contiguous"):
        OPS.linear(np.asfortranarray(np.ones((3, 64), np.float32)), w)
    bad = AffineWeight(w.codes, w.scales[:, :1].copy(), w.biases, 4, 32)
    with pytest.raises(ValueError, match="scales"):
        OPS.linear(x, bad)
    with pytest.raises(ValueError, match="scales"):
        CpuOps().upload_linear(bad)
    ops = CpuOps()
    assert ops.upload_linear(w) is w
    assert np.array_equal(ops.linear(x, w), OPS.linear(x, w))
    with pytest.raises(ValueError, match="embed ids"):
        OPS.embed(w, np.array([8], np.int64))
    kv = OPS.alloc_kv(1, 8, 1, 4, "f32")
    k = randn(rng_for(14), 1, 1, 4)
    with pytest.raises(ValueError, match="slots"):
        OPS.kv_write(kv, 0, k, k, np.array([8], np.int64), None)
    with pytest.raises(ValueError, match="layer 1"):
        OPS.kv_write(kv, 1, k, k, np.array([0], np.int64), None)
    with pytest.raises(ValueError, match="kv_dtype"):
        OPS.alloc_kv(1, 8, 1, 4, "int8")
    q = randn(rng_for(15), 1, 2, 4)
    table = np.array([[0, 1]], np.int32)
    with pytest.raises(ValueError, match="block_table"):
        OPS.attention(q, kv, 0, None, table, np.array([0], np.int32), np.array([8], np.int64), 4, 1.0)
    with pytest.raises(ValueError, match="row_seq"):
        OPS.attention(q, kv, 0, None, table, np.array([0], np.int64), np.array([1], np.int64), 4, 1.0)
    with pytest.raises(ValueError, match="page_ids"):
        OPS.zero_pages(kv, np.array([2], np.int32), 4)


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_attn_inputs_equal_the_basic_ops(kv_dtype: str, norms: bool, rows: int) -> None:
    """attn_inputs in one kernel call: q and the stored K/V bit-identical to split + q/k
    norms + two ropes + kv_write."""
    rng = rng_for(rows + 10 * norms)
    nh, nkv, hd = 9, 3, 64
    qkv = randn(rng, rows, (nh + 2 * nkv) * hd)
    q_norm = rng.random(hd).astype(np.float32) if norms else None
    k_norm = rng.random(hd).astype(np.float32) if norms else None
    positions = rng.integers(0, 1000, rows).astype(np.int64)
    inv_freq = rng.random(24).astype(np.float32)
    slots = rng.permutation(64)[:rows].astype(np.int64)
    scales = np.array([[1.0, 1.0], [0.5, 0.25]], np.float32) if kv_dtype == "fp8" else None
    fused_kv, basic_kv = OPS.alloc_kv(2, 64, nkv, hd, kv_dtype), OPS.alloc_kv(2, 64, nkv, hd, kv_dtype)
    q = OPS.attn_inputs(qkv, q_norm, k_norm, 1e-6, positions, inv_freq, 1.3, fused_kv, 1, slots,
                        scales, nh)
    q_ref = np.ascontiguousarray(qkv[:, :nh * hd]).reshape(rows, nh, hd)
    k_ref = np.ascontiguousarray(qkv[:, nh * hd:(nh + nkv) * hd]).reshape(rows, nkv, hd)
    v_ref = np.ascontiguousarray(qkv[:, (nh + nkv) * hd:]).reshape(rows, nkv, hd)
    if q_norm is not None and k_norm is not None:
        q_ref, k_ref = OPS.rms_norm(q_ref, q_norm, 1e-6), OPS.rms_norm(k_ref, k_norm, 1e-6)
    OPS.rope(q_ref, positions, inv_freq, 1.3)
    OPS.rope(k_ref, positions, inv_freq, 1.3)
    OPS.kv_write(basic_kv, 1, k_ref, v_ref, slots, scales)
    assert np.array_equal(q.view(np.uint32), q_ref.view(np.uint32))
    assert np.array_equal(fused_kv.view(np.uint8), basic_kv.view(np.uint8))
    with pytest.raises(ValueError, match="kv_write slots"):
        OPS.attn_inputs(qkv, q_norm, k_norm, 1e-6, positions, inv_freq, 1.3, fused_kv, 1,
                        slots + 64, scales, nh)


def test_matmul_plans_are_kept_for_uploaded_weights_only() -> None:
    """A weight the ops uploaded (and concat_linears of such) keeps its checked plan; a weight
    made per call (an expert's view) is checked every call and never kept, so the plans do not
    grow with calls; a changed weight under a reused id gets a new plan."""
    ops, rng = CpuOps(int8_x=False), rng_for(31)
    kept = ops.upload_linear(quantize_affine(randn(rng, 32, 64), 4, 32))
    parts, _ = ops.concat_linears([kept, ops.upload_linear(quantize_affine(randn(rng, 16, 64), 4, 32))])
    x = randn(rng, 2, 64)
    ops.linear(x, kept)
    ops.linear(x, parts)
    assert len(ops._plans) == 2
    for _ in range(5):
        transient = quantize_affine(randn(rng, 8, 64), 4, 32)
        np.testing.assert_allclose(ops.linear(x, transient), x @ transient.dequantize().T,
                                   rtol=1e-5, atol=1e-5)
    assert len(ops._plans) == 2
    bad = AffineWeight(kept.codes, kept.scales.astype(np.float64), kept.biases, 4, 32)
    with pytest.raises(ValueError, match="scales"):
        ops.linear(x, bad)
