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

from ..backend.base import Array, Ops, graph_ops
from ..errors import BadInputError
from .batch_io import ForwardBatch
from .call_graphs import CallGraphs, array_address
from .graph_decoder import GraphDecoder
from .protocol import DecoderProtocol
from .qwen35 import GatedAttentionWeights, HybridDecoder, HybridWeights, MtpWeights

PAD_WRITES_MAX = 64  # slot writes of up to this many rows are padded to a power of two


class MtpHead:
    """The checkpoint's MTP layer as a Decoder (models/protocol.py): `forward(batch, ring,
    kv_scales)` with the target's hidden rows in `batch.hidden_in` and its K/V in the
    drafter's ring; `rows(...)` builds that batch for one stream's slots and `write_slots`
    writes committed slots' K/V. With `graphs` (CUDA), both replay CUDA graphs keyed by the
    ring's address and the call's shape (models/call_graphs.py): the same kernels, the same
    bits, without ~40 launches from Python a call."""

    def __init__(self, decoder: HybridDecoder, *, graphs: bool = False):
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
        capture = graph_ops(decoder.ops) if graphs else None
        self.graphs = CallGraphs(capture) if capture is not None else None
        # small writes padded to a power of two rows (the last slot repeated): a few graph
        # keys a ring serve every count
        self.pad_writes = self.graphs is not None

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
        scales = self._unit_scales if kv_scales is None else kv_scales
        # u += attention, then u += ffn, in place (the trunk's fused layer ops; the bits of u + term)
        self.decoder.layer_mixer_into(w.layer, 0, u, batch, kv, scales, None, None)
        self.decoder.layer_ffn_into(w.layer, u)
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
        every row), normed output h' [n, H]). Host (NumPy) token ids and positions cost no
        sync."""
        capacity = int(ring.shape[2])
        ints = self._ring_inputs(positions, ring, token_ids, logit_rows)
        num_rows, num_pages = int(ints[0].shape[0]), int(ints[4].shape[1])
        scales = self._unit_scales if kv_scales is None else kv_scales
        inputs = (*ints, hidden)

        def run(tokens: Array, pos: Array, slots: Array, row_seq: Array, table: Array,
                chosen: Array, hidden_in: Array) -> tuple[Array, Array]:
            batch = ForwardBatch(tokens, pos, slots, row_seq, table, chosen, capacity,
                                 hidden_in=hidden_in)
            return self.forward(batch, ring, scales)

        if self.graphs is None or num_rows == 0:
            return self.forward(self._ring_batch(ints, capacity, hidden), ring, scales)
        key = ("rows", *array_address(ring), *array_address(scales), num_rows, num_pages, len(ints[5]))
        logits, out = self.graphs(key, run, inputs, holds=(ring, scales))
        return logits, out

    def _ring_batch(self, ints: tuple[np.ndarray, ...], capacity: int, hidden: Array
                    ) -> ForwardBatch:
        """The batch of `_ring_inputs` on the device."""
        tokens, pos, slots, row_seq, table, chosen = (self.ops.asarray(a) for a in ints)
        return ForwardBatch(tokens, pos, slots, row_seq, table, chosen, capacity,
                            hidden_in=hidden)

    def _ring_inputs(self, positions: Array, ring: Array, token_ids: Array,
                     logit_rows: Array | None) -> tuple[np.ndarray, ...]:
        """The ring batch's index arrays on the host (every ring page is page 0: position p
        reads and writes row p % capacity): token ids, positions, slots, row_seq,
        block table (every page is page 0), logit rows (default every row)."""
        pos = _host_int64(self.ops, positions)
        num_rows = int(pos.shape[0])
        num_pages = int(pos.max()) // int(ring.shape[2]) + 1 if num_rows else 1
        chosen = (np.arange(num_rows, dtype=np.int64) if logit_rows is None
                  else _host_int64(self.ops, logit_rows))
        tokens = token_ids if _on_device(token_ids) else _host_int64(self.ops, token_ids)
        return (tokens, pos, pos % int(ring.shape[2]),
                np.zeros(num_rows, np.int32), np.zeros((1, num_pages), np.int32), chosen)

    def write_slots(self, token_ids: list[int], first_pos: int, hidden: Array, ring: Array,
                    kv_scales: Array) -> None:
        """The K/V of MTP slots first_pos.. into the ring: the part of forward() that later
        slots read (same ops, so the same bits); no FFN and no LM head for committed slots.
        hidden: [len(token_ids), H]. With pad_writes, 1..PAD_WRITES_MAX rows are padded to a
        power of two by repeating the last slot (the same values into the same ring row)."""
        rows = len(token_ids)
        pos = np.arange(first_pos, first_pos + rows, dtype=np.int64)
        tokens = np.asarray(token_ids, np.int64)
        padded = 1 << max(0, rows - 1).bit_length()
        if self.pad_writes and rows < padded <= PAD_WRITES_MAX:
            extra = padded - rows
            tokens = np.concatenate([tokens, np.repeat(tokens[-1:], extra)])
            pos = np.concatenate([pos, np.repeat(pos[-1:], extra)])
            hidden = self.ops.xp.concatenate([hidden, self.ops.xp.repeat(hidden[-1:], extra, axis=0)])
            rows = padded
        inputs = (tokens, pos, pos % int(ring.shape[2]), hidden)

        def run(tokens: Array, positions: Array, slots: Array, hidden_in: Array) -> tuple[()]:
            self._slot_kv(tokens, positions, slots, hidden_in, ring, kv_scales)
            return ()

        if self.graphs is None or rows == 0:
            put = self.ops.asarray
            run(put(inputs[0]), put(inputs[1]), put(inputs[2]), hidden)
            return
        key = ("write", *array_address(ring), *array_address(kv_scales), rows)
        self.graphs(key, run, inputs, holds=(ring, kv_scales))

    def _slot_kv(self, tokens: Array, positions: Array, slots: Array, hidden: Array,
                 ring: Array, kv_scales: Array) -> None:
        ops, w, cfg = self.ops, self.mtp, self.config
        eps, rows = cfg.rms_norm_eps, int(tokens.shape[0])
        emb = ops.rms_norm(ops.embed(self.weights.embed, tokens), w.pre_fc_norm_embedding, eps)
        u = ops.linear(ops.xp.concatenate([emb, ops.rms_norm(hidden, w.pre_fc_norm_hidden, eps)],
                                          axis=-1), w.fc)
        a = ops.rms_norm(u, w.layer.input_norm, eps)
        attn = w.layer.mixer
        assert isinstance(attn, GatedAttentionWeights), "the MTP layer is a full-attention layer"
        k = ops.rms_norm(ops.linear(a, attn.k).reshape(rows, cfg.num_kv_heads, cfg.head_dim),
                         attn.k_norm, eps)
        v = ops.linear(a, attn.v).reshape(rows, cfg.num_kv_heads, cfg.head_dim)
        ops.rope(k, positions, self.decoder.inv_freq, self.decoder.mscale)
        ops.kv_write(ring, 0, k, v, slots, kv_scales)


def _on_device(values: Array) -> bool:
    """A device int64 array (e.g. a draft chosen on the device): used where it is, no sync."""
    return not isinstance(values, np.ndarray) and str(values.dtype) == "int64"


def _host_int64(ops: Ops, values: Array) -> np.ndarray:
    """Indices as host int64 (a NumPy array as it is; a device one costs a sync)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    return np.asarray(ops.to_host(values), np.int64)


def make_mtp_head(decoder: DecoderProtocol) -> MtpHead:
    """The MTP head of a hybrid decoder; BadInputError naming why when the checkpoint has none
    (not declared, declared but no mtp.* weights shipped, or unsupported)."""
    graphs = isinstance(decoder, GraphDecoder)  # the trunk's rounds replay graphs: so do the head's
    if isinstance(decoder, GraphDecoder):
        decoder = decoder.decoder
    if not isinstance(decoder, HybridDecoder):
        raise BadInputError(f"--drafter mtp: model {decoder.config.name!r} "
                            f"({decoder.config.arch}) is not a Qwen3.5 hybrid with an MTP layer",
                            param="drafter")
    return MtpHead(decoder, graphs=graphs)
