"""The Ops protocol: the array operations the model code may call (docs/KERNELS.md)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .weights import Linear

Array = Any  # numpy.ndarray on the CPU, cupy.ndarray on the GPU


class Ops(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def xp(self) -> Any: ...

    def asarray(self, array: np.ndarray) -> Array: ...
    def to_host(self, array: Array) -> np.ndarray: ...
    def upload_linear(self, w: Linear) -> Linear: ...
    def linear(self, x: Array, w: Linear, bias: Array | None = None) -> Array: ...
    def embed(self, w: Linear, ids: Array) -> Array: ...
    def rms_norm(self, x: Array, w: Array, eps: float) -> Array: ...
    def rope(self, x: Array, positions: Array, inv_freq: Array, mscale: float) -> None: ...
    def silu_mul(self, gate: Array, up: Array) -> Array: ...
    def kv_write(self, kv: Array, layer: int, k: Array, v: Array, slots: Array, kv_scales: Array) -> None: ...
    def attention(self, q: Array, kv: Array, layer: int, kv_scales: Array, block_table: Array,
                  row_seq: Array, row_pos: Array, page_size: int, sm_scale: float) -> Array: ...
    def zero_pages(self, kv: Array, page_ids: Array, page_size: int) -> None: ...
    def moe(self, x: Array, router: Linear, gate: Linear, up: Linear, down: Linear,
            top_k: int, norm_topk_prob: bool) -> Array: ...
    def alloc_kv(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str) -> Array: ...
    def synchronize(self) -> None: ...


class DeviceSampler(Protocol):
    """Optional Ops capability: choose tokens where the logits are, so that only token ids
    travel to the host (the CUDA backend; cuda_kernels/sampling.py has the semantics).
    Backends without it (the CPU) keep the host sampler, engine/sampling.py."""

    def argmax(self, logits: Array) -> Array:
        """logits [rows, V] float32 -> [rows] int64: the largest logit, ties: lowest id."""
        ...

    def sample(self, logits: Array, temperatures: Array, top_ks: Array, top_ps: Array,
               seeds: Array, positions: Array) -> Array:
        """Seeded top-k/top-p token per row, randomness from (seed, position) only;
        temperature <= 0 is argmax. temperatures, top_ps float32; top_ks int32; seeds
        uint64; positions int64, all [rows] on the device -> [rows] int64."""
        ...


def device_sampler(ops: Any) -> DeviceSampler | None:
    """`ops` itself when it chooses tokens on the device (has `argmax` and `sample`), else
    None. An Ops may opt out with `chooses_tokens = False` (e.g. one that has the kernels
    only as twins for tests)."""
    if not getattr(ops, "chooses_tokens", True):
        return None
    if callable(getattr(ops, "argmax", None)) and callable(getattr(ops, "sample", None)):
        return ops  # type: ignore[no-any-return]
    return None
