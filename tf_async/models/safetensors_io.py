"""A small safetensors reader on NumPy memory maps (no torch, no safetensors package).

Layout: u64 little-endian header length N, N bytes of JSON, then the tensor bytes. Each
header entry is `{"dtype", "shape", "data_offsets": [begin, end]}` relative to byte 8 + N.
BF16 is returned as float32 (bits << 16); other dtypes keep their NumPy dtype.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError

# safetensors dtype name -> little-endian NumPy dtype of the stored bytes
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
}
MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One header entry; `begin`/`end` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _fail(path: Path | str, message: str) -> ModelFormatError:
    return ModelFormatError(f"{path}: {message}")


def _read_header_json(path: Path) -> tuple[dict, int, int]:
    """Return (header dict, data start offset, file size)."""
    try:
        file_bytes = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated safetensors file ({file_bytes} bytes, no header)")
            header_bytes = int.from_bytes(prefix, "little")
            if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > file_bytes:
                raise _fail(path, f"truncated safetensors file: header length {header_bytes} "
                                  f"does not fit in {file_bytes} bytes")
            raw = f.read(header_bytes)
    except OSError as exc:
        raise _fail(path, f"cannot read safetensors file: {exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"corrupt safetensors header (bad JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise _fail(path, "corrupt safetensors header (not a JSON object)")
    return header, 8 + header_bytes, file_bytes


def _parse_entry(path: Path, name: str, entry: object, data_start: int, file_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _fail(path, f"tensor {name!r}: header entry is not an object")
    dtype = entry.get("dtype")
    if dtype not in DTYPES:
        raise _fail(path, f"tensor {name!r}: unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r}: bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)):
        raise _fail(path, f"tensor {name!r}: bad data_offsets {offsets!r}")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if offsets[0] < 0 or begin > end:
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets} out of range")
    if end > file_bytes:
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets} end past the end of the file "
                          f"(truncated file? data has {file_bytes - data_start} bytes)")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise _fail(path, f"tensor {name!r}: {end - begin} bytes but shape {shape} of {dtype} "
                          f"needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and validate the header of a safetensors file: tensor name -> TensorInfo.

    Raises ModelFormatError (naming the file and tensor) for a truncated file, bad JSON,
    offsets out of range, a size that does not match the shape, or an unknown dtype.
    """
    path = Path(path)
    header, data_start, file_bytes = _read_header_json(path)
    return {
        name: _parse_entry(path, name, entry, data_start, file_bytes)
        for name, entry in header.items()
        if name != "__metadata__"
    }


class SafetensorsFile:
    """A memory-mapped safetensors file. `get(name)` returns an array backed by the map
    (copy-on-write, so arrays are writable without touching the file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors = read_safetensors_header(self.path)
        self._map: np.ndarray | None = None

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _bytes(self) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        return self._map

    def get(self, name: str) -> np.ndarray:
        """The tensor as an array of its dtype (BF16 widened to float32)."""
        info = self.tensors.get(name)
        if info is None:
            raise _fail(self.path, f"missing tensor {name!r}")
        stored = DTYPES[info.dtype]
        if info.end == info.begin:
            return np.zeros(info.shape, np.float32 if info.dtype == "BF16" else stored)
        raw = np.asarray(self._bytes()[info.begin:info.end])
        if info.begin % stored.itemsize:
            raw = raw.copy()  # unaligned in the file: copy into an aligned buffer first
        arr = raw.view(stored).reshape(info.shape)
        if info.dtype == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a file by name (memory-mapped where aligned)."""
    st = SafetensorsFile(path)
    return {name: st.get(name) for name in st.names()}
