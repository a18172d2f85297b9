"""CUDA side of backend/dflash_ops.py: CuPy arrays in and out, cuda_kernels/dflash.py inside,
on the engine's stream (CuPy's current stream, as every CudaOps kernel)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Ops


class CudaDFlashOps:
    def __init__(self, ops: Ops):
        from cuda_kernels import dflash
        from cuda_kernels.env import cuda

        self.xp = ops.xp
        self._cuda = cuda
        self._kernels = dflash

    def _dev(self, array: Any) -> Any:
        return self._cuda.as_cuda_array(array, sync=False)

    def _stream(self) -> Any:
        ptr = self.xp.cuda.get_current_stream().ptr
        return self._cuda.external_stream(ptr) if ptr else self._cuda.default_stream()

    def _f32(self, array: Any) -> Any:
        return self.xp.ascontiguousarray(array, dtype=np.float32)

    def grouped_conv(self, x: Any, taps: Any, base: Any, group_size: int) -> Any:
        x, taps, base = self._f32(x), self._f32(taps), self._f32(base)
        out = self.xp.empty(x.shape, np.float32)
        self._kernels.grouped_conv(self._dev(x), self._dev(taps), self._dev(base), int(group_size),
                                   self._dev(out), self._stream())
        return out

    def block_attention(self, q: Any, keys: Any, values: Any, visible: Any, sm_scale: float) -> Any:
        q, keys, values = self._f32(q), self._f32(keys), self._f32(values)
        visible = self.xp.ascontiguousarray(visible, dtype=np.uint8)
        scratch = self.xp.empty((q.shape[0], q.shape[1], keys.shape[0]), np.float32)
        out = self.xp.empty(q.shape, np.float32)
        self._kernels.block_attention(self._dev(q), self._dev(keys), self._dev(values),
                                      self._dev(visible), float(sm_scale), self._dev(scratch),
                                      self._dev(out), self._stream())
        return out

    def _top_k(self, logits: Any, top_k: int, stream: Any) -> tuple[Any, Any]:
        rows = logits.shape[0]
        ids = self.xp.empty((rows, top_k), np.int64)
        values = self.xp.empty((rows, top_k), np.float32)
        scratch = None
        if self._kernels.SPLIT_TOPK:
            shape = (rows, self._kernels.topk_segments(int(logits.shape[1]))[0], top_k)
            scratch = (self._dev(self.xp.empty(shape, np.int64)),
                       self._dev(self.xp.empty(shape, np.float32)))
        self._kernels.topk_rows(self._dev(self._f32(logits)), int(top_k), self._dev(ids),
                                self._dev(values), stream, scratch)
        return ids, values

    def top_k(self, logits: Any, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        ids, values = self._top_k(logits, top_k, self._stream())
        return self.xp.asnumpy(ids), self.xp.asnumpy(values)

    def select_greedy(self, logits: Any, projected: Any, predecessor: Any, successor: Any,
                      anchor_id: int, top_k: int) -> np.ndarray:
        """Top-k and the chain on the device: only the path [R] comes to the host."""
        ids, values = self.candidates(logits, top_k)
        return self.chain(ids, values, projected, predecessor, successor, anchor_id)

    def candidates(self, logits: Any, top_k: int) -> tuple[Any, Any]:
        return self._top_k(logits, top_k, self._stream())

    def chain(self, ids: Any, values: Any, projected: Any, predecessor: Any, successor: Any,
              anchor_id: int) -> np.ndarray:
        path = self.xp.empty(ids.shape[0], np.int64)
        self._kernels.select_chain(self._dev(ids), self._dev(values), self._dev(self._f32(projected)),
                                   self._dev(predecessor), self._dev(successor), int(anchor_id),
                                   self._dev(path), self._stream())
        return self.xp.asnumpy(path)
