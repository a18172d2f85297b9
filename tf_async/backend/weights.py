"""Weight containers. Loaders produce them; kernels consume them. Arrays are NumPy on the
CPU (the CUDA backend copies them to the device with the same fields).

Every linear weight is one of two kinds:

- `DenseWeight`: float32 `w: [out, in]` (HF layout, y = x @ w.T).
- `AffineWeight`: MLX-style affine quantization, kept packed:
  `codes: [out, in * bits // 32]` uint32, one little-endian bit stream per row, code i in
  bits [i*bits, (i+1)*bits) (element 0 in the lowest bits of word 0);
  `scales`, `biases`: `[out, in // group_size]` float32; w[r, i] = scales[r, g] * q + biases[r, g]
  with g = i // group_size. bits is 4 or 8. GGUF Q4_0/Q4_1/Q8_0 and the K-quants are
  repacked into this form at load (see models/gguf_io.py).

Stacked MoE experts carry a leading `[E]` axis on every array; `expert(e)` is the 2-D view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class DenseWeight:
    w: np.ndarray  # [out, in] or [E, out, in] float32

    @property
    def out_features(self) -> int:
        return int(self.w.shape[-2])

    @property
    def in_features(self) -> int:
        return int(self.w.shape[-1])

    def expert(self, e: int) -> DenseWeight:
        return DenseWeight(self.w[e])

    def dequantize(self) -> np.ndarray:
        return self.w


@dataclass(frozen=True, slots=True)
class AffineWeight:
    codes: np.ndarray  # [out, in*bits/32] or [E, out, in*bits/32] uint32
    scales: np.ndarray  # [out, in/group_size] (or [E, ...]) float32
    biases: np.ndarray  # [out, in/group_size] (or [E, ...]) float32
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[-2])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[-1]) * 32 // self.bits

    def expert(self, e: int) -> AffineWeight:
        return AffineWeight(self.codes[e], self.scales[e], self.biases[e], self.bits, self.group_size)

    def dequantize(self) -> np.ndarray:
        """Float32 copy (tests, load-time conversions). Never used on the step path."""
        return dequantize_affine(self.codes, self.scales, self.biases, self.bits, self.group_size)


Linear = DenseWeight | AffineWeight


@dataclass(frozen=True, slots=True)
class LinearParts:
    """Weights that one fused matmul applies (q|k|v, gate|up), kept apart by a backend that
    runs them one by one (the CPU: no copy, the bits of separate matmuls). Output: the parts'
    outputs side by side."""

    parts: tuple[Linear, ...]

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features


# What a fused layer multiplies by: one concatenated weight (CUDA) or its parts (CPU).
FusedLinear = Linear | LinearParts


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., words] uint32 -> [..., words*32/bits] uint8 codes (LSB first)."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    q = (codes[..., None] >> shifts) & mask
    return q.reshape(*codes.shape[:-1], codes.shape[-1] * per_word).astype(np.uint8)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """[..., in] integer codes in [0, 2**bits) -> [..., in*bits/32] uint32 (LSB first)."""
    per_word = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def dequantize_affine(
    codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> np.ndarray:
    q = unpack_codes(codes, bits).astype(np.float32)
    shape = q.shape
    q = q.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    w = q * scales[..., None] + biases[..., None]
    return w.reshape(shape).astype(np.float32)


def quantize_affine(w: np.ndarray, bits: int, group_size: int) -> AffineWeight:
    """Float weight [..., out, in] -> AffineWeight (min/max per group). Used by tests and to
    make random quantized models; any (q, scale, bias) that satisfies the formula loads."""
    w = np.asarray(w, dtype=np.float32)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    levels = (1 << bits) - 1
    scale = np.where(hi > lo, (hi - lo) / levels, 1.0).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, levels)
    q = q.reshape(w.shape).astype(np.uint32)
    return AffineWeight(pack_codes(q, bits), scale, lo.astype(np.float32), bits, group_size)
