"""The DFlash / DFlash2 drafter's forward on any Ops (docs/DFLASH.md).

One draft round of a stream whose target has committed positions [0, start):

    ctx[p]  = hidden_norm(fc([h_l0[p] | h_l1[p] | ...]))   h_l: output of target layer l
    ring    : per drafter layer, k_norm'd + roped K and V of ctx[p] at row p % capacity
    x       = embed([anchor, mask, ..., mask]) * input_embedding_scale   positions start..
    per layer: x += attn(rms(x)); x += mlp(rms(x))   queries: the block; keys: ring + block
    h       = norm(x)[1:];  logits = lm_head(h) * output_multiplier (softcapped)

Attention inside the block is non-causal unless the layer is causal; a sliding layer sees
keys with |q - k| < window. DFlash2 wraps each sublayer in a grouped dynamic causal
convolution over the block and picks the block's tokens with its candidate selector (a
greedy chain over the top-k of each row). The ring is the caller's: `new_ring` sizes it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..backend.base import Array, Ops, graph_ops
from ..backend.dflash_ops import DFlashOps, make_dflash_ops
from ..backend.weights import Linear
from .call_graphs import CallGraphs, array_address
from .dflash import DFlashCheckpoint, DFlashConfig, DFlashLayerWeights, DynamicConvWeights
from .rope import rope_tables


class DFlashModel:
    """The drafter with the target's embedding and LM head (uploaded by the target)."""

    def __init__(self, checkpoint: DFlashCheckpoint, ops: Ops, embed: Linear, lm_head: Linear,
                 *, graphs: bool = False, max_graphs: int = 96):
        self.cfg: DFlashConfig = checkpoint.config
        self.ops = ops
        w = checkpoint.weights
        self.fc = ops.upload_linear(w.fc)
        self.hidden_norm = ops.asarray(w.hidden_norm)
        self.norm = ops.asarray(w.norm)
        self.layers = tuple(_upload_layer(ops, layer) for layer in w.layers)
        self.kernels: DFlashOps = make_dflash_ops(ops)  # conv, block attention, selector
        self.selector = w.selector  # host copy: sampled drafts score candidates on the host
        self.hidden_projection = None if w.selector is None else ops.upload_linear(w.selector.hidden_projection)
        self.codebooks = None if w.selector is None else (
            ops.asarray(w.selector.predecessor_codebook), ops.asarray(w.selector.successor_codebook))
        inv_freq, self.mscale = rope_tables(self.cfg.rope_config())
        self.inv_freq = ops.asarray(inv_freq)
        self.embed, self.lm_head = embed, lm_head
        # one visibility mask a distinct (window, causal) of the layers; each layer's index
        kinds = list(dict.fromkeys(zip(self.cfg.layer_windows, self.cfg.layer_causal, strict=True)))
        self._mask_kinds = tuple(kinds)
        self._layer_mask = tuple(kinds.index(k) for k in zip(self.cfg.layer_windows,
                                                              self.cfg.layer_causal, strict=True))
        # On CUDA the ring's keys are gathered padded to a power of two (fixed shapes a graph
        # can replay; the padding is masked); with graphs, the greedy block and the context
        # writes replay CUDA graphs keyed by the ring's address and the shapes.
        self.pad_keys = ops.name == "cuda"
        capture = graph_ops(ops) if graphs else None
        self.graphs = CallGraphs(capture, max_graphs) if capture is not None else None

    # ---- the context ring -----------------------------------------------------------------
    def new_ring(self, capacity: int) -> Array:
        """A zeroed ring [layers, 2, capacity, nkv, hd] float32."""
        c = self.cfg
        return self.ops.xp.zeros((c.num_layers, 2, capacity, c.num_kv_heads, c.head_dim), np.float32)

    def context_rows_needed(self, start: int) -> int:
        """How many past positions a block at `start` attends (the ring must hold them)."""
        windows = self.cfg.layer_windows
        if any(w is None for w in windows):
            return start
        return min(start, max(w for w in windows if w is not None) - 1)

    def write_context(self, ring: Array, features: Array, positions: np.ndarray) -> Array:
        """features [n, len(target_layer_ids) * H] float32 (the target's layer outputs side
        by side, in target_layer_ids order) at positions [n] int64 (host) -> K/V rows of the
        ring. Returns the context rows [n, H] (what a prefix cache keeps beside the pages)."""
        positions = np.asarray(positions, np.int64)

        def write(feats: Array, pos: Array) -> tuple[Array]:
            ctx = self.context_rows(feats)
            self.write_kv(ring, ctx, pos)
            return (ctx,)

        if self.graphs is None or not len(positions):
            return write(features, self.ops.asarray(positions))[0]
        key = ("context", array_address(ring), tuple(features.shape))
        return self.graphs(key, write, (features, positions), holds=(ring,))[0]

    def context_rows(self, features: Array) -> Array:
        """ctx = hidden_norm(fc(features)) [n, H] float32."""
        ops, c = self.ops, self.cfg
        return ops.rms_norm(ops.linear(features, self.fc), self.hidden_norm, c.rms_norm_eps)

    def write_kv(self, ring: Array, ctx: Array, positions: Array) -> None:
        """Context rows ctx [n, H] at positions [n] int64 -> every layer's K/V ring rows (the
        ops are row-independent: rows rebuilt later get the bits a fresh ring holds)."""
        rows = positions % ring.shape[2]
        for i, layer in enumerate(self.layers):
            k, v = self._kv(layer, ctx, positions)
            ring[i, 0, rows] = k
            ring[i, 1, rows] = v

    # ---- one block ------------------------------------------------------------------------
    def block_hidden(self, ring: Array, start: int, token_ids: np.ndarray) -> Array:
        """token_ids [B] (the anchor at `start`, then mask tokens) -> normed output [B, H]."""
        inputs = self._block_inputs(ring, start, token_ids)
        return self._block_hidden_of(ring, *(self.ops.asarray(a) for a in inputs))

    def _block_inputs(self, ring: Array, start: int, token_ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """The block's host inputs: ids [B], query positions [B], the ring rows it gathers
        [W] (those of the attended positions, ascending, then padding: on CUDA up to a power
        of two, masked) and one visibility mask [B, W + B] uint8 a distinct (window, causal):
        the keys are the gathered ring rows, then the block's own."""
        capacity = int(ring.shape[2])
        if capacity < self.context_rows_needed(start):
            raise ValueError(f"DFlash ring of {capacity} rows cannot hold the "
                             f"{self.context_rows_needed(start)} positions a block at {start} attends")
        rows = len(token_ids)
        qpos = np.arange(start, start + rows, dtype=np.int64)
        kpos = np.arange(max(0, start - capacity), start, dtype=np.int64)
        width = _padded(len(kpos), capacity) if self.pad_keys else len(kpos)
        ring_rows = np.concatenate([kpos % capacity, np.zeros(width - len(kpos), np.int64)])
        masks = []
        for window, causal in self._mask_kinds:
            seen = _visible(qpos, kpos, window, causal)
            pad = np.zeros((rows, width - len(kpos)), bool)
            masks.append(np.concatenate([seen[:, :len(kpos)], pad, seen[:, len(kpos):]], axis=1)
                         .astype(np.uint8))
        return (np.asarray(token_ids, np.int64), qpos, ring_rows, *masks)

    def _block_hidden_of(self, ring: Array, ids: Array, qpos: Array, ring_rows: Array,
                         *masks: Array) -> Array:
        """block_hidden on the device inputs of _block_inputs (no host work: graph-safe)."""
        ops, c, xp = self.ops, self.cfg, self.ops.xp
        x = ops.embed(self.embed, ids) * np.float32(c.input_embedding_scale)
        for i, layer in enumerate(self.layers):
            a = ops.rms_norm(x, layer.input_norm, c.rms_norm_eps)
            a, after = self._conv_in(a, layer.attention_conv)
            attn = self._attention(i, layer, a, ring, ring_rows, qpos, masks[self._layer_mask[i]])
            x = x + self._conv_out(attn, after, layer.attention_conv)
            m = ops.rms_norm(x, layer.post_norm, c.rms_norm_eps)
            m, after = self._conv_in(m, layer.mlp_conv)
            mlp = ops.linear(ops.silu_mul(ops.linear(m, layer.gate), ops.linear(m, layer.up)), layer.down)
            x = x + self._conv_out(mlp, after, layer.mlp_conv)
        return ops.rms_norm(xp.ascontiguousarray(x), self.norm, c.rms_norm_eps)

    def logits(self, hidden: Array) -> Array:
        """lm_head(hidden) [rows, V] times output_multiplier, softcapped where configured."""
        c, xp = self.cfg, self.ops.xp
        out = self.ops.linear(hidden, self.lm_head)
        if c.output_multiplier != 1.0:
            out = out * np.float32(c.output_multiplier)
        if c.final_logit_softcapping:
            cap = np.float32(c.final_logit_softcapping)
            out = xp.tanh(out / cap) * cap
        return out

    def block_logits(self, ring: Array, start: int, anchor_id: int) -> tuple[Array, Array | None]:
        """The draft rows of the block after `anchor_id` at `start`: logits [B-1, V] and, for
        DFlash2, the selector's projected hidden [B-1, r] (else None), on the device."""
        c = self.cfg
        ids = np.full(c.block_size, c.mask_token_id, np.int64)
        ids[0] = anchor_id
        hidden = self.block_hidden(ring, start, ids)[1:]
        if self.hidden_projection is None:
            return self.logits(hidden), None
        return self.logits(hidden), self.ops.linear(hidden, self.hidden_projection)

    def propose(self, ring: Array, start: int, anchor_id: int) -> np.ndarray:
        """The block_size - 1 greedy draft tokens after `anchor_id` at `start` [B-1] int64."""
        if self.graphs is None:
            logits, projected = self.block_logits(ring, start, anchor_id)
            if projected is None:
                return np.argmax(self.ops.to_host(logits), axis=-1).astype(np.int64)
            assert self.codebooks is not None
            return self.kernels.select_greedy(logits, projected, *self.codebooks, anchor_id,
                                              self.cfg.selector_top_k)
        parts = self._replayed_parts(ring, start, anchor_id)
        if self.hidden_projection is None:
            return self.ops.to_host(parts[0]).astype(np.int64)
        assert self.codebooks is not None
        return self.kernels.chain(parts[0], parts[1], parts[2], *self.codebooks, anchor_id)

    def block_candidates(self, ring: Array, start: int, anchor_id: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """DFlash2's draft rows after `anchor_id` at `start` as its selector sees them, on the
        host: each row's top-k candidates (ids [B-1, k], logits [B-1, k], larger first) and
        the projected hidden [B-1, r] (from the graph of the greedy block where there is one)."""
        if self.hidden_projection is None:
            raise ValueError("block_candidates: a DFlash2 drafter's (it has no selector)")
        if self.graphs is None:
            logits, projected = self.block_logits(ring, start, anchor_id)
            assert projected is not None
            ids, values = self.top_candidates(logits)
            return ids, values, self.ops.to_host(projected)
        ids_d, values_d, projected_d = self._replayed_parts(ring, start, anchor_id)
        return self.ops.to_host(ids_d), self.ops.to_host(values_d), self.ops.to_host(projected_d)

    def _replayed_parts(self, ring: Array, start: int, anchor_id: int) -> tuple[Array, ...]:
        """_greedy_parts of the block after `anchor_id` at `start`, from its graph."""
        assert self.graphs is not None
        ids = np.full(self.cfg.block_size, self.cfg.mask_token_id, np.int64)
        ids[0] = anchor_id
        inputs = self._block_inputs(ring, start, ids)
        key = ("block", array_address(ring), inputs[2].shape[0])  # the gathered ring rows
        return self.graphs(key, lambda *a: self._greedy_parts(ring, *a), inputs, holds=(ring,))

    def _greedy_parts(self, ring: Array, *inputs: Array) -> tuple[Array, ...]:
        """The block's greedy choice up to the anchor-dependent part, on the device: DFlash,
        each row's argmax (ties: lowest id); DFlash2, each row's top-k candidates (ids,
        values) and the projected hidden, for the selector's chain."""
        hidden = self._block_hidden_of(ring, *inputs)[1:]
        logits = self.logits(hidden)
        if self.hidden_projection is None:
            assert self.graphs is not None  # graph ops: a device argmax
            return (self.graphs.ops.argmax(logits),)
        ids, values = self.kernels.candidates(logits, self.cfg.selector_top_k)
        return ids, values, self.ops.linear(hidden, self.hidden_projection)

    def top_candidates(self, logits: Array) -> tuple[np.ndarray, np.ndarray]:
        """DFlash2's candidates of each row: (ids [R, k], logits [R, k]) on the host, larger
        logit first, ties: lower id first."""
        return self.kernels.top_k(logits, self.cfg.selector_top_k)

    def candidate_scores(self, candidates: np.ndarray, values: np.ndarray, projected: np.ndarray,
                         previous: int) -> np.ndarray:
        """DFlash2's selector scores of one row's candidates [k] (their logits `values` [k],
        projected [r], host): logit + <pred[previous] * projected, succ[candidate]> [k] f32."""
        assert self.selector is not None
        sel = self.selector
        pair = sel.successor_codebook[candidates] @ (sel.predecessor_codebook[previous] * projected)
        return (values + pair).astype(np.float32)

    # ---- parts ----------------------------------------------------------------------------
    def _kv(self, layer: DFlashLayerWeights, x: Array, positions: Array) -> tuple[Array, Array]:
        """k_norm'd, roped K and V [rows, nkv, hd] of x [rows, H] at positions."""
        ops, c = self.ops, self.cfg
        shape = (x.shape[0], c.num_kv_heads, c.head_dim)
        k = ops.rms_norm(ops.linear(x, layer.k).reshape(shape), layer.k_norm, c.rms_norm_eps)
        ops.rope(k, positions, self.inv_freq, self.mscale)
        return k, ops.linear(x, layer.v).reshape(shape)

    def _attention(self, index: int, layer: DFlashLayerWeights, a: Array, ring: Array,
                   ring_rows: Array, qpos: Array, visible: Array) -> Array:
        """The block's queries over the ring's rows `ring_rows`, then the block's own keys
        (_block_inputs); visible [B, T] uint8."""
        ops, c, xp = self.ops, self.cfg, self.ops.xp
        rows = a.shape[0]
        q = ops.rms_norm(ops.linear(a, layer.q).reshape(rows, c.num_heads, c.head_dim),
                         layer.q_norm, c.rms_norm_eps)
        ops.rope(q, qpos, self.inv_freq, self.mscale)
        k, v = self._kv(layer, a, qpos)
        keys = xp.concatenate([ring[index, 0, ring_rows], k])  # [T, nkv, hd]
        values = xp.concatenate([ring[index, 1, ring_rows], v])
        out = self.kernels.block_attention(q, keys, values, visible, c.head_dim ** -0.5)
        return ops.linear(xp.ascontiguousarray(out.reshape(rows, c.num_heads * c.head_dim)), layer.o)

    def _conv_in(self, x: Array, conv: DynamicConvWeights | None) -> tuple[Array, Array | None]:
        """DFlash2's convolution before a sublayer: (convolved x, the taps for after it)."""
        if conv is None:
            return x, None
        c = self.cfg
        taps = self.ops.linear(x, conv.kernel_projection).reshape(
            x.shape[0], 2, c.conv_kernel_size, c.num_groups)
        return self._convolve(x, taps[:, 0], conv.base_kernel[0]), taps[:, 1]

    def _conv_out(self, x: Array, taps: Array | None, conv: DynamicConvWeights | None) -> Array:
        if conv is None or taps is None:
            return x
        return self._convolve(x, taps, conv.base_kernel[1])

    def _convolve(self, x: Array, taps: Array, base: Array) -> Array:
        """Grouped dynamic causal convolution over the block: x [B, H], taps [B, K, G]
        (one tap a group), base [K, H]; out[t] = sum_o (base[o] + taps[t, o]) * x[t - o]."""
        return self.kernels.grouped_conv(x, taps, base, self.cfg.conv_group_size)

def _padded(count: int, capacity: int) -> int:
    """Ring keys a block gathers on CUDA: `count` rounded up to a power of two (at least 16),
    at most the capacity: a few shapes, each replayed from its graph."""
    return min(capacity, max(16, 1 << max(count - 1, 0).bit_length()))


def _visible(qpos: np.ndarray, kpos_ring: np.ndarray, window: int | None, causal: bool) -> np.ndarray:
    """[B, T] bool: which keys (ring positions, then the block's) each block query sees."""
    keys = np.concatenate([kpos_ring, qpos])
    diff = qpos[:, None] - keys[None, :]
    visible = np.ones(diff.shape, bool)
    if causal:
        visible &= diff >= 0
    if window is not None:
        visible &= diff < window
        if not causal:
            visible &= -diff < window
    return visible


def _upload_layer(ops: Ops, layer: DFlashLayerWeights) -> DFlashLayerWeights:
    up, put = ops.upload_linear, ops.asarray
    return replace(layer, input_norm=put(layer.input_norm), post_norm=put(layer.post_norm),
                   q=up(layer.q), k=up(layer.k), v=up(layer.v), o=up(layer.o),
                   q_norm=put(layer.q_norm), k_norm=put(layer.k_norm),
                   gate=up(layer.gate), up=up(layer.up), down=up(layer.down),
                   attention_conv=_upload_conv(ops, layer.attention_conv),
                   mlp_conv=_upload_conv(ops, layer.mlp_conv))


def _upload_conv(ops: Ops, conv: DynamicConvWeights | None) -> DynamicConvWeights | None:
    if conv is None:
        return None
    return DynamicConvWeights(ops.asarray(conv.base_kernel), ops.upload_linear(conv.kernel_projection))
