"""The Ops protocol: the array operations the model code may call (docs/KERNELS.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from .weights import FusedLinear, Linear

Array = Any  # numpy.ndarray on the CPU, cupy.ndarray on the GPU


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend offers beyond the ops every backend has, declared by the backend
    (callers read these flags; they never probe an ops object for methods)."""

    device_sampling: bool = False  # a DeviceSampler: tokens chosen where the logits are
    # Its index checks cost a host sync each (they read device memory): they are skipped
    # inside `unchecked()`, and a batch without a host copy is checked on the device.
    device_checks: bool = False
    # The runner checks a round's indices once on the packed host copy (check_indices) and
    # runs the forward inside `unchecked()`, where the per-op index checks are skipped (on
    # the GPU each a host sync, on the CPU a kernel call a layer).
    round_checks: bool = False
    cuda_graphs: bool = False  # a GraphOps: decode rounds captured and replayed
    # Kernels compiled per range of a round's row count (tile variants, few-rows paths): the
    # warm-up runs a prompt round of each range (Engine.warm_up), not only the types.
    kernels_by_rows: bool = False


class Ops(Protocol):
    """The array operations the model code calls (docs/KERNELS.md); each has a CPU twin."""

    capabilities: Capabilities

    @property
    def name(self) -> str: ...
    @property
    def xp(self) -> Any: ...

    def unchecked(self) -> AbstractContextManager[None]:
        """Skip the per-op bounds checks of the indices inside the block (the caller checked
        them: the runner, on a round's packed host copy); dtype, layout and shape checks
        still run."""
        ...

    def asarray(self, array: np.ndarray) -> Array: ...
    def to_host(self, array: Array) -> np.ndarray: ...
    def upload_linear(self, w: Linear) -> Linear: ...
    def linear(self, x: Array, w: FusedLinear, bias: Array | None = None) -> Array: ...
    def embed(self, w: Linear, ids: Array) -> Array: ...
    def rms_norm(self, x: Array, w: Array, eps: float) -> Array: ...
    def rope(self, x: Array, positions: Array, inv_freq: Array, mscale: float) -> None: ...
    def silu_mul(self, gate: Array, up: Array) -> Array: ...
    def kv_write(self, kv: Array, layer: int, k: Array, v: Array, slots: Array, kv_scales: Array) -> None: ...
    def attention(self, q: Array, kv: Array, layer: int, kv_scales: Array, block_table: Array,
                  row_seq: Array, row_pos: Array, page_size: int, sm_scale: float) -> Array: ...
    def zero_pages(self, kv: Array, page_ids: Array, page_size: int) -> None: ...
    def moe(self, x: Array, router: Linear, gate: Linear, up: Linear, down: Linear,
            top_k: int, norm_topk_prob: bool, *, gate_up: FusedLinear | None = None) -> Array:
        """Top-k mixture of SwiGLU experts; gate_up: concat_linears([gate, up]) when the
        caller has it (CUDA: one grouped launch for both, the same bits)."""
        ...
    def alloc_kv(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str) -> Array: ...
    def synchronize(self) -> None: ...

    # ---- the decoder's layer ops: CudaOps fuses each into fewer launches with the same bits;
    # the CPU runs the basic ops each stands for (one layer code for both backends)
    def concat_linears(self, ws: list[Linear]) -> tuple[FusedLinear, list[Linear]] | None:
        """ws applied as one weight, and weights equal to each of ws to keep in their place
        (views of the concatenation, or ws themselves); None when ws cannot be fused."""
        ...

    def rms_norm_for(self, x: Array, w: Array, eps: float,
                     linear: FusedLinear | Sequence[FusedLinear]) -> Array:
        """rms_norm(x, w, eps) in the form `linear` multiplies (CUDA: int8 rows for int8-x
        weights; for several linears, stacked experts included, when they all take the same
        form; moe() takes such rows too). x [rows, dim]."""
        ...

    def attn_inputs(self, qkv: Array, q_norm: Array | None, k_norm: Array | None, eps: float,
                    positions: Array, inv_freq: Array, mscale: float, kv: Array, layer: int,
                    slots: Array, kv_scales: Array | None, num_heads: int) -> Array:
        """From q|k|v rows [rows, (nh + 2 nkv) hd]: q [rows, nh, hd] normed (q_norm) and
        roped; k normed (k_norm) and roped, and v, both written at `slots` of `layer`."""
        ...

    def attention_for(self, q: Array, kv: Array, layer: int, kv_scales: Array | None,
                      block_table: Array, row_seq: Array, row_pos: Array, page_size: int,
                      sm_scale: float, linear: Linear) -> Array:
        """attention(...) as the rows [rows, nh * hd] in the form `linear` multiplies."""
        ...

    def linear_into(self, x: Array, w: Linear, out: Array) -> Array:
        """out += x @ w.T in place (a residual); the bits of out + linear(x, w)."""
        ...

    def swiglu_linear(self, x: Array, gate_up: FusedLinear) -> Array:
        """silu(x @ gate.T) * (x @ up.T) for gate_up = concat_linears([gate, up])."""
        ...

    # ---- Gated DeltaNet and gated attention (hybrid models): twins backend/cpu/gdn.py and
    # cuda_kernels/gdn.py; outputs float32, states updated in place
    def causal_conv1d(self, x: Array, conv_states: Array, weight: Array, row_lanes: Array,
                      frozen: Array) -> Array:
        """silu(causal conv) of x [rows, C] -> [rows, C]; conv_states [lanes, K-1, C] carried,
        weight [C, K], row_lanes [rows] int32 (a stream's rows contiguous, in time order);
        frozen [lanes] uint8: those lanes' rows run from a copy, their state stays as it was."""
        ...

    def gdn_qk_l2norm(self, mixed: Array, num_k_heads: int, head_k_dim: int, eps: float,
                      q_scale: float) -> tuple[Array, Array]:
        """L2-normalised q (times q_scale) and k [rows, Hk, dk] from the conv output's [q | k]."""
        ...

    def gdn_gates(self, a: Array, b: Array, a_log: Array, dt_bias: Array) -> tuple[Array, Array]:
        """(g, beta) [rows, Hv] of the delta rule from the a, b projections [rows, Hv]."""
        ...

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array,
                         states: Array, row_lanes: Array, frozen: Array) -> Array:
        """The delta rule over rows of many streams -> o [rows, Hv, dv]; states
        [lanes, Hv, dk, dv] updated, except frozen lanes' (as in causal_conv1d)."""
        ...

    def gated_rms_norm(self, x: Array, z: Array, weight: Array, eps: float) -> Array:
        """weight * rms_norm(x) * silu(z), x and z [rows, Hv, dv]."""
        ...

    def split_query_gate(self, qg: Array, num_heads: int, head_dim: int) -> tuple[Array, Array]:
        """qg [rows, nh*2*hd] (per head [query | gate]) -> q [rows, nh, hd], gate [rows, nh*hd]."""
        ...

    def sigmoid_gate_mul(self, x: Array, gate: Array) -> None:
        """x *= sigmoid(gate) in place, both [rows, width]."""
        ...

    def shared_expert_add(self, h: Array, routed: Array, shared: Array, gate: Array) -> None:
        """h += routed + shared * sigmoid(gate) in place: h, routed, shared [rows, H], gate
        [rows, 1] (the shared expert's gate logit); the bits of sigmoid_gate_mul(shared,
        gate broadcast over H), then h + (routed + shared)."""
        ...


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


class GraphOps(Ops, DeviceSampler, Protocol):
    """An Ops whose rounds can be captured as CUDA graphs (capabilities.cuda_graphs)."""

    device_checks: bool  # False inside unchecked()

    def capture_programmatic(self, stream: Any, record: Callable[[], None]) -> Any | None:
        """The graph of `record()`'s launches on `stream` with programmatic edges between the
        kernels, or None where the device or driver cannot (the caller captures plainly)."""
        ...


def device_sampler(ops: Ops) -> DeviceSampler | None:
    """`ops` itself when it declares that it chooses tokens on the device, else None."""
    return cast(DeviceSampler, ops) if ops.capabilities.device_sampling else None


def checks_indices(ops: Ops) -> bool:
    """Whether a forward on `ops` checks its indices itself now: always where checks are free
    (no device_checks capability), else outside the backend's `unchecked()` (its caller ran
    the same checks on the host)."""
    if not ops.capabilities.device_checks:
        return True
    return bool(cast(GraphOps, ops).device_checks)  # the flag comes with the capability


def graph_ops(ops: Ops) -> GraphOps | None:
    """`ops` itself when it declares CUDA graph capture, else None."""
    return cast(GraphOps, ops) if ops.capabilities.cuda_graphs else None
