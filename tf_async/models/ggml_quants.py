"""ggml tensor blocks -> our weight kinds (FORMATS.md §7, §10). Load time only, vectorised NumPy.

Input is one tensor as gguf's GGUFReader hands it out: float types as float arrays, everything
else as uint8 `[..., rows, bytes_per_row]` (NumPy shape = reversed GGUF dims, blocks run along
the last axis). Quantized types become `AffineWeight`s whose `dequantize()` equals
`gguf.quants.dequantize` up to float32 rounding:

| ggml | bits | group | code q | scale | bias |
|---|---|---|---|---|---|
| Q8_0 | 8 | 32 | int8 + 128 | d | -128 d |
| Q4_0 | 4 | 32 | nibble | d | -8 d |
| Q4_1 | 4 | 32 | nibble | d | m |
| Q4_K | 4 | 32 | nibble | d sc_s | -dmin m_s |
| Q5_K | 8 | 32 | 0..31 | d sc_s | -dmin m_s |
| Q6_K | 8 | 16 | 0..63 | d sc_s | -32 d sc_s |
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..backend.weights import AffineWeight, DenseWeight, Linear
from ..errors import ModelFormatError

QType = GGMLQuantizationType
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)

# One block converter: blocks [N, type_size] uint8 -> (code bytes [N, k], scales [N, g], biases [N, g]).
BlockFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian f16 at byte `offset` of every block, as float32 [N]."""
    return blocks[:, offset : offset + 2].view("<f2")[:, 0].astype(np.float32)


def _pack_nibbles(vals: np.ndarray) -> np.ndarray:
    """[N, 2k] codes < 16 in element order -> [N, k] bytes, element 2i in the low nibble."""
    return vals[:, 0::2] | (vals[:, 1::2] << 4)


def _ggml_q4_block_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 qs [N, 16] (low nibbles = elements 0..15, high = 16..31) -> our 16 bytes,
    byte k = elements 2k | 2k+1 << 4: bytes 0..7 from low nibbles, 8..15 from high ones."""
    even, odd = qs[:, 0::2], qs[:, 1::2]
    out = np.empty_like(qs)
    out[:, :8] = (even & 0xF) | (odd << 4)
    out[:, 8:] = (even >> 4) | (odd & 0xF0)
    return out


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)[:, None]
    codes = blocks[:, 2:34] ^ np.uint8(0x80)  # int8 + 128, as bytes
    return codes, d, -128.0 * d


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)[:, None]
    return _ggml_q4_block_codes(blocks[:, 2:18]), d, -8.0 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)[:, None]
    m = _f16(blocks, 2)[:, None]
    return _ggml_q4_block_codes(blocks[:, 4:20]), d, m


def kquant_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 scale bytes [N, 12] -> 6-bit (scale, min) per sub-block, each [N, 8]."""
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale, mins


def _kquant_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
    scale, mins = kquant_scale_min(blocks[:, 4:16])
    return d * scale.astype(np.float32), -(dmin * mins.astype(np.float32))


def _kquant_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [N, 128] -> 4-bit values [N, 256] in element order: byte 32c+l holds element
    64c+l (low nibble) and 64c+32+l (high nibble)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _kquant_affine(blocks)
    return _pack_nibbles(_kquant_nibbles(blocks[:, 16:144])), scales, biases


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _kquant_affine(blocks)
    qh = blocks[:, 16:48]  # bit s of qh[l] is the high bit of sub-block s, element l
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    high = ((qh[:, None, :] >> shifts) & 1).reshape(-1, 256)
    return _kquant_nibbles(blocks[:, 48:176]) | (high << 4), scales, biases


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Two halves of 128; element 128n + 32k + l takes ql nibble k//2 of byte 64n + 32(k%2) + l
    # and bits 2k..2k+1 of qh[32n + l].
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 2, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    codes = (low | (high << 4)).reshape(-1, 256)
    d = _f16(blocks, 208)[:, None]
    scales = d * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return codes, scales, -32.0 * scales


# ggml type -> (block converter, bits, group_size)
_AFFINE: dict[QType, tuple[BlockFn, int, int]] = {
    QType.Q8_0: (_q8_0, 8, 32),
    QType.Q4_0: (_q4_0, 4, 32),
    QType.Q4_1: (_q4_1, 4, 32),
    QType.Q4_K: (_q4_k, 4, 32),
    QType.Q5_K: (_q5_k, 8, 32),
    QType.Q6_K: (_q6_k, 8, 16),
}
SUPPORTED_TYPES = (*FLOAT_TYPES, *_AFFINE)


def _unsupported(qtype: QType, name: str, source: str) -> ModelFormatError:
    names = ", ".join(t.name for t in SUPPORTED_TYPES)
    return ModelFormatError(
        f"{source}: tensor {name!r} has ggml type {qtype.name}, which is not supported "
        f"(supported: {names})"
    )


def affine_from_blocks(raw: np.ndarray, qtype: QType, *, name: str = "?", source: str = "gguf") -> AffineWeight:
    """uint8 `[..., rows, bytes_per_row]` blocks of a quantized type -> AffineWeight `[..., rows, in]`."""
    if qtype not in _AFFINE:
        raise _unsupported(qtype, name, source)
    convert, bits, group_size = _AFFINE[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    if raw.dtype != np.uint8 or row_bytes % type_size:
        raise ModelFormatError(f"{source}: tensor {name!r}: {row_bytes} bytes per row is not a whole "
                               f"number of {qtype.name} blocks ({type_size} bytes)")
    num_in = row_bytes // type_size * block_size
    codes, scales, biases = convert(np.ascontiguousarray(raw).reshape(-1, type_size))
    codes = np.ascontiguousarray(codes).reshape(*lead, num_in * bits // 8).view("<u4")
    return AffineWeight(
        codes=codes.astype(np.uint32, copy=False),
        scales=scales.reshape(*lead, num_in // group_size).astype(np.float32, copy=False),
        biases=biases.reshape(*lead, num_in // group_size).astype(np.float32, copy=False),
        bits=bits,
        group_size=group_size,
    )


def float_array(raw: np.ndarray, qtype: QType, *, name: str = "?", source: str = "gguf") -> np.ndarray:
    """F32/F16/BF16 tensor -> float32 array (F32 is returned without a copy)."""
    if qtype == QType.F32:
        return np.asarray(raw, dtype=np.float32)
    if qtype == QType.F16:
        return np.asarray(raw).view("<f2").astype(np.float32)
    if qtype == QType.BF16:  # reader gives BF16 as bytes; bf16 is the upper half of an f32
        halves = np.ascontiguousarray(raw).view("<u2")
        return (halves.astype(np.uint32) << 16).view(np.float32)
    raise _unsupported(qtype, name, source)


def to_linear(raw: np.ndarray, qtype: QType, *, name: str = "?", source: str = "gguf") -> Linear:
    """A 2-D (or stacked 3-D) GGUF tensor -> DenseWeight (float types) or AffineWeight."""
    if qtype in FLOAT_TYPES:
        return DenseWeight(float_array(raw, qtype, name=name, source=source))
    return affine_from_blocks(raw, qtype, name=name, source=source)


def convert_tensor(
    raw: np.ndarray, qtype: QType, *, name: str = "?", source: str = "gguf"
) -> Linear | np.ndarray:
    """Any GGUF tensor: 1-D float tensors become plain float32 arrays, others `to_linear`."""
    if raw.ndim == 1 and qtype in FLOAT_TYPES:
        return float_array(raw, qtype, name=name, source=source)
    return to_linear(raw, qtype, name=name, source=source)
