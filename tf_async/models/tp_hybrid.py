"""Qwen3.5 hybrids split over tensor-parallel ranks (docs/TENSOR_PARALLEL.md).

Rank r of N holds, besides the dense split of tp_shard.py (gated attention by heads, FFN by
intermediate columns, experts by their columns, the shared expert like a dense MLP):

    GDN      key heads [r*Hk/N, ...) and value heads [r*Hv/N, ...) (value head h reads key
             head h // (Hv/Hk): the groups stay on one rank); in_qkv rows and conv channels of
             its q, k and v heads; in_z, in_a, in_b, A_log, dt_bias by value heads; out
             row-parallel; its recurrent state [.., K-1, C/N] and [.., Hv/N, dk, dv]
    q        per head [query | gate] rows (2*hd a head)
    replicated: embed, lm_head, norms, router, shared_expert_gate (sigmoid(g) * sum of the
             ranks' partials is the sum of sigmoid(g) * partial)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..backend.base import Array, Ops
from ..backend.comm import Communicator
from .batch_io import ForwardBatch, captured_rows
from .checkpoint import Checkpoint
from .config import ModelConfig
from .qwen35 import (
    DeltaNetWeights,
    DenseFfnWeights,
    FfnWeights,
    GatedAttentionWeights,
    HybridConfig,
    HybridDecoder,
    HybridLayerWeights,
    HybridWeights,
    RecurrentStates,
)
from .tp_decoder import RankGroup, ShardedKV
from .tp_shard import (
    check_divides,
    check_whole_groups,
    concat_out,
    part,
    shard_config,
    slice_in,
    slice_out,
)


def shard_hybrid_config(hyb: HybridConfig, size: int) -> HybridConfig:
    return replace(hyb, kv_config=shard_config(hyb.kv_config, size),
                   linear_num_key_heads=hyb.linear_num_key_heads // size,
                   linear_num_value_heads=hyb.linear_num_value_heads // size,
                   shared_expert_intermediate_size=hyb.shared_expert_intermediate_size // size)


def _attention(w: GatedAttentionWeights, cfg: ModelConfig, rank: int, size: int) -> GatedAttentionWeights:
    hd = cfg.head_dim
    h0, h1 = part(cfg.num_heads, rank, size)
    k0, k1 = (x * hd for x in part(cfg.num_kv_heads, rank, size))
    return replace(w, q=slice_out(w.q, 2 * hd * h0, 2 * hd * h1), k=slice_out(w.k, k0, k1),
                   v=slice_out(w.v, k0, k1), o=slice_in(w.o, hd * h0, hd * h1))


def _deltanet(w: DeltaNetWeights, hyb: HybridConfig, rank: int, size: int) -> DeltaNetWeights:
    hk, dk, dv = hyb.linear_num_key_heads, hyb.linear_key_head_dim, hyb.linear_value_head_dim
    a0, a1 = part(hk, rank, size)
    v0, v1 = part(hyb.linear_num_value_heads, rank, size)
    channels = [(a0 * dk, a1 * dk), (hk * dk + a0 * dk, hk * dk + a1 * dk),  # its q | k | v
                (2 * hk * dk + v0 * dv, 2 * hk * dk + v1 * dv)]
    return replace(w, in_qkv=concat_out([slice_out(w.in_qkv, lo, hi) for lo, hi in channels]),
                   conv=np.ascontiguousarray(np.concatenate([w.conv[lo:hi] for lo, hi in channels])),
                   in_z=slice_out(w.in_z, v0 * dv, v1 * dv), in_a=slice_out(w.in_a, v0, v1),
                   in_b=slice_out(w.in_b, v0, v1), a_log=np.ascontiguousarray(w.a_log[v0:v1]),
                   dt_bias=np.ascontiguousarray(w.dt_bias[v0:v1]), out=slice_in(w.out, v0 * dv, v1 * dv))


def _ffn(w: FfnWeights, rank: int, size: int) -> FfnWeights:
    if isinstance(w, DenseFfnWeights):
        i0, i1 = part(w.gate.out_features, rank, size)
        return DenseFfnWeights(slice_out(w.gate, i0, i1), slice_out(w.up, i0, i1),
                               slice_in(w.down, i0, i1))
    e0, e1 = part(w.experts_gate.out_features, rank, size)
    s0, s1 = part(w.shared_gate.out_features, rank, size)
    return replace(w, experts_gate=slice_out(w.experts_gate, e0, e1),
                   experts_up=slice_out(w.experts_up, e0, e1),
                   experts_down=slice_in(w.experts_down, e0, e1),
                   shared_gate=slice_out(w.shared_gate, s0, s1),
                   shared_up=slice_out(w.shared_up, s0, s1), shared_down=slice_in(w.shared_down, s0, s1))


def _layer(layer: HybridLayerWeights, hyb: HybridConfig, rank: int, size: int) -> HybridLayerWeights:
    mixer = (_deltanet(layer.mixer, hyb, rank, size) if isinstance(layer.mixer, DeltaNetWeights)
             else _attention(layer.mixer, hyb.kv_config, rank, size))
    return replace(layer, mixer=mixer, ffn=_ffn(layer.ffn, rank, size))


def shard_hybrid_checkpoint(ckpt: Checkpoint, rank: int, size: int) -> Checkpoint:
    """Rank `rank` of `size`'s checkpoint of a hybrid (its MTP head left out: TP runs the
    trunk; drafters other than ngram are refused at TP > 1)."""
    w: HybridWeights = ckpt.weights  # type: ignore[assignment]
    hyb = shard_hybrid_config(w.hybrid, size)
    layers = [_layer(layer, w.hybrid, rank, size) for layer in w.layers]
    weights = replace(w, hybrid=hyb, layers=layers, mtp=None, mtp_status="left out (tensor parallel)")
    return replace(ckpt, config=hyb.kv_config, weights=weights)  # type: ignore[arg-type]


def check_hybrid_tensor_parallel(ckpt: Checkpoint, size: int) -> None:
    """Refuse a TP size the hybrid cannot be split by (heads, GDN key heads, FFN columns,
    quantization groups of the row-parallel weights)."""
    w: HybridWeights = ckpt.weights  # type: ignore[assignment]
    hyb, cfg = w.hybrid, w.hybrid.kv_config
    counts = {"KV heads": cfg.num_kv_heads, "attention heads": cfg.num_heads,
              "linear-attention key heads": hyb.linear_num_key_heads,
              "linear-attention value heads": hyb.linear_num_value_heads}
    if hyb.is_moe:
        counts.update({"expert intermediate size": cfg.moe_intermediate_size,
                       "shared expert intermediate size": hyb.shared_expert_intermediate_size})
    else:
        counts["intermediate size"] = cfg.intermediate_size
    check_divides(size, counts)
    row_parallel = []
    for layer in w.layers:
        row_parallel.append(layer.mixer.out if isinstance(layer.mixer, DeltaNetWeights) else layer.mixer.o)
        ffn = layer.ffn
        row_parallel += ([ffn.down] if isinstance(ffn, DenseFfnWeights)
                         else [ffn.experts_down, ffn.shared_down])
    check_whole_groups(size, row_parallel)


class ShardedStates:
    """LaneStates over the ranks: rank r's RecurrentStates holds its GDN heads' state of every
    lane; every call goes to every rank (lanes and slots are the same integers)."""

    def __init__(self, group: RankGroup, ranks: list[RecurrentStates]):
        self.group = group
        self.ranks = ranks

    @property
    def num_lanes(self) -> int:
        return self.ranks[0].num_lanes

    @property
    def bytes_per_lane(self) -> int:
        return sum(s.bytes_per_lane for s in self.ranks)

    @property
    def stash_bytes_per_lane(self) -> int:
        return sum(s.stash_bytes_per_lane for s in self.ranks)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.ranks)

    @property
    def num_prefix_slots(self) -> int:
        return self.ranks[0].num_prefix_slots

    def zero(self, lane: int) -> None:
        self.group.each(lambda r: self.ranks[r].zero(lane))

    def freeze(self, lanes: tuple[int, ...]) -> None:
        self.group.each(lambda r: self.ranks[r].freeze(lanes))

    def plan_stash(self, runs: list[tuple[int, int, int]], num_rows: int) -> None:
        self.group.each(lambda r: self.ranks[r].plan_stash(runs, num_rows))

    def add_prefix_slots(self, num_slots: int) -> None:
        self.group.each(lambda r: self.ranks[r].add_prefix_slots(num_slots))

    def keep(self, lane: int, slot: int) -> None:
        self.group.each(lambda r: self.ranks[r].keep(lane, slot))

    def resume(self, slot: int, lane: int) -> None:
        self.group.each(lambda r: self.ranks[r].resume(slot, lane))


class TPHybridDecoder:
    """DecoderProtocol over `comm.size` ranks of a Qwen3.5 hybrid, with one state slot a lane."""

    def __init__(self, ckpt: Checkpoint, rank_ops: Sequence[Ops], comm: Communicator,
                 num_lanes: int):
        check_hybrid_tensor_parallel(ckpt, comm.size)
        self.config: ModelConfig = ckpt.config  # the KV view of the whole model
        shards = [shard_hybrid_checkpoint(ckpt, rank, comm.size) for rank in range(comm.size)]
        self.group = RankGroup(rank_ops, comm, shards[0].config)
        self.ranks: list[HybridDecoder] = self.group.each(
            lambda r: HybridDecoder(shards[r], rank_ops[r]))
        self.states: ShardedStates = self.new_states(num_lanes)

    def new_states(self, num_lanes: int) -> ShardedStates:
        return ShardedStates(self.group, self.group.each(
            lambda r: self.ranks[r].new_states(num_lanes)))

    def commit_states(self, commits: tuple[tuple[int, int], ...]) -> None:
        """Every rank advances its GDN heads' state over the accepted rows it stashed (the
        delta rule is per head: no communication)."""
        self.group.each(lambda r: self.ranks[r].commit_states(commits, self.states.ranks[r]))

    @property
    def ops(self) -> Ops:
        return self.group.ops

    @property
    def weights(self) -> HybridWeights:
        return self.ranks[0].weights  # embed and lm_head are replicated

    def argmax_of(self, logits: Array) -> None:
        return None

    def alloc_kv(self, num_slots: int, kv_dtype: str) -> ShardedKV:
        return self.group.alloc_kv(num_slots, kv_dtype)

    def forward(self, batch: ForwardBatch, kv: ShardedKV, kv_scales: Array, *,
                all_hidden: bool = False, states: ShardedStates | None = None
                ) -> tuple[Array, Array]:
        """DecoderProtocol.forward over the ranks (kv: the arena's ShardedKV); advances the
        lanes' states on every rank."""
        group, ranks = self.group, self.ranks
        rank_states = (states if states is not None else self.states).ranks
        batches, scales = group.batches(batch), group.scales(kv_scales)
        lanes = group.each(lambda r: ranks[r].row_lanes(batches[r], rank_states[r]))
        hs = group.each(lambda r: ranks[r].ops.embed(ranks[r].weights.embed, batches[r].token_ids))
        captured: dict[int, Array] = {}
        for index in range(self.ranks[0].hybrid.num_trunk_layers):
            group.add_reduced(hs, group.each(lambda r: ranks[r].mixer_term(  # noqa: B023 - run at once
                index, hs[r], batches[r], kv.ranks[r], scales[r], rank_states[r], lanes[r])))  # noqa: B023
            group.add_reduced(hs, group.each(lambda r: ranks[r].ffn_term(index, hs[r])))  # noqa: B023
            captured_rows(self.ops, batch, index, hs[0], captured)
        with group.comm.scope(0):
            return ranks[0].head(hs[0], batch, captured, all_hidden=all_hidden)

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        """Forward with fresh zero states, one lane a block-table row, into a plain kv on rank 0
        (fp8 calibration): a scratch split arena, gathered back by heads."""
        num_seqs = int(batch.block_table.shape[0])
        lanes = self.ops.asarray(np.arange(num_seqs, dtype=np.int32))
        scratch = self.alloc_kv(int(kv.shape[2]), "f32")
        out = self.forward(replace(batch, seq_lanes=lanes), scratch, kv_scales,
                           states=self.new_states(num_seqs))
        self.group.gather_kv(scratch, kv)
        return out
