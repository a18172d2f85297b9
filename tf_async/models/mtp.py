"""The MTP (multi-token prediction) layer of Qwen3.5 / Qwen3.6 for drafting (MODELS.md 6.3).

Slot s pairs (token x_{s+1}, hidden h_s): h_s is the target's final-normed trunk row at s
(or, when drafting step i >= 2, the previous MTP step's normed output).

    u  = fc([rms(embed(x), 1+pre_fc_norm_embedding) | rms(h, 1+pre_fc_norm_hidden)])
    u += gated_attention(rms(u, 1+input_layernorm))   RoPE position s, K/V into ring row s % capacity
    u += ffn(rms(u, 1+post_attention_layernorm))
    h' = rms(u, 1+mtp.norm);  logits = lm_head(h')     (the distribution of x_{s+2})

The layer shares the trunk's embedding and LM head (mtp_use_dedicated_embeddings false) and
its uploaded arrays (the head is built from a HybridDecoder). Its K/V live in a ring that the
caller owns (the drafter's area): `ring [1, 2, capacity, nkv, hd]` of the KV dtype, position p
at row p % capacity, read through the ordinary paged kernels with one page of `capacity`
rows; positions >= capacity wrap, so the caller keeps the attended span within the ring.
"""

from __future__ import annotations

import numpy as np

from ..backend.base import Array, Ops
from ..errors import BadInputError
from .batch_io import ForwardBatch
from .graph_decoder import GraphDecoder
from .protocol import DecoderProtocol
from .qwen35 import HybridDecoder, HybridWeights, MtpWeights


class MtpHead:
    """The checkpoint's MTP layer as a Decoder (models/protocol.py): `forward(batch, ring,
    kv_scales)` with the target's hidden rows in `batch.hidden_in` and its K/V in the
    drafter's ring; `rows(...)` builds that batch for one stream's slots."""

    def __init__(self, decoder: HybridDecoder):
        weights = decoder.weights
        if weights.mtp is None:
            raise BadInputError(
                f"--drafter mtp: model {decoder.config.name!r} has no usable MTP layer "
                f"({weights.mtp_status}); use --drafter ngram or --drafter draft:PATH",
                param="drafter")
        self.decoder = decoder
        self.config = decoder.config
        self.mtp: MtpWeights = weights.mtp
        self._unit_scales = decoder.ops.asarray(np.ones((1, 2), np.float32))

    # ---- the Decoder protocol ------------------------------------------------------------
    @property
    def ops(self) -> Ops:
        return self.decoder.ops

    @property
    def weights(self) -> HybridWeights:
        """The trunk's weights: the MTP layer shares its embedding and LM head."""
        return self.decoder.weights

    @property
    def states(self) -> None:
        return None  # its only state is the ring of K/V rows the caller passes as `kv`

    def commit_states(self, commits: tuple[tuple[int, int], ...]) -> None:
        """No recurrent state: nothing to commit (DecoderProtocol)."""

    def forward(self, batch: ForwardBatch, kv: Array, kv_scales: Array | None = None, *,
                all_hidden: bool = True) -> tuple[Array, Array]:
        """Rows of one stream: batch.token_ids x_{s+1}, positions s (ascending), hidden_in
        h_s; kv = ring [1, 2, capacity, nkv, hd] (rows written). Returns (logits [m, V] of
        batch.logit_rows, normed output h' of every row ([rows, H]; of the logit rows only
        with all_hidden=False)) - the next drafting step feeds h' back."""
        assert batch.hidden_in is not None, "the MTP head needs the target's hidden rows"
        ops, w, eps = self.ops, self.mtp, self.config.rms_norm_eps
        emb = ops.rms_norm(ops.embed(self.weights.embed, batch.token_ids),
                           w.pre_fc_norm_embedding, eps)
        hid = ops.rms_norm(batch.hidden_in, w.pre_fc_norm_hidden, eps)
        u = ops.linear(ops.xp.concatenate([emb, hid], axis=-1), w.fc)  # embedding first
        layer = w.layer
        a = ops.rms_norm(u, layer.input_norm, eps)
        scales = self._unit_scales if kv_scales is None else kv_scales
        u = u + self.decoder.attention(layer.mixer, a, batch, kv, 0, scales)  # type: ignore[arg-type]
        u = u + self.decoder.ffn(layer.ffn, ops.rms_norm(u, layer.post_norm, eps))
        out = ops.rms_norm(u, w.norm, eps)
        rows = out[batch.logit_rows]
        return ops.linear(rows, self.weights.lm_head), out if all_hidden else rows

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        return self.forward(batch, kv, kv_scales)

    def argmax_of(self, logits: Array) -> Array | None:
        return None

    # ---- one stream's slots --------------------------------------------------------------
    def rows(self, token_ids: Array, positions: Array, hidden: Array, ring: Array,
             kv_scales: Array | None = None, logit_rows: Array | None = None
             ) -> tuple[Array, Array]:
        """forward() of one stream's slots: token_ids [n] int64 (x_{s+1}); positions [n]
        int64 (slots s, ascending); hidden [n, H] float32 (h_s); ring [1, 2, capacity, nkv,
        hd]; kv_scales [1, 2] (None: 1.0). Returns (logits [m, V] of `logit_rows` (default
        every row), normed output h' [n, H])."""
        batch = self._ring_batch(positions, ring, token_ids, hidden, logit_rows)
        return self.forward(batch, ring, kv_scales)

    def _ring_batch(self, positions: Array, ring: Array, token_ids: Array, hidden: Array,
                    logit_rows: Array | None) -> ForwardBatch:
        """Every ring page is page 0: position p reads and writes row p % capacity."""
        capacity = int(ring.shape[2])
        pos = np.asarray(self.ops.to_host(positions), np.int64)
        num_rows = int(pos.shape[0])
        num_pages = int(pos.max()) // capacity + 1 if num_rows else 1
        put = self.ops.asarray
        every = put(np.arange(num_rows, dtype=np.int64))
        return ForwardBatch(put(np.asarray(self.ops.to_host(token_ids), np.int64)), put(pos),
                            put(pos % capacity), put(np.zeros(num_rows, np.int32)),
                            put(np.zeros((1, num_pages), np.int32)),
                            every if logit_rows is None else put(logit_rows), capacity,
                            hidden_in=hidden)


def make_mtp_head(decoder: DecoderProtocol) -> MtpHead:
    """The MTP head of a hybrid decoder; BadInputError naming why when the checkpoint has none
    (not declared, declared but no mtp.* weights shipped, or unsupported)."""
    if isinstance(decoder, GraphDecoder):  # the head runs eagerly on the trunk's weights
        decoder = decoder.decoder
    if not isinstance(decoder, HybridDecoder):
        raise BadInputError(f"--drafter mtp: model {decoder.config.name!r} "
                            f"({decoder.config.arch}) is not a Qwen3.5 hybrid with an MTP layer",
                            param="drafter")
    return MtpHead(decoder)
