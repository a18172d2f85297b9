"""The DFlash / DFlash2 drafter's own ops behind one interface (docs/DFLASH.md): the grouped
dynamic convolution, block attention over explicit keys, and the greedy candidate selector.
CPU: the NumPy twins (backend/cpu/dflash.py, the bits the forward always had); CUDA: the
Numba kernels of cuda_kernels/dflash.py on the engine's stream (backend/cuda_dflash.py).
Chosen by the Ops' name, once, when the drafter is built."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .base import Array, Ops
from .cpu import dflash as cpu


class DFlashOps(Protocol):
    def grouped_conv(self, x: Array, taps: Array, base: Array, group_size: int) -> Array:
        """x [B, H], taps [B, K, G], base [K, H] -> [B, H] f32."""
        ...

    def block_attention(self, q: Array, keys: Array, values: Array, visible: Array,
                        sm_scale: float) -> Array:
        """q [B, nh, hd], keys/values [T, nkv, hd], visible [B, T] uint8 -> [B, nh, hd]."""
        ...

    def top_k(self, logits: Array, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's top_k (ids [R, k] int64, values [R, k] f32) on the host, larger first,
        ties: lower id first (only these come to the host, not the [R, V] logits)."""
        ...

    def select_greedy(self, logits: Array, projected: Array, predecessor: Array,
                      successor: Array, anchor_id: int, top_k: int) -> np.ndarray:
        """DFlash2's greedy chain over each row's top_k logits -> the path [R] int64 (host)."""
        ...

    def candidates(self, logits: Array, top_k: int) -> tuple[Array, Array]:
        """top_k's ids [R, k] int64 and values [R, k] f32 on the device (no host read: a
        captured graph may hold it)."""
        ...

    def chain(self, ids: Array, values: Array, projected: Array, predecessor: Array,
              successor: Array, anchor_id: int) -> np.ndarray:
        """The greedy chain over candidates (ids, values) on the device -> the path [R] (host):
        select_greedy = candidates, then chain."""
        ...


class CpuDFlashOps:
    def grouped_conv(self, x: np.ndarray, taps: np.ndarray, base: np.ndarray,
                     group_size: int) -> np.ndarray:
        out = np.empty(x.shape, np.float32)
        cpu.grouped_conv(x, np.ascontiguousarray(taps), base, group_size, out)
        return out

    def block_attention(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                        visible: np.ndarray, sm_scale: float) -> np.ndarray:
        out = np.empty(q.shape, np.float32)
        cpu.block_attention(q, keys, values, visible, sm_scale, out)
        return out

    def top_k(self, logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        rows = logits.shape[0]
        ids, values = np.empty((rows, top_k), np.int64), np.empty((rows, top_k), np.float32)
        cpu.topk_rows(logits, top_k, ids, values)
        return ids, values

    def select_greedy(self, logits: np.ndarray, projected: np.ndarray, predecessor: np.ndarray,
                      successor: np.ndarray, anchor_id: int, top_k: int) -> np.ndarray:
        ids, values = self.top_k(logits, top_k)
        return self.chain(ids, values, projected, predecessor, successor, anchor_id)

    def candidates(self, logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.top_k(logits, top_k)

    def chain(self, ids: np.ndarray, values: np.ndarray, projected: np.ndarray,
              predecessor: np.ndarray, successor: np.ndarray, anchor_id: int) -> np.ndarray:
        path = np.empty(ids.shape[0], np.int64)
        cpu.select_chain(ids, values, projected, predecessor, successor, anchor_id, path)
        return path


def make_dflash_ops(ops: Ops) -> DFlashOps:
    if ops.name == "cuda":
        from .cuda_dflash import CudaDFlashOps

        return CudaDFlashOps(ops)
    return CpuDFlashOps()
