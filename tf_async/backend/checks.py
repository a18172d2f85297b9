"""Argument checks shared by the backends (CpuOps, CudaOps): dtype, rank, layout and shape of
the arrays a kernel reads, so that a bad call raises BadInputError (a ValueError) naming the
argument instead of reading or writing out of bounds in compiled code. `xp` is the array
module the backend expects (numpy on the CPU, cupy on the GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BadInputError
from .weights import AffineWeight

KV_DTYPES: dict[str, Any] = {
    "f32": np.float32, "float32": np.float32,
    "bf16": np.uint16, "bfloat16": np.uint16,
    "fp8": np.uint8, "fp8_e4m3": np.uint8, "e4m3": np.uint8,
}


def check_array(array: Any, name: str, dtype: Any, ndim: int | None = None, *,
                xp: Any = np) -> Any:
    """`array` must be a C-contiguous array of module `xp` (of `dtype` unless None, rank `ndim`)."""
    if not isinstance(array, xp.ndarray):
        raise BadInputError(f"{name}: expected a {xp.__name__} array, got {type(array).__name__}")
    if dtype is not None and array.dtype != dtype:
        raise BadInputError(f"{name}: expected dtype {np.dtype(dtype)}, got {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise BadInputError(f"{name}: expected {ndim} dims, got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise BadInputError(f"{name}: must be C-contiguous (use ascontiguousarray)")
    return array


def check_shape(array: Any, name: str, shape: tuple[int, ...]) -> None:
    if tuple(array.shape) != tuple(shape):
        raise BadInputError(f"{name}: expected shape {tuple(shape)}, got {tuple(array.shape)}")


def check_shared_expert_add(h: Any, routed: Any, shared: Any, gate: Any, *, xp: Any = np) -> None:
    """shared_expert_add's arguments: h, routed, shared float32 [rows, H], gate [rows, 1]."""
    for name, array in (("h", h), ("routed", routed), ("shared", shared)):
        check_array(array, f"shared_expert_add {name}", np.float32, 2, xp=xp)
        check_shape(array, f"shared_expert_add {name}", h.shape)
    check_array(gate, "shared_expert_add gate", np.float32, 2, xp=xp)
    check_shape(gate, "shared_expert_add gate", (h.shape[0], 1))


def check_affine(w: AffineWeight, *, xp: Any = np, ndim: int | None = None,
                 whole_words: bool = False) -> None:
    """Codes uint32 (rank `ndim` when given), scales/biases float32 of one group a row's
    group_size columns; `whole_words`: every group also starts on a code word (CUDA)."""
    if w.bits not in (4, 8):
        raise BadInputError(f"AffineWeight: bits must be 4 or 8, got {w.bits}")
    check_array(w.codes, "AffineWeight.codes", np.uint32, ndim, xp=xp)
    groups = w.in_features // w.group_size if w.group_size > 0 else -1
    if (groups <= 0 or groups * w.group_size != w.in_features
            or (whole_words and w.group_size % (32 // w.bits))):
        raise BadInputError(f"AffineWeight: group_size {w.group_size} does not divide in_features "
                            f"{w.in_features}" + (f" in {w.bits}-bit words" if whole_words else ""))
    for name, array in (("scales", w.scales), ("biases", w.biases)):
        check_array(array, f"AffineWeight.{name}", np.float32, w.codes.ndim, xp=xp)
        check_shape(array, f"AffineWeight.{name}", (*w.codes.shape[:-1], groups))


def check_kv(kv: Any, layer: int, *, xp: Any = np) -> Any:
    """kv [layers, 2, slots, kv_heads, head_dim] of float32, uint16 (bf16) or uint8 (fp8)."""
    check_array(kv, "kv", None, 5, xp=xp)
    if kv.dtype not in (np.float32, np.uint16, np.uint8) or kv.shape[1] != 2:
        raise BadInputError("kv: expected [layers, 2, slots, kv_heads, head_dim] of float32, "
                            f"uint16 (bf16) or uint8 (fp8), got {kv.dtype} {kv.shape}")
    if not 0 <= layer < kv.shape[0]:
        raise BadInputError(f"layer {layer} out of range [0, {kv.shape[0]})")
    return kv


def check_kv_dtype(kv_dtype: str) -> Any:
    """The array dtype of a KV dtype name."""
    if kv_dtype not in KV_DTYPES:
        raise BadInputError(f"kv_dtype {kv_dtype!r}: expected one of f32, bf16, fp8")
    return KV_DTYPES[kv_dtype]


def kv_shape(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    shape = (num_layers, 2, num_slots, num_kv_heads, head_dim)
    if min(shape) < 1:
        raise BadInputError(f"alloc_kv: every dimension must be >= 1, got {shape}")
    return shape


def num_pages_of(kv: Any, page_size: int) -> int:
    """Pages of page_size slots in the arena kv (page_size must divide its slots)."""
    if page_size < 1 or kv.shape[2] % page_size != 0:
        raise BadInputError(f"page_size {page_size} does not divide num_slots {kv.shape[2]}")
    return int(kv.shape[2] // page_size)
