"""Communicators between tensor-parallel ranks (docs/TENSOR_PARALLEL.md).

One process drives every rank (single controller): the model code runs a layer's matmuls on
each rank, then calls `all_reduce` on the ranks' partial sums. Two implementations:

- `FakeCommunicator`: all ranks on the CPU in one process; all-reduce sums the partials in
  rank order (rank 0 + rank 1 + ...) in float32, so a TP size's results are deterministic.
- `NcclCommunicator`: one GPU a rank, CuPy's NCCL bindings (`cupy.cuda.nccl`), one
  communicator a device made with `NcclCommunicator.initAll`, the ranks' calls in one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np

from ..errors import BadInputError
from .base import Array, Ops


class Communicator(Protocol):
    """All-reduce between the ranks of one tensor-parallel group."""

    @property
    def size(self) -> int: ...

    def scope(self, rank: int) -> AbstractContextManager[Any]:
        """The context in which rank `rank`'s arrays are made and its work is launched
        (its GPU as the current device; nothing on the CPU)."""
        ...

    def all_reduce(self, buffers: Sequence[Array]) -> None:
        """In place: every rank's buffer (buffers[r], float32, same shape) becomes the sum of
        all of them."""
        ...

    def to_rank(self, rank: int, array: Array) -> Array:
        """`array` (C-contiguous, on any rank) where rank `rank` reads it: the array itself
        when it is already there, else a device-to-device copy on rank's current stream."""
        ...


class FakeCommunicator:
    """All ranks in one process on the CPU; the sum in a fixed order (rank 0 first)."""

    def __init__(self, size: int):
        if size < 1:
            raise BadInputError(f"tensor_parallel must be >= 1, got {size}", param="tensor_parallel")
        self._size = size

    @property
    def size(self) -> int:
        return self._size

    def scope(self, rank: int) -> AbstractContextManager[Any]:
        return nullcontext()

    def to_rank(self, rank: int, array: Array) -> Array:
        return array  # one process, one memory: every rank reads the same array

    def all_reduce(self, buffers: Sequence[Array]) -> None:
        _check_buffers(buffers, self._size)
        total = np.array(buffers[0], dtype=np.float32, copy=True)
        for part in buffers[1:]:
            total += part
        for part in buffers:
            part[...] = total


class NcclCommunicator:
    """One rank a GPU (devices[r]) of this process, through CuPy's NCCL bindings.

    NCCL's sum order is fixed for a given size, topology and algorithm, so results repeat
    run to run on one machine (pin NCCL_ALGO to keep it across machines); it is not the
    fake's rank order, so CPU and GPU TP results are compared with a tolerance."""

    def __init__(self, devices: Sequence[int]):
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self.devices = tuple(devices)
        self._comms = nccl.NcclCommunicator.initAll(list(self.devices))

    @property
    def size(self) -> int:
        return len(self.devices)

    def scope(self, rank: int) -> AbstractContextManager[Any]:
        device: AbstractContextManager[Any] = self._cupy.cuda.Device(self.devices[rank])
        return device

    def to_rank(self, rank: int, array: Array) -> Array:
        device = self.devices[rank]
        if array.device.id == device:
            return array
        cuda = self._cupy.cuda
        with cuda.Device(array.device.id):  # the copy waits for the source's stream
            written = cuda.Event(disable_timing=True)
            written.record(cuda.get_current_stream())
        with self.scope(rank):
            out = self._cupy.empty_like(array)  # on `device`
            stream = cuda.get_current_stream()
            stream.wait_event(written)
            out.data.copy_from_device_async(array.data, array.nbytes, stream)  # a peer copy
        return out

    def all_reduce(self, buffers: Sequence[Array]) -> None:
        _check_buffers(buffers, self.size)
        nccl = self._nccl
        nccl.groupStart()  # one group: the calls of every rank from one thread cannot deadlock
        try:
            for rank, (comm, buf) in enumerate(zip(self._comms, buffers, strict=True)):
                with self.scope(rank):
                    stream = self._cupy.cuda.get_current_stream()
                    comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32,
                                   nccl.NCCL_SUM, stream.ptr)
        finally:
            nccl.groupEnd()


def _check_buffers(buffers: Sequence[Array], size: int) -> None:
    if len(buffers) != size:
        raise ValueError(f"all_reduce: {len(buffers)} buffers for {size} ranks")
    shape = buffers[0].shape
    for buf in buffers:
        if buf.dtype != np.float32 or buf.shape != shape or not buf.flags.c_contiguous:
            raise ValueError(f"all_reduce: buffers must be C-contiguous float32 of one shape; got "
                             f"{buf.dtype} {buf.shape}")


def gpu_count() -> int:
    """GPUs this process sees (0 without CuPy or a driver)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        return 0


def make_group(device: str, size: int) -> tuple[list[Ops], Communicator]:
    """Each rank's ops and their communicator for TP size `size` on `device` ("cpu" or
    "cuda"): the CPU shares one CpuOps between the fake ranks; CUDA makes one CudaOps a GPU.
    Refuses more ranks than GPUs."""
    if device == "cpu":
        from .cpu.ops import CpuOps

        ops = CpuOps()
        return [ops] * size, FakeCommunicator(size)
    available = gpu_count()
    if size > available:
        raise BadInputError(f"tensor_parallel {size} needs {size} GPUs; {available} available",
                            param="tensor_parallel")
    from .cuda_ops import CudaOps

    comm = NcclCommunicator(list(range(size)))
    rank_ops: list[Ops] = []
    for rank in range(size):
        with comm.scope(rank):
            rank_ops.append(CudaOps())
    return rank_ops, comm
