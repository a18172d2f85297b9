"""The dense decoder split over tensor-parallel ranks (docs/TENSOR_PARALLEL.md).

One controller drives N rank decoders layer by layer: each rank runs its heads' attention
and its intermediate columns of the MLP (a partial sum of the layer's output), the
communicator all-reduces the partials, and every rank adds the same sum to its residual.
Ranks therefore hold identical residual rows; rank 0 computes the logits (embedding and
lm_head are replicated).

    layer:  h_r --attention_term(rank r)--> part_r --all_reduce--> h_r += sum_r part_r
            h_r --mlp_term(rank r)-------> part_r --all_reduce--> h_r += sum_r part_r

The KV arena is split by KV heads (ShardedKV): rank r holds heads [r*nkv/N, (r+1)*nkv/N)
of every page; page ids, slots and the block table are one set of integers for all ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..backend.base import Array, Ops
from ..backend.comm import Communicator
from .batch_io import FIELDS, ForwardBatch, captured_rows
from .checkpoint import Checkpoint, ModelWeights
from .config import ModelConfig
from .decoder import Decoder
from .tp_shard import check_tensor_parallel, shard_checkpoint


@dataclass(frozen=True, slots=True)
class ShardedKV:
    """The arena's KV (or a drafter's ring) split by heads: ranks[r] [layers, 2, slots, nkv/N,
    hd] holds KV heads [r*nkv/N, (r+1)*nkv/N) of every slot, on rank r's device."""

    ranks: tuple[Array, ...]
    comm: Communicator  # whose scopes the parts live in

    def fill(self, value: float) -> None:
        """Every rank's part set to `value` (a drafter ring zeroed when its context opens)."""
        for rank, part in enumerate(self.ranks):
            with self.comm.scope(rank):
                part.fill(value)

    @property
    def shape(self) -> tuple[int, ...]:
        """The unsplit arena's shape [layers, 2, slots, nkv, hd]."""
        layers, kinds, slots, heads, hd = self.ranks[0].shape
        return (layers, kinds, slots, heads * len(self.ranks), hd)

    @property
    def nbytes(self) -> int:
        return sum(int(kv.nbytes) for kv in self.ranks)

    def heads_of(self, rank: int) -> range:
        """The (global) KV heads rank `rank` holds."""
        per_rank = int(self.ranks[0].shape[3])
        return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True, slots=True)
class ShardedRegion:
    """The arena's drafter region a rank (uint8, the same size on every rank): an area at byte
    offset o is ranks[r][o: o + size] on every rank, so area offsets stay one set of integers."""

    ranks: tuple[Array, ...]
    comm: Communicator

    @property
    def nbytes(self) -> int:
        return sum(int(region.nbytes) for region in self.ranks)


class RankGroup:
    """The ranks of one TP group: each rank's ops, the communicator, and what every TP
    decoder does over them (the split arena, batches on each rank, the all-reduce)."""

    def __init__(self, rank_ops: Sequence[Ops], comm: Communicator, rank_config: ModelConfig):
        if len(rank_ops) != comm.size:
            raise ValueError(f"tensor parallel: {len(rank_ops)} ops for {comm.size} ranks")
        self.rank_ops = list(rank_ops)
        self.comm = comm
        self.rank_config = rank_config  # a rank's KV layers, heads and head_dim
        self._scales: tuple[Array, list[Array]] | None = None  # (rank 0's, each rank's copy)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def ops(self) -> Ops:
        """Rank 0's ops: the engine's (batches, logits and sampling live there)."""
        return self.rank_ops[0]

    # ---- the split arena
    def alloc_kv(self, num_slots: int, kv_dtype: str) -> ShardedKV:
        """Each rank's share of an arena of `num_slots` rows (its KV heads only)."""
        cfg = self.rank_config
        return ShardedKV(tuple(self.each(lambda r: self.rank_ops[r].alloc_kv(
            cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, kv_dtype))), self.comm)

    def alloc_region(self, num_bytes: int, alloc: Callable[[Any, int], Array]) -> ShardedRegion:
        """A drafter region of `num_bytes` on every rank, each made by alloc(xp, num_bytes)."""
        return ShardedRegion(tuple(self.each(lambda r: alloc(self.rank_ops[r].xp, num_bytes))),
                             self.comm)

    def zero_pages(self, kv: ShardedKV, page_ids: np.ndarray, page_size: int) -> None:
        """Zero pages `page_ids` (host int32) on every rank."""
        for rank, (ops, part) in enumerate(zip(self.rank_ops, kv.ranks, strict=True)):
            with self.comm.scope(rank):
                ops.zero_pages(part, ops.asarray(page_ids), page_size)

    def copy_rows(self, kv: ShardedKV, source_rows: slice, target_rows: slice) -> None:
        """Slots `source_rows` into `target_rows` on every rank, every layer."""
        for rank, part in enumerate(kv.ranks):
            with self.comm.scope(rank):
                part[:, :, target_rows] = part[:, :, source_rows]

    def gather_kv(self, sharded: ShardedKV, kv: Array) -> None:
        """The ranks' heads side by side into a plain kv [layers, 2, rows, nkv, hd] on rank 0."""
        for rank, part in enumerate(sharded.ranks):
            heads = sharded.heads_of(rank)
            kv[:, :, :, heads.start:heads.stop] = self.comm.to_rank(0, part)

    def synchronize(self) -> None:
        for rank, ops in enumerate(self.rank_ops):
            with self.comm.scope(rank):
                ops.synchronize()

    # ---- the forward's plumbing
    def each(self, work: Callable[[int], Array]) -> list[Array]:
        """work(rank) for every rank in order, each inside its rank's scope (its device).
        Ranks > 0 skip the ops' device bound checks (a host sync each on CUDA): their index
        arrays are copies of rank 0's, which rank 0 checked (or ran unchecked after the
        runner's host check) before any other rank runs."""
        out = []
        for rank in range(self.size):
            with self.comm.scope(rank), self._checks(rank):
                out.append(work(rank))
        return out

    def _checks(self, rank: int) -> AbstractContextManager[Any]:
        ops = self.rank_ops[rank]
        return nullcontext() if rank == 0 or ops is self.ops else ops.unchecked()

    def add_reduced(self, hs: list[Array], parts: list[Array]) -> None:
        """h_r += the sum of every rank's partial (the row-parallel matmuls' all-reduce)."""
        self.comm.all_reduce(parts)
        for rank, (h, part) in enumerate(zip(hs, parts, strict=True)):
            with self.comm.scope(rank):
                h += part

    def batches(self, batch: ForwardBatch) -> list[ForwardBatch]:
        """The batch's index arrays on each rank's device, copied from rank 0's device (not
        from the host copy: decode steps write token ids on the device); the batch itself
        where the ranks share one memory (the CPU)."""
        return [batch if rank == 0 or self.rank_ops[rank] is self.ops
                else self._moved(rank, batch) for rank in range(self.size)]

    def _moved(self, rank: int, batch: ForwardBatch) -> ForwardBatch:
        copies = {name: self.comm.to_rank(rank, getattr(batch, name)) for name in FIELDS}
        lanes = None if batch.seq_lanes is None else self.comm.to_rank(rank, batch.seq_lanes)
        return replace(batch, **copies, seq_lanes=lanes, packed=None, capture_layers=(),
                       hidden_in=None)

    def scales(self, kv_scales: Array) -> list[Array]:
        """The arena's KV scales on every rank, copied once (they never change after start)."""
        if self._scales is None or self._scales[0] is not kv_scales:
            self._scales = (kv_scales, [self.comm.to_rank(r, kv_scales) for r in range(self.size)])
        return self._scales[1]


class TPDecoder:
    """DecoderProtocol over `comm.size` ranks of a dense checkpoint (llama/qwen2/qwen3/qwen3_moe)."""

    def __init__(self, ckpt: Checkpoint, rank_ops: Sequence[Ops], comm: Communicator):
        check_tensor_parallel(ckpt, comm.size)
        self.config: ModelConfig = ckpt.config  # the whole model's: what the page table counts
        shards = [shard_checkpoint(ckpt, rank, comm.size) for rank in range(comm.size)]
        self.group = RankGroup(rank_ops, comm, shards[0].config)
        self.ranks: list[Decoder] = self.group.each(lambda r: Decoder(shards[r], rank_ops[r]))

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def ops(self) -> Ops:
        return self.group.ops

    @property
    def weights(self) -> ModelWeights:
        return self.ranks[0].weights  # embed and lm_head are replicated

    @property
    def states(self) -> None:
        return None

    def argmax_of(self, logits: Array) -> None:
        return None

    def commit_states(self, commits: tuple[tuple[int, int], ...]) -> None:
        """No recurrent state: nothing to commit (DecoderProtocol)."""

    def alloc_kv(self, num_slots: int, kv_dtype: str) -> ShardedKV:
        return self.group.alloc_kv(num_slots, kv_dtype)

    def forward(self, batch: ForwardBatch, kv: ShardedKV, kv_scales: Array, *,
                all_hidden: bool = False) -> tuple[Array, Array]:
        """DecoderProtocol.forward over the ranks; kv is the arena's ShardedKV."""
        group, ranks = self.group, self.ranks
        batches, scales = group.batches(batch), group.scales(kv_scales)
        hs = group.each(lambda r: ranks[r].ops.embed(ranks[r].weights.embed, batches[r].token_ids))
        captured: dict[int, Array] = {}
        for index in range(self.config.num_layers):
            group.add_reduced(hs, group.each(lambda r: ranks[r].attention_term(
                index, hs[r], batches[r], kv.ranks[r], scales[r])))  # noqa: B023 - run at once
            group.add_reduced(hs, group.each(lambda r: ranks[r].mlp_term(index, hs[r])))  # noqa: B023
            captured_rows(self.ops, batch, index, hs[0], captured)
        with group.comm.scope(0):
            return ranks[0].head(hs[0], batch, captured, all_hidden=all_hidden)

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        """forward() into a plain arena kv [layers, 2, rows, nkv, hd] on rank 0 (fp8
        calibration): a scratch split arena, gathered back by heads."""
        scratch = self.alloc_kv(int(kv.shape[2]), "f32")
        out = self.forward(batch, scratch, kv_scales)
        self.group.gather_kv(scratch, kv)
        return out
