"""Pick the array backend for `--device` (auto, cpu, cuda)."""

from __future__ import annotations

from ..errors import BadInputError
from .base import Ops


def cuda_available() -> bool:
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        return False


def resolve_device(device: str) -> str:
    """"cpu" or "cuda": the backend `device` (auto, cpu, cuda) picks."""
    if device not in ("auto", "cpu", "cuda"):
        raise BadInputError(f"unknown device {device!r}: use auto, cpu or cuda", param="device")
    return "cuda" if device == "cuda" or (device == "auto" and cuda_available()) else "cpu"


def make_ops(device: str = "auto") -> Ops:
    if resolve_device(device) == "cuda":
        from .cuda_ops import CudaOps  # raises BadInputError when CUDA is not usable

        return CudaOps()
    from .cpu.ops import CpuOps

    return CpuOps()
