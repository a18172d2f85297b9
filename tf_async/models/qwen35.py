"""Qwen3.5 / Qwen3.6 hybrids (`qwen3_5` dense, `qwen3_5_moe`): Gated DeltaNet layers and gated
full-attention layers (MODELS.md section 5, docs/QWEN35.md).

`HybridDecoder.forward(batch, kv, kv_scales)` has the Decoder's signature. The decoder holds
weights only; each stream's recurrent state (conv + delta rule per GDN layer) lives in a
`RecurrentStates` store indexed by lane (`batch.seq_lanes[batch.row_seq[r]]`), allocated once
for all lanes by the engine and attached to the decoder (or passed to `forward`).

KV layers: only full-attention layers have K/V. `HybridConfig.kv_config` (also the
checkpoint's and the decoder's `config`) is a ModelConfig whose `num_layers` counts those
layers, so an arena sized from `decoder.config` holds exactly them; trunk layer ℓ of kind
full_attention uses arena layer `kv_layer_of[ℓ]`. The trunk's layer count is
`HybridConfig.num_trunk_layers`.

Every op is batch-invariant and the GDN kernels run the exact per-token recurrence, so a
row's logits never depend on how its prompt was cut into steps or on the other streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..backend.base import Array, Ops, checks_indices
from ..backend.weights import DenseWeight, FusedLinear, Linear
from .batch_io import ForwardBatch, captured_rows, hidden_rows, packed_of
from .config import ModelConfig
from .rope import rope_tables

HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
L2_EPS = 1e-6  # HF l2norm eps of the GDN q/k


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """The hybrid-specific part of the config; `kv_config` is what the engine sizes KV by."""

    kv_config: ModelConfig  # num_layers = number of full-attention (KV) layers
    layer_types: tuple[str, ...]  # per trunk layer: linear_attention | full_attention
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_conv_kernel_dim: int  # K
    shared_expert_intermediate_size: int = 0  # Is (MoE)
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    @property
    def num_trunk_layers(self) -> int:
        return len(self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.kv_config.num_experts > 0

    @property
    def conv_channels(self) -> int:
        """C = 2*Hk*dk + Hv*dv (in_proj_qkv rows, order [q | k | v])."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def state_index(self, layer: int) -> int:
        """GDN state index (recurrent store) or KV layer index (arena) of trunk `layer`."""
        kind = self.layer_types[layer]
        return self.layer_types[:layer].count(kind)


# ---------------------------------------------------------------------------------------
# weights (loaded by hf_qwen35.py; norms already in the N1 form the kernels apply)


@dataclass(slots=True)
class GatedAttentionWeights:
    q: Linear  # [2*nh*hd, H], per head [query | gate]
    k: Linear  # [nkv*hd, H]
    v: Linear  # [nkv*hd, H]
    o: Linear  # [H, nh*hd]
    q_norm: Array  # [hd] (1 + w folded)
    k_norm: Array  # [hd]
    qkv: FusedLinear | None = None  # [q; k; v] on the device (HybridDecoder: one launch)


@dataclass(slots=True)
class DeltaNetWeights:
    in_qkv: Linear  # [C, H]
    in_z: Linear  # [Hv*dv, H]
    in_b: Linear  # [Hv, H]
    in_a: Linear  # [Hv, H]
    conv: Array  # [C, K] float32
    a_log: Array  # [Hv] float32
    dt_bias: Array  # [Hv] float32
    norm: Array  # [dv] plain weight (N3, never shifted)
    out: Linear  # [H, Hv*dv]
    in_proj: FusedLinear | None = None  # [in_qkv; in_z; in_a; in_b] (HybridDecoder: one launch)


@dataclass(slots=True)
class DenseFfnWeights:
    gate: Linear  # SwiGLU [I, H]
    up: Linear  # [I, H]
    down: Linear  # [H, I]
    gate_up: FusedLinear | None = None  # [gate; up] on the device (HybridDecoder: one launch)


@dataclass(slots=True)
class MoeFfnWeights:
    router: Linear  # [E, H]
    experts_gate: Linear  # stacked [E, Im, H]
    experts_up: Linear  # stacked [E, Im, H]
    experts_down: Linear  # stacked [E, H, Im]
    shared_gate: Linear  # [Is, H]
    shared_up: Linear  # [Is, H]
    shared_down: Linear  # [H, Is]
    shared_expert_gate: Linear  # [1, H]
    shared_gate_up: FusedLinear | None = None  # [shared_gate; shared_up] (one launch)
    experts_gate_up: FusedLinear | None = None  # stacked [E, 2 Im, H]: each expert's [gate; up]


FfnWeights = DenseFfnWeights | MoeFfnWeights


@dataclass(slots=True)
class HybridLayerWeights:
    kind: str  # linear_attention | full_attention
    input_norm: Array  # [H]
    post_norm: Array  # [H]
    mixer: GatedAttentionWeights | DeltaNetWeights
    ffn: FfnWeights


@dataclass(slots=True)
class MtpWeights:
    fc: Linear  # [H, 2H], input [norm(embed) | norm(hidden)]
    pre_fc_norm_embedding: Array  # [H]
    pre_fc_norm_hidden: Array  # [H]
    norm: Array  # [H]
    layer: HybridLayerWeights  # one full-attention layer


@dataclass(slots=True)
class HybridWeights:
    hybrid: HybridConfig
    embed: Linear  # [V, H]
    lm_head: Linear  # [V, H]; the embed object when tied
    final_norm: Array  # [H]
    layers: list[HybridLayerWeights]
    mtp: MtpWeights | None = None  # None when the files ship no mtp.* tensors
    mtp_status: str = "not declared"  # "present", or why `mtp` is None (checkpoint.meta["mtp"])
    rope_freq_divisors: Array | None = None


def upload_tree(value: Any, ops: Ops, cache: dict[int, Any]) -> Any:
    """Move every array / Linear of a weights dataclass tree to the ops' device once."""
    if value is None or isinstance(value, str | HybridConfig):
        return value
    if id(value) in cache:  # tied embeddings stay one object
        return cache[id(value)]
    if isinstance(value, np.ndarray):
        out = ops.asarray(value)
    elif isinstance(value, list):
        out = [upload_tree(v, ops, cache) for v in value]
    elif isinstance(value, _WEIGHT_TYPES):
        out = replace(value, **{f.name: upload_tree(getattr(value, f.name), ops, cache)
                                for f in fields(value)})  # type: ignore[type-var]
    else:
        out = _upload_linear(value, ops)
    cache[id(value)] = out
    return out


def _upload_linear(w: Linear, ops: Ops) -> Linear:
    stacked = (w.w if isinstance(w, DenseWeight) else w.codes).ndim == 3
    if stacked and ops.name == "cpu":
        for expert in range(_num_experts(w)):
            ops.upload_linear(w.expert(expert))  # CpuOps checks 2-D weights; host arrays stay
        return w
    return ops.upload_linear(w)


def _num_experts(w: Linear) -> int:
    return int((w.w if isinstance(w, DenseWeight) else w.codes).shape[0])


_WEIGHT_TYPES = (GatedAttentionWeights, DeltaNetWeights, DenseFfnWeights, MoeFfnWeights,
                 HybridLayerWeights, MtpWeights, HybridWeights)


# ---------------------------------------------------------------------------------------
# per-lane recurrent state


PLAN_ROWS = 256  # batch rows the stash plan buffer holds before it grows


class StashPlan(NamedTuple):
    """Where each row of a forward goes in the stash (int64 device arrays, one entry a batch
    row: views of RecurrentStates.plan_buffer, so a captured graph reads the round's plan)."""

    lanes: Array  # the row's lane; rows not stashed go to the discard lane (num_lanes)
    positions: Array  # its place among the lane's stashed rows (0 for discarded rows)


@dataclass(frozen=True, slots=True)
class StateLayout:
    num_gdn_layers: int
    num_lanes: int
    conv_shape: tuple[int, int]  # [K-1, C] per lane and layer
    delta_shape: tuple[int, int, int]  # [Hv, dk, dv]

    @property
    def bytes_per_lane(self) -> int:
        return 4 * self.num_gdn_layers * (math.prod(self.conv_shape) + math.prod(self.delta_shape))

    @property
    def stash_width(self) -> int:
        """Floats a verify row stashes a GDN layer: its pre-conv row (C), g and beta (Hv each)."""
        return self.conv_shape[1] + 2 * self.delta_shape[0]

    @property
    def stash_bytes_per_row(self) -> int:
        return 4 * self.num_gdn_layers * self.stash_width


class LaneStates(Protocol):
    """What the engine calls on a hybrid's per-lane recurrent state: a RecurrentStates, or
    one a tensor-parallel rank behind one object (tp_hybrid.ShardedStates)."""

    @property
    def num_lanes(self) -> int: ...
    @property
    def bytes_per_lane(self) -> int: ...
    @property
    def stash_bytes_per_lane(self) -> int: ...
    @property
    def num_bytes(self) -> int: ...
    @property
    def num_prefix_slots(self) -> int: ...

    def zero(self, lane: int) -> None: ...
    def freeze(self, lanes: tuple[int, ...]) -> None: ...
    def plan_stash(self, runs: list[tuple[int, int, int]], num_rows: int) -> None: ...
    def add_prefix_slots(self, num_slots: int) -> None: ...
    def keep(self, lane: int, slot: int) -> None: ...
    def resume(self, slot: int, lane: int) -> None: ...


class RecurrentStates:
    """Conv and delta-rule state of every GDN layer for every lane, float32 on the ops' device:

        conv  [gdn_layers, lanes, K-1, C]      delta [gdn_layers, lanes, Hv, dk, dv]

    Allocated once; `zero(lane)` when a lane opens (a stream starts from zero state).

    Draft verification keeps no copy of a lane's state (docs/QWEN35.md section 5): the lanes
    that verify drafts are `frozen` for the round (the GDN kernels run their rows from a copy
    held in the kernel and leave the stored state as it was), and each GDN layer stashes those
    rows' pre-conv inputs and gates (`stash`: [gdn_layers, lanes, rows, C + 2 Hv], a few rows a
    lane); once the scheduler knows how many rows were accepted, `HybridDecoder.commit_states`
    advances the state over exactly those rows from the stash."""

    def __init__(self, hybrid: HybridConfig, num_lanes: int, xp: Any = np):
        if num_lanes < 1:
            raise ValueError(f"RecurrentStates: num_lanes must be >= 1, got {num_lanes}")
        kernel = hybrid.linear_conv_kernel_dim
        self.layout = StateLayout(
            len(hybrid.gdn_layers), num_lanes, (kernel - 1, hybrid.conv_channels),
            (hybrid.linear_num_value_heads, hybrid.linear_key_head_dim,
             hybrid.linear_value_head_dim))
        self.xp = xp
        self.conv = self._zeros(self.layout.conv_shape)
        self.delta = self._zeros(self.layout.delta_shape)
        self.frozen = xp.zeros(num_lanes, dtype=np.uint8)  # lanes verifying drafts this round
        self._frozen_lanes: tuple[int, ...] = ()
        self.stash_width = self.layout.stash_width
        self.stash_rows = 0  # rows a lane the stash holds (grown to the longest verify run)
        self.stashed: Array = self._stash_zeros(0)
        self.stash_plan: StashPlan | None = None  # this forward's rows to stash
        self.plan_buffer: Array = xp.zeros((2, PLAN_ROWS), np.int64)  # the plan's home
        self.kept_conv: Array | None = None  # prefix-cache slots (add_prefix_slots)
        self.kept_delta: Array | None = None

    def _zeros(self, per_lane: tuple[int, ...]) -> Array:
        shape = (self.layout.num_gdn_layers, self.layout.num_lanes, *per_lane)
        return self.xp.zeros(shape, dtype=np.float32)

    def _stash_zeros(self, rows: int) -> Array:
        """[gdn_layers, lanes + 1, rows, width]: the last lane takes the rows not stashed."""
        shape = (self.layout.num_gdn_layers, self.layout.num_lanes + 1, rows, self.stash_width)
        return self.xp.zeros(shape, dtype=np.float32)

    @property
    def num_lanes(self) -> int:
        return self.layout.num_lanes

    @property
    def bytes_per_lane(self) -> int:
        """Live state of one lane (conv + delta, all GDN layers)."""
        return self.layout.bytes_per_lane

    @property
    def stash_bytes_per_lane(self) -> int:
        """The verify stash a lane holds now (rows of its longest verify run so far)."""
        return self.stash_rows * self.layout.stash_bytes_per_row

    @property
    def num_bytes(self) -> int:
        """Everything allocated: live state and the verify stash of every lane (and of the
        discard lane)."""
        return self.num_lanes * self.bytes_per_lane + (self.num_lanes + 1) * self.stash_bytes_per_lane

    def zero(self, lane: int) -> None:
        """A lane opens: its stream starts from zero conv and delta state."""
        self._check_lanes([lane])
        self.conv[:, lane] = 0
        self.delta[:, lane] = 0

    def freeze(self, lanes: tuple[int, ...]) -> None:
        """The lanes whose rows this round verify drafts (all others: not frozen)."""
        lanes = tuple(sorted(lanes))
        if lanes == self._frozen_lanes:
            return
        self._check_lanes(lanes)
        flags = np.zeros(self.num_lanes, np.uint8)
        flags[list(lanes)] = 1
        self.frozen[...] = self.xp.asarray(flags)
        self._frozen_lanes = lanes

    def plan_stash(self, runs: list[tuple[int, int, int]], num_rows: int) -> None:
        """The next forward's frozen rows, (lane, first row in the batch, rows) each, in a batch
        of `num_rows` rows: every GDN layer stashes them at [layer, lane, 0..rows), the other
        rows in the discard lane. Grows the stash when a run is longer than any before (pending
        commits have run by then: it holds nothing yet)."""
        if not runs:
            self.stash_plan = None
            return
        self._check_lanes([lane for lane, _, _ in runs])
        if any(first < 0 or count < 1 or first + count > num_rows for _, first, count in runs):
            raise ValueError(f"RecurrentStates: stash runs {runs} outside a batch of {num_rows} rows")
        longest = max(count for _, _, count in runs)
        if longest > self.stash_rows:
            self.stash_rows = longest
            self.stashed = self._stash_zeros(longest)
        plan = np.zeros((2, num_rows), np.int64)
        plan[0] = self.num_lanes  # the discard lane
        for lane, first, count in runs:
            plan[0, first:first + count] = lane
            plan[1, first:first + count] = np.arange(count)
        if num_rows > self.plan_buffer.shape[1]:
            self.plan_buffer = self.xp.zeros((2, max(num_rows, 2 * self.plan_buffer.shape[1])),
                                             np.int64)
        self.plan_buffer[:, :num_rows] = self.xp.asarray(plan)
        self.stash_plan = StashPlan(self.plan_buffer[0, :num_rows], self.plan_buffer[1, :num_rows])

    def stash(self, slot: int, qkv: Array, g: Array, beta: Array) -> None:
        """GDN layer `slot` of a forward: every row's pre-conv input and gates, at its planned
        place (frozen rows) or in the discard lane (the others)."""
        plan = self.stash_plan
        if plan is None:
            return
        width = qkv.shape[1]
        heads = g.shape[1]
        dst = self.stashed[slot]
        dst[plan.lanes, plan.positions, :width] = qkv
        dst[plan.lanes, plan.positions, width:width + heads] = g
        dst[plan.lanes, plan.positions, width + heads:] = beta

    def graph_inputs(self) -> tuple[Array, ...]:
        """The arrays a captured forward addresses besides the lanes' states: a graph is valid
        while they are these very arrays (the stash and the plan buffer grow by replacement)."""
        return (self.stashed, self.plan_buffer) if self.stash_plan is not None else ()

    # ---- prefix-cache slots: states kept at page boundaries (engine/prefix.StateSlots) ----
    def add_prefix_slots(self, num_slots: int) -> None:
        """Allocate `num_slots` kept states (once, at start) for resumed streams."""
        self.kept_conv = self.xp.zeros((self.layout.num_gdn_layers, num_slots,
                                        *self.layout.conv_shape), dtype=np.float32)
        self.kept_delta = self.xp.zeros((self.layout.num_gdn_layers, num_slots,
                                         *self.layout.delta_shape), dtype=np.float32)

    @property
    def num_prefix_slots(self) -> int:
        return 0 if self.kept_conv is None else int(self.kept_conv.shape[1])

    def keep(self, lane: int, slot: int) -> None:
        """Copy the lane's state into prefix slot `slot`."""
        self._check_slot(lane, slot)
        self.kept_conv[:, slot] = self.conv[:, lane]  # type: ignore[index]
        self.kept_delta[:, slot] = self.delta[:, lane]  # type: ignore[index]

    def resume(self, slot: int, lane: int) -> None:
        """Start the lane from the state kept in `slot` (instead of zero)."""
        self._check_slot(lane, slot)
        self.conv[:, lane] = self.kept_conv[:, slot]  # type: ignore[index]
        self.delta[:, lane] = self.kept_delta[:, slot]  # type: ignore[index]

    def _check_slot(self, lane: int, slot: int) -> None:
        self._check_lanes([lane])
        if not 0 <= slot < self.num_prefix_slots:
            raise ValueError(f"RecurrentStates: prefix slot {slot} outside [0, {self.num_prefix_slots})")

    def _check_lanes(self, lanes: list[int] | tuple[int, ...]) -> None:
        bad = [lane for lane in lanes if not 0 <= int(lane) < self.num_lanes]
        if bad:
            raise ValueError(f"RecurrentStates: lanes {bad} outside [0, {self.num_lanes})")


# ---------------------------------------------------------------------------------------
# the decoder


class HybridDecoder:
    """Qwen3.5 trunk on an Ops backend. `config` is the KV view (see the module docstring)."""

    def __init__(self, ckpt: Any, ops: Ops, states: RecurrentStates | None = None):
        weights: HybridWeights = ckpt.weights
        self.hybrid = weights.hybrid
        self.config = self.hybrid.kv_config
        self.ops = ops
        self.weights: HybridWeights = upload_tree(weights, ops, {})
        mtp = self.weights.mtp
        for layer in [*self.weights.layers, *([mtp.layer] if mtp is not None else [])]:
            _fuse_gate_up(layer.ffn, ops)
            _fuse_inputs(layer.mixer, ops)
        inv_freq, self.mscale = rope_tables(self.config, None)
        self.inv_freq = ops.asarray(inv_freq)
        self.sm_scale = 1.0 / math.sqrt(self.config.head_dim)
        self.states = states

    def new_states(self, num_lanes: int) -> RecurrentStates:
        """A zeroed store for `num_lanes` lanes on this decoder's device."""
        return RecurrentStates(self.hybrid, num_lanes, self.ops.xp)

    def attach_states(self, states: RecurrentStates) -> None:
        self.states = states

    def forward(self, batch: ForwardBatch, kv: Array, kv_scales: Array, *,
                states: RecurrentStates | None = None, all_hidden: bool = False
                ) -> tuple[Array, Array]:
        """Run the rows; return (logits [m, V] of batch.logit_rows, final-normed hidden [m, H]
        of those rows, or of every row when `all_hidden`). Advances the lanes' states."""
        states = states if states is not None else self.states
        if states is None:
            raise ValueError("HybridDecoder.forward: no RecurrentStates attached or passed")
        row_lanes = self.row_lanes(batch, states)
        ops, w = self.ops, self.weights
        h = ops.embed(w.embed, batch.token_ids)
        captured: dict[int, Array] = {}  # batch.capture_layers' outputs
        for index in range(len(w.layers)):  # h += each term in place (the bits of h + term)
            self.mixer_into(index, h, batch, kv, kv_scales, states, row_lanes)
            self.ffn_into(index, h)
            captured_rows(ops, batch, index, h, captured)
        return self.head(h, batch, captured, all_hidden=all_hidden)

    def mixer_term(self, index: int, h: Array, batch: ForwardBatch, kv: Array, kv_scales: Array,
                   states: RecurrentStates, row_lanes: Array) -> Array:
        """Trunk layer `index`'s mixer output [rows, H] (GDN or gated attention, input norm
        included) that joins the residual h; with a rank's weights: its partial sum."""
        layer = self.weights.layers[index]
        a = self.ops.rms_norm(h, layer.input_norm, self.config.rms_norm_eps)
        slot = self.hybrid.state_index(index)
        if isinstance(layer.mixer, DeltaNetWeights):
            return self.deltanet(layer.mixer, a, states, slot, row_lanes)
        return self.attention(layer.mixer, a, batch, kv, slot, kv_scales)

    def mixer_into(self, index: int, h: Array, batch: ForwardBatch, kv: Array, kv_scales: Array,
                   states: RecurrentStates | None, row_lanes: Array | None) -> None:
        """h += mixer_term(...) in place, in fewer launches on CUDA: the input norm written in
        the form the fused input projection multiplies, the output projection adding into h."""
        self.layer_mixer_into(self.weights.layers[index], self.hybrid.state_index(index), h, batch,
                              kv, kv_scales, states, row_lanes)

    def layer_mixer_into(self, layer: HybridLayerWeights, slot: int, h: Array, batch: ForwardBatch,
                         kv: Array, kv_scales: Array, states: RecurrentStates | None,
                         row_lanes: Array | None) -> None:
        """mixer_into for any layer (the MTP head's too): slot = its state or KV layer."""
        ops, mixer = self.ops, layer.mixer
        fused = mixer.in_proj if isinstance(mixer, DeltaNetWeights) else mixer.qkv
        eps = self.config.rms_norm_eps
        a = (ops.rms_norm(h, layer.input_norm, eps) if fused is None
             else ops.rms_norm_for(h, layer.input_norm, eps, fused))
        if isinstance(mixer, DeltaNetWeights):
            assert states is not None and row_lanes is not None, "a GDN layer needs its states"
            ops.linear_into(self.deltanet_rows(mixer, a, states, slot, row_lanes), mixer.out, h)
        else:
            ops.linear_into(self.attention_rows(mixer, a, batch, kv, slot, kv_scales), mixer.o, h)

    def ffn_term(self, index: int, h: Array) -> Array:
        """Trunk layer `index`'s FFN output [rows, H] from the residual h (post norm included)."""
        layer = self.weights.layers[index]
        return self.ffn(layer.ffn, self.ops.rms_norm(h, layer.post_norm, self.config.rms_norm_eps))

    def ffn_into(self, index: int, h: Array) -> None:
        """h += ffn_term(index, h) in place: a dense SwiGLU's down projection adds into h; MoE's
        routed and gated shared outputs join h in one launch on CUDA (shared_expert_add)."""
        self.layer_ffn_into(self.weights.layers[index], h)

    def layer_ffn_into(self, layer: HybridLayerWeights, h: Array) -> None:
        """ffn_into for any layer (the MTP head's too)."""
        ops, eps, w = self.ops, self.config.rms_norm_eps, layer.ffn
        if isinstance(w, DenseFfnWeights):
            x = (ops.rms_norm(h, layer.post_norm, eps) if w.gate_up is None
                 else ops.rms_norm_for(h, layer.post_norm, eps, w.gate_up))
            ops.linear_into(self._swiglu(x, w.gate, w.up, w.gate_up), w.down, h)
            return
        experts = [w.experts_gate, w.experts_up] if w.experts_gate_up is None else [w.experts_gate_up]
        shared = [w.shared_gate, w.shared_up] if w.shared_gate_up is None else [w.shared_gate_up]
        readers = [w.router, *experts, *shared, w.shared_expert_gate]
        x = ops.rms_norm_for(h, layer.post_norm, eps, readers)  # int8 rows when they all take them
        ops.shared_expert_add(h, *self._moe_parts(w, x))

    def head(self, h: Array, batch: ForwardBatch, captured: dict[int, Array], *,
             all_hidden: bool = False) -> tuple[Array, Array]:
        """The final norm and lm_head of the last layer's rows h [rows, H] (forward's result)."""
        ops, w, eps = self.ops, self.weights, self.config.rms_norm_eps
        hidden = ops.rms_norm(h if all_hidden else h[batch.logit_rows], w.final_norm, eps)
        logit_hidden = hidden[batch.logit_rows] if all_hidden else hidden
        return ops.linear(logit_hidden, w.lm_head), (hidden_rows(ops, batch, captured, hidden)
                                                     if all_hidden else hidden)

    def argmax_of(self, logits: Array) -> None:
        return None

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        """Forward with fresh zero states, one lane per block-table row (calibration, tests)."""
        num_seqs = int(batch.block_table.shape[0])
        lanes = self.ops.asarray(np.arange(num_seqs, dtype=np.int32))
        return self.forward(replace(batch, seq_lanes=lanes), kv, kv_scales,
                            states=self.new_states(num_seqs))

    def row_lanes(self, batch: ForwardBatch, states: RecurrentStates, *,
                  check_only: bool = False) -> Array:
        """Lane of each row, int32 [rows]: seq_lanes[row_seq[r]], checked against the store
        (on the packed host copy when there is one; a batch without one is checked on the
        device, except inside ops.unchecked(): a graph's static batch, checked by its caller)."""
        if batch.seq_lanes is None:
            raise ValueError("HybridDecoder.forward: batch.seq_lanes is required (lane of each "
                             "block-table row) to index the recurrent state")
        packed = packed_of(batch)  # the host copy when there is one: no device sync
        if packed is not None or checks_indices(self.ops):
            lanes = (packed.host_views.seq_lanes if packed is not None
                     else self.ops.to_host(batch.seq_lanes))
            if lanes.size and (int(lanes.min()) < 0 or int(lanes.max()) >= states.num_lanes):
                raise ValueError(f"HybridDecoder.forward: seq_lanes {lanes.tolist()} outside "
                                 f"[0, {states.num_lanes})")
        if check_only:
            return None
        xp = self.ops.xp
        return xp.ascontiguousarray(xp.asarray(batch.seq_lanes)[batch.row_seq], dtype=np.int32)

    # ---- mixers -----------------------------------------------------------------------
    def deltanet(self, w: DeltaNetWeights, a: Array, states: RecurrentStates, slot: int,
                 row_lanes: Array) -> Array:
        """One GDN layer (state slot `slot`) over rows of any streams (docs/QWEN35.md section
        4). a: [rows, H]; the lanes' conv and delta states advance, except frozen lanes'
        (whose rows are stashed for `commit_states`)."""
        return self.ops.linear(self.deltanet_rows(w, a, states, slot, row_lanes), w.out)

    def deltanet_rows(self, w: DeltaNetWeights, a: Array, states: RecurrentStates, slot: int,
                      row_lanes: Array) -> Array:
        """deltanet(...) before its output projection: [rows, Hv*dv]. a: the normed rows, in
        the form w.in_proj multiplies when the inputs are fused (rms_norm_for)."""
        hyb, ops = self.hybrid, self.ops
        rows = a.shape[0]
        hv, dv = hyb.linear_num_value_heads, hyb.linear_value_head_dim
        qkv, z, in_a, in_b = self._deltanet_inputs(w, a)
        g, beta = ops.gdn_gates(in_a, in_b, w.a_log, w.dt_bias)
        states.stash(slot, qkv, g, beta)
        o = self._delta_rule(w, qkv, g, beta, states, slot, row_lanes, states.frozen)
        y = ops.gated_rms_norm(o, z.reshape(rows, hv, dv), w.norm, self.config.rms_norm_eps)
        return y.reshape(rows, hv * dv)

    def _deltanet_inputs(self, w: DeltaNetWeights, a: Array) -> list[Array]:
        """The input projections qkv, z, a, b of the normed rows: one matmul when fused."""
        parts = (w.in_qkv, w.in_z, w.in_a, w.in_b)
        if w.in_proj is None:
            return [self.ops.linear(a, p) for p in parts]
        return split_columns(self.ops, self.ops.linear(a, w.in_proj), [p.out_features for p in parts])

    def _delta_rule(self, w: DeltaNetWeights, qkv: Array, g: Array, beta: Array,
                    states: RecurrentStates, slot: int, row_lanes: Array, frozen: Array) -> Array:
        """conv (+ SiLU), L2-normed q/k, the delta rule: o [rows, Hv, dv]."""
        hyb, ops = self.hybrid, self.ops
        hk, hv = hyb.linear_num_key_heads, hyb.linear_num_value_heads
        dk, dv = hyb.linear_key_head_dim, hyb.linear_value_head_dim
        mixed = ops.causal_conv1d(qkv, states.conv[slot], w.conv, row_lanes, frozen)
        q, k = ops.gdn_qk_l2norm(mixed, hk, dk, L2_EPS, dk ** -0.5)
        v = mixed[:, 2 * hk * dk:].reshape(qkv.shape[0], hv, dv)
        return ops.gated_delta_rule(q, k, v, g, beta, states.delta[slot], row_lanes, frozen)

    def commit_states(self, commits: tuple[tuple[int, int], ...],
                      states: RecurrentStates | None = None) -> None:
        """Advance frozen lanes over their accepted rows: (lane, rows) each, the first `rows`
        rows the lane stashed in its last verify forward. The same conv and delta-rule
        operations on the same inputs as a forward of those rows: the state a plain stream
        would have after them."""
        states = states if states is not None else self.states
        if not commits or states is None:
            return
        lanes, positions = commit_indices(commits, states.stash_rows)
        put = self.ops.asarray
        self.commit_rows(put(lanes), put(positions), put(lanes.astype(np.int32)), states)

    def commit_rows(self, lane_ids: Array, positions: Array, row_lanes: Array,
                    states: RecurrentStates) -> tuple[()]:
        """commit_states on device indices: row i is stash row positions[i] of lane
        lane_ids[i] (row_lanes: the same lanes as int32), in order. No host work depends on
        their values (graph_decoder replays it from a graph)."""
        xp, hyb = self.ops.xp, self.hybrid
        thawed = xp.zeros(states.num_lanes, dtype=np.uint8)
        width, heads = hyb.conv_channels, hyb.linear_num_value_heads
        for index, layer in enumerate(self.weights.layers):
            if not isinstance(layer.mixer, DeltaNetWeights):
                continue
            slot = self.hybrid.state_index(index)
            rows = states.stashed[slot][lane_ids, positions]  # [n, C + 2 Hv]
            qkv = xp.ascontiguousarray(rows[:, :width])
            g = xp.ascontiguousarray(rows[:, width:width + heads])
            beta = xp.ascontiguousarray(rows[:, width + heads:])
            self._delta_rule(layer.mixer, qkv, g, beta, states, slot, row_lanes, thawed)
        return ()

    def attention(self, w: GatedAttentionWeights, a: Array, batch: ForwardBatch, kv: Array,
                  kv_layer: int, kv_scales: Array) -> Array:
        """Gated full attention (MODELS.md 5.4) writing K/V into arena layer `kv_layer`."""
        return self.ops.linear(self.attention_rows(w, a, batch, kv, kv_layer, kv_scales), w.o)

    def attention_rows(self, w: GatedAttentionWeights, a: Array, batch: ForwardBatch, kv: Array,
                       kv_layer: int, kv_scales: Array) -> Array:
        """attention(...) before its output projection: the gated rows [rows, nh*hd]. a: the
        normed rows, in the form w.qkv multiplies when q, k, v are fused (rms_norm_for)."""
        ops, cfg = self.ops, self.config
        rows, nh, hd = a.shape[0], cfg.num_heads, cfg.head_dim
        if w.qkv is None:
            qg, k, v = (ops.linear(a, p) for p in (w.q, w.k, w.v))
        else:
            qg, k, v = split_columns(ops, ops.linear(a, w.qkv),
                                     [p.out_features for p in (w.q, w.k, w.v)])
        q, gate = ops.split_query_gate(qg, nh, hd)
        k = k.reshape(rows, cfg.num_kv_heads, hd)
        v = v.reshape(rows, cfg.num_kv_heads, hd)
        q = ops.rms_norm(q, w.q_norm, cfg.rms_norm_eps)
        k = ops.rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        ops.rope(q, batch.positions, self.inv_freq, self.mscale)
        ops.rope(k, batch.positions, self.inv_freq, self.mscale)
        ops.kv_write(kv, kv_layer, k, v, batch.slots, kv_scales)
        o = ops.attention(q, kv, kv_layer, kv_scales, batch.block_table, batch.row_seq,
                          batch.positions, batch.page_size, self.sm_scale).reshape(rows, nh * hd)
        ops.sigmoid_gate_mul(o, gate)
        return o

    def _swiglu(self, x: Array, gate: Linear, up: Linear, gate_up: FusedLinear | None) -> Array:
        """silu(x @ gate.T) * (x @ up.T): one launch when the two are fused (the same bits)."""
        ops = self.ops
        if gate_up is not None:
            return ops.swiglu_linear(x, gate_up)
        return ops.silu_mul(ops.linear(x, gate), ops.linear(x, up))

    def ffn(self, w: FfnWeights, x: Array) -> Array:
        """Dense SwiGLU, or routed experts (top-k renormalised) + sigmoid-gated shared expert."""
        ops = self.ops
        if isinstance(w, DenseFfnWeights):
            return ops.linear(self._swiglu(x, w.gate, w.up, w.gate_up), w.down)
        routed, shared, gate_logit = self._moe_parts(w, x)
        xp = ops.xp  # the [rows, 1] gate broadcast over H, then the kernel's sigmoid multiply
        gate = xp.ascontiguousarray(xp.broadcast_to(gate_logit, shared.shape))
        ops.sigmoid_gate_mul(shared, gate)
        return routed + shared

    def _moe_parts(self, w: MoeFfnWeights, x: Array) -> tuple[Array, Array, Array]:
        """An MoE FFN's routed output, shared expert output (before its gate) [rows, H] and
        the shared expert's gate logit [rows, 1], of the normed rows x."""
        ops = self.ops
        routed = ops.moe(x, w.router, w.experts_gate, w.experts_up, w.experts_down,
                         self.config.num_experts_per_tok, True, gate_up=w.experts_gate_up)
        shared = ops.linear(self._swiglu(x, w.shared_gate, w.shared_up, w.shared_gate_up),
                            w.shared_down)
        return routed, shared, ops.linear(x, w.shared_expert_gate)


def _fuse_gate_up(ffn: FfnWeights, ops: Ops) -> None:
    """Concatenate a SwiGLU's gate and up (the shared expert's, for MoE) on the device; the
    weights keep views of the concatenation, so nothing is held twice. Kinds that cannot be
    concatenated stay two launches."""
    if isinstance(ffn, DenseFfnWeights):
        fused = ops.concat_linears([ffn.gate, ffn.up])
        if fused is not None:
            ffn.gate_up, (ffn.gate, ffn.up) = fused[0], fused[1]
    else:
        fused = ops.concat_linears([ffn.shared_gate, ffn.shared_up])
        if fused is not None:
            ffn.shared_gate_up, (ffn.shared_gate, ffn.shared_up) = fused[0], fused[1]
        experts = ops.concat_linears([ffn.experts_gate, ffn.experts_up])
        if experts is not None:
            ffn.experts_gate_up, (ffn.experts_gate, ffn.experts_up) = experts[0], experts[1]


def _fuse_inputs(mixer: GatedAttentionWeights | DeltaNetWeights, ops: Ops) -> None:
    """Concatenate the projections a mixer applies to its normed input (GDN: in_qkv, in_z,
    in_a, in_b; attention: q, k, v) on the device, as _fuse_gate_up does."""
    if isinstance(mixer, DeltaNetWeights):
        fused = ops.concat_linears([mixer.in_qkv, mixer.in_z, mixer.in_a, mixer.in_b])
        if fused is not None:
            mixer.in_proj, (mixer.in_qkv, mixer.in_z, mixer.in_a, mixer.in_b) = fused[0], fused[1]
        return
    fused = ops.concat_linears([mixer.q, mixer.k, mixer.v])
    if fused is not None:
        mixer.qkv, (mixer.q, mixer.k, mixer.v) = fused[0], fused[1]


def split_columns(ops: Ops, rows: Array, widths: list[int]) -> list[Array]:
    """rows [n, sum(widths)] cut into C-contiguous column blocks of the given widths (a copy
    only when n > 1: one row's block is already contiguous)."""
    parts, start = [], 0
    for width in widths:
        parts.append(ops.xp.ascontiguousarray(rows[:, start:start + width]))
        start += width
    return parts


def commit_indices(commits: tuple[tuple[int, int], ...], stash_rows: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(lanes, stash rows) int64 of every committed row, in order: lane l's rows 0..n-1 for
    each (l, n) of `commits`; ValueError past the `stash_rows` a lane's stash holds."""
    lanes = np.asarray([lane for lane, count in commits for _ in range(count)], np.int64)
    rows = np.asarray([i for _, count in commits for i in range(count)], np.int64)
    if rows.size and int(rows.max()) >= stash_rows:
        raise ValueError(f"commit_states: {int(rows.max()) + 1} rows > the {stash_rows} stashed")
    return lanes, rows
