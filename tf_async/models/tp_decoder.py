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
from dataclasses import dataclass, replace

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
    """The arena's KV split by heads: ranks[r] [layers, 2, slots, nkv/N, hd] holds KV heads
    [r*nkv/N, (r+1)*nkv/N) of every slot, on rank r's device."""

    ranks: tuple[Array, ...]

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


class TPDecoder:
    """DecoderProtocol over `comm.size` ranks of a dense checkpoint (llama/qwen2/qwen3/qwen3_moe)."""

    def __init__(self, ckpt: Checkpoint, rank_ops: Sequence[Ops], comm: Communicator):
        check_tensor_parallel(ckpt, comm.size)
        if len(rank_ops) != comm.size:
            raise ValueError(f"TPDecoder: {len(rank_ops)} ops for {comm.size} ranks")
        self.config: ModelConfig = ckpt.config  # the whole model's: what the page table counts
        self.comm = comm
        self.ranks: list[Decoder] = []
        for rank, ops in enumerate(rank_ops):
            with comm.scope(rank):
                self.ranks.append(Decoder(shard_checkpoint(ckpt, rank, comm.size), ops))
        self._scales: tuple[Array, list[Array]] | None = None  # (rank 0's, each rank's copy)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def ops(self) -> Ops:
        """Rank 0's ops: the engine's (batches, logits and sampling live there)."""
        return self.ranks[0].ops

    @property
    def weights(self) -> ModelWeights:
        return self.ranks[0].weights  # embed and lm_head are replicated

    @property
    def states(self) -> None:
        return None

    def argmax_of(self, logits: Array) -> None:
        return None

    # ---- the split arena
    def alloc_kv(self, num_slots: int, kv_dtype: str) -> ShardedKV:
        """Each rank's share of an arena of `num_slots` rows (its KV heads only)."""
        kvs = []
        for rank, dec in enumerate(self.ranks):
            cfg = dec.config
            with self.comm.scope(rank):
                kvs.append(dec.ops.alloc_kv(cfg.num_layers, num_slots, cfg.num_kv_heads,
                                            cfg.head_dim, kv_dtype))
        return ShardedKV(tuple(kvs))

    def zero_pages(self, kv: ShardedKV, page_ids: np.ndarray, page_size: int) -> None:
        """Zero pages `page_ids` (host int32) on every rank."""
        for rank, (dec, part) in enumerate(zip(self.ranks, kv.ranks, strict=True)):
            with self.comm.scope(rank):
                dec.ops.zero_pages(part, dec.ops.asarray(page_ids), page_size)

    def copy_rows(self, kv: ShardedKV, source_rows: slice, target_rows: slice) -> None:
        """Slots `source_rows` into `target_rows` on every rank, every layer."""
        for rank, part in enumerate(kv.ranks):
            with self.comm.scope(rank):
                part[:, :, target_rows] = part[:, :, source_rows]

    def synchronize(self) -> None:
        for rank, dec in enumerate(self.ranks):
            with self.comm.scope(rank):
                dec.ops.synchronize()

    # ---- forward
    def forward(self, batch: ForwardBatch, kv: ShardedKV, kv_scales: Array, *,
                all_hidden: bool = False) -> tuple[Array, Array]:
        """DecoderProtocol.forward over the ranks; kv is the arena's ShardedKV."""
        batches = [self._on_rank(rank, batch) for rank in range(self.size)]
        scales = self._scales_on_ranks(kv_scales)
        ranks = self.ranks
        hs = self._each(lambda r: ranks[r].ops.embed(ranks[r].weights.embed, batches[r].token_ids))
        captured: dict[int, Array] = {}
        for index in range(self.config.num_layers):
            self._layer(index, hs, batches, kv, scales)
            captured_rows(self.ops, batch, index, hs[0], captured)
        with self.comm.scope(0):
            return ranks[0].head(hs[0], batch, captured, all_hidden=all_hidden)

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        """forward() into a plain arena kv [layers, 2, rows, nkv, hd] on rank 0 (fp8
        calibration): a scratch split arena, gathered back by heads."""
        scratch = self.alloc_kv(int(kv.shape[2]), "f32")
        out = self.forward(batch, scratch, kv_scales)
        for rank, part in enumerate(scratch.ranks):
            heads = scratch.heads_of(rank)
            kv[:, :, :, heads.start:heads.stop] = self.comm.to_rank(0, part)
        return out

    def _layer(self, index: int, hs: list[Array], batches: list[ForwardBatch], kv: ShardedKV,
               scales: list[Array]) -> None:
        """Layer `index` on every rank; hs[r] (rank r's residual rows) updated in place."""
        ranks = self.ranks
        self._add_reduced(hs, self._each(lambda r: ranks[r].attention_term(
            index, hs[r], batches[r], kv.ranks[r], scales[r])))
        self._add_reduced(hs, self._each(lambda r: ranks[r].mlp_term(index, hs[r])))

    def _each(self, work: Callable[[int], Array]) -> list[Array]:
        """work(rank) for every rank in order, each inside its rank's scope (its device)."""
        out = []
        for rank in range(self.size):
            with self.comm.scope(rank):
                out.append(work(rank))
        return out

    def _add_reduced(self, hs: list[Array], parts: list[Array]) -> None:
        """h_r += the sum of every rank's partial (the row-parallel matmuls' all-reduce)."""
        self.comm.all_reduce(parts)
        for rank, (h, part) in enumerate(zip(hs, parts, strict=True)):
            with self.comm.scope(rank):
                h += part

    def _on_rank(self, rank: int, batch: ForwardBatch) -> ForwardBatch:
        """The batch's index arrays on rank `rank`'s device, copied from rank 0's device (not
        from the host copy: decode steps write token ids on the device). The batch itself
        where the ranks share one memory (the CPU)."""
        if rank == 0 or self.ranks[rank].ops is self.ops:
            return batch
        copies = {name: self.comm.to_rank(rank, getattr(batch, name)) for name in FIELDS}
        return replace(batch, **copies, packed=None, capture_layers=(), hidden_in=None,
                       seq_lanes=None)

    def _scales_on_ranks(self, kv_scales: Array) -> list[Array]:
        """The arena's KV scales on every rank, copied once (they never change after start)."""
        if self._scales is None or self._scales[0] is not kv_scales:
            self._scales = (kv_scales, [self.comm.to_rank(r, kv_scales) for r in range(self.size)])
        return self._scales[1]
