"""Device conversions for the KV dtypes (docs/KERNELS.md, "KV arena layout").

- bf16: uint16 holding the top half of a float32, rounded to nearest even; NaN stays NaN.
- fp8: OCP E4M3FN in a uint8 (bias 7, max 448, 0x7F/0xFF NaN, no inf), round to nearest
  even, saturating to +-448.
"""

from __future__ import annotations

import numpy as np

from cuda_kernels.env import cuda, float_as_int, int_as_float

_TWO_POW_31 = 2147483648
_TWO_POW_32 = 4294967296


@cuda.jit(device=True)
def f32_bits(x):
    """float32 -> its bits as a non-negative int64."""
    return np.int64(float_as_int(np.float32(x))) & 0xFFFFFFFF


@cuda.jit(device=True)
def f32_from_bits(u):
    """Bits in an int64 [0, 2**32) -> float32."""
    if u >= _TWO_POW_31:
        u = u - _TWO_POW_32
    return int_as_float(np.int32(u))


@cuda.jit(device=True)
def to_bf16_bits(x):
    u = f32_bits(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((u >> 16) | 0x40)
    return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)


@cuda.jit(device=True)
def from_bf16_bits(b):
    return f32_from_bits(np.int64(b) << 16)


@cuda.jit(device=True)
def _e4m3_magnitude(a):
    # a: finite, 0 <= a < 464 (values in [448, 464) round to 448 anyway).
    if a < np.float32(0.015625):  # below 2**-6: subnormal step 2**-9
        t = a * np.float32(512.0)
        q = (t + np.float32(12582912.0)) - np.float32(12582912.0)  # round to nearest even
        return np.int64(q)  # 8 means 2**-6, which is code 0x08 as well
    u = f32_bits(a)
    u = u + 0x7FFFF + ((u >> 20) & 1)  # round the 23-bit mantissa to 3 bits, ties to even
    exp = (u >> 23) - 127
    mant = (u >> 20) & 7
    if exp > 8 or (exp == 8 and mant == 7):
        return np.int64(0x7E)
    return ((exp + 7) << 3) | mant


@cuda.jit(device=True)
def to_e4m3(y):
    """float32 (already divided by the scale) -> E4M3FN code."""
    y = np.float32(y)
    if y != y:
        return np.uint8(0x7F)
    sign = np.int64(0)
    if y < 0 or (y == 0 and (f32_bits(y) >> 31) == 1):
        sign = np.int64(0x80)
    a = abs(y)
    if a >= np.float32(464.0):
        return np.uint8(sign | 0x7E)
    return np.uint8(sign | _e4m3_magnitude(a))


@cuda.jit(device=True)
def from_e4m3(c):
    """E4M3FN code -> float32 (not yet multiplied by the scale)."""
    c = np.int64(c)
    exp = (c >> 3) & 15
    mant = c & 7
    if exp == 15 and mant == 7:
        return np.float32(np.nan)
    if exp == 0:
        val = np.float32(mant) / np.float32(512.0)
    else:
        val = np.float32((8 + mant) << exp) / np.float32(1024.0)
    if c & 0x80:
        return -val
    return val
