"""One decoder for llama / qwen2 / qwen3 / qwen3_moe, described by ModelConfig.

The caller (the engine's runner) owns the KV arena and passes it in with the batch's
metadata; the decoder holds only weights. Every op is row-wise batch-invariant, so a row's
logits do not depend on which other rows share the call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..backend.base import Array, Ops
from ..backend.weights import FusedLinear
from .batch_io import ForwardBatch, captured_rows, hidden_rows
from .checkpoint import Checkpoint, LayerWeights, ModelWeights
from .rope import rope_tables


class Decoder:
    def __init__(self, ckpt: Checkpoint, ops: Ops):
        self.config = ckpt.config
        self.ops = ops
        self.weights = _upload(ckpt.weights, ops)
        self.fused = _fuse_layers(self.weights, ops)
        inv_freq, self.mscale = rope_tables(ckpt.config, ckpt.weights.rope_freq_divisors)
        self.inv_freq = ops.asarray(inv_freq)
        self.sm_scale = 1.0 / math.sqrt(ckpt.config.head_dim)

    @property
    def states(self) -> None:
        """No recurrent state: every layer is attention (DecoderProtocol)."""
        return None

    def commit_states(self, commits: tuple[tuple[int, int], ...]) -> None:
        """No recurrent state: nothing to commit (DecoderProtocol)."""

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        return self.forward(batch, kv, kv_scales)

    def argmax_of(self, logits: Array) -> None:
        return None

    def forward(self, batch: ForwardBatch, kv: Array, kv_scales: Array, *,
                all_hidden: bool = False) -> tuple[Array, Array]:
        """Run the rows; return (logits [m, V] of batch.logit_rows, final-normed hidden [m, H]
        of those rows, or [rows, H] of every row when `all_hidden`)."""
        ops, w = self.ops, self.weights
        h = ops.embed(w.embed, batch.token_ids)
        captured: dict[int, Array] = {}  # batch.capture_layers' outputs
        for index, (layer, fused) in enumerate(zip(w.layers, self.fused, strict=True)):
            if fused is not None:
                self._fused_layer(index, layer, fused, h, batch, kv, kv_scales)  # h in place
            else:
                # a layer whose q, k, v cannot be fused (some biases but not all; CUDA: mixed kinds)
                h = h + self._attention(index, layer, h, batch, kv, kv_scales)
                h = h + self._mlp(index, layer, ops.rms_norm(h, layer.post_norm, self.config.rms_norm_eps))
            captured_rows(ops, batch, index, h, captured)
        return self.head(h, batch, captured, all_hidden=all_hidden)

    def head(self, h: Array, batch: ForwardBatch, captured: dict[int, Array], *,
             all_hidden: bool = False) -> tuple[Array, Array]:
        """The final norm and lm_head of the last layer's rows h [rows, H] (forward's result)."""
        ops, w = self.ops, self.weights
        hidden = ops.rms_norm(h if all_hidden else h[batch.logit_rows], w.final_norm,
                              self.config.rms_norm_eps)
        logit_hidden = hidden[batch.logit_rows] if all_hidden else hidden
        return ops.linear(logit_hidden, w.lm_head), (hidden_rows(ops, batch, captured, hidden)
                                                     if all_hidden else hidden)

    def attention_term(self, index: int, h: Array, batch: ForwardBatch, kv: Array,
                       kv_scales: Array) -> Array:
        """Layer `index`'s attention output [rows, H] that joins the residual h (with a rank's
        weights: that rank's partial sum, tensor parallel); the layer ops where fused."""
        layer, fused = self.weights.layers[index], self.fused[index]
        if fused is None:
            return self._attention(index, layer, h, batch, kv, kv_scales)
        o = self._attention_rows(index, layer, fused, h, batch, kv, kv_scales)
        return self.ops.linear(o, layer.o, layer.o_bias)

    def mlp_term(self, index: int, h: Array) -> Array:
        """Layer `index`'s MLP output [rows, H] from the residual h (post-attention norm
        included; with a rank's weights: that rank's partial sum)."""
        layer, fused = self.weights.layers[index], self.fused[index]
        ops, eps = self.ops, self.config.rms_norm_eps
        if fused is None or fused.gate_up is None:
            return self._mlp(index, layer, ops.rms_norm(h, layer.post_norm, eps))
        assert layer.down is not None
        a = ops.rms_norm_for(h, layer.post_norm, eps, fused.gate_up)
        return ops.linear(ops.swiglu_linear(a, fused.gate_up), layer.down)

    def _attention(self, index: int, layer: LayerWeights, h: Array, batch: ForwardBatch,
                   kv: Array, kv_scales: Array) -> Array:
        ops, cfg = self.ops, self.config
        rows = h.shape[0]
        a = ops.rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
        q = ops.linear(a, layer.q, layer.q_bias).reshape(rows, cfg.num_heads, cfg.head_dim)
        k = ops.linear(a, layer.k, layer.k_bias).reshape(rows, cfg.num_kv_heads, cfg.head_dim)
        v = ops.linear(a, layer.v, layer.v_bias).reshape(rows, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        ops.rope(q, batch.positions, self.inv_freq, self.mscale)
        ops.rope(k, batch.positions, self.inv_freq, self.mscale)
        ops.kv_write(kv, index, k, v, batch.slots, kv_scales)
        o = ops.attention(q, kv, index, kv_scales, batch.block_table, batch.row_seq,
                          batch.positions, batch.page_size, self.sm_scale)
        return ops.linear(o.reshape(rows, cfg.q_size), layer.o, layer.o_bias)

    def _fused_layer(self, index: int, layer: LayerWeights, fused: FusedLayer, h: Array,
                     batch: ForwardBatch, kv: Array, kv_scales: Array) -> None:
        """One layer with the backend's layer ops: the bits of _attention and _mlp, in 8 ops
        instead of 18 on CUDA (the *_for ops: an output that only a matmul on int8 x reads is
        written as that int8 x by the launch that makes it: the norms and attention), the
        basic ops themselves on the CPU; h is updated in place."""
        ops, eps = self.ops, self.config.rms_norm_eps
        o = self._attention_rows(index, layer, fused, h, batch, kv, kv_scales)
        if layer.o_bias is None:
            ops.linear_into(o, layer.o, h)
        else:
            h += ops.linear(o, layer.o, layer.o_bias)
        if fused.gate_up is not None:  # the normed rows in the form gate|up takes (int8 x or not)
            assert layer.down is not None
            a = ops.rms_norm_for(h, layer.post_norm, eps, fused.gate_up)
            ops.linear_into(ops.swiglu_linear(a, fused.gate_up), layer.down, h)
        elif fused.experts_gate_up is not None:  # one quantization for router and experts
            assert layer.router is not None
            a = ops.rms_norm_for(h, layer.post_norm, eps, [layer.router, fused.experts_gate_up])
            h += self._mlp(index, layer, a)
        else:
            h += self._mlp(index, layer, ops.rms_norm(h, layer.post_norm, eps))

    def _attention_rows(self, index: int, layer: LayerWeights, fused: FusedLayer, h: Array,
                        batch: ForwardBatch, kv: Array, kv_scales: Array) -> Array:
        """The fused layer's attention rows before o (in the form `layer.o` multiplies): q|k|v
        in one matmul, K/V written, attention over the pages."""
        ops, cfg = self.ops, self.config
        eps = cfg.rms_norm_eps
        qkv = ops.linear(ops.rms_norm_for(h, layer.input_norm, eps, fused.qkv), fused.qkv, fused.qkv_bias)
        q = ops.attn_inputs(qkv, layer.q_norm, layer.k_norm, eps, batch.positions, self.inv_freq,
                            self.mscale, kv, index, batch.slots, kv_scales, cfg.num_heads)
        return ops.attention_for(q, kv, index, kv_scales, batch.block_table, batch.row_seq,
                                 batch.positions, batch.page_size, self.sm_scale, layer.o)

    def _mlp(self, index: int, layer: LayerWeights, a: Array) -> Array:
        ops, cfg = self.ops, self.config
        if layer.router is not None:
            assert layer.experts_gate and layer.experts_up and layer.experts_down
            fused = self.fused[index]
            return ops.moe(a, layer.router, layer.experts_gate, layer.experts_up, layer.experts_down,
                           cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           gate_up=fused.experts_gate_up if fused is not None else None)
        assert layer.gate and layer.up and layer.down
        return ops.linear(ops.silu_mul(ops.linear(a, layer.gate), ops.linear(a, layer.up)), layer.down)


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """A layer's concatenated weights for the fused path: q|k|v (and their biases), gate|up
    of a dense MLP (None for MoE layers), and an MoE layer's experts' [gate; up] (one grouped
    launch on CUDA; None where the backend keeps them apart)."""

    qkv: FusedLinear
    qkv_bias: Array | None
    gate_up: FusedLinear | None
    experts_gate_up: FusedLinear | None = None  # MoE: each expert's [gate; up], stacked


def _fuse_layers(weights: ModelWeights, ops: Ops) -> list[FusedLayer | None]:
    """Concatenate each layer's q, k, v (and gate, up) on the device; the layer keeps views
    of the concatenation, so no weight is held twice. A layer whose q, k, v differ in kind
    (e.g. mixed GGUF quant types) or carry some biases but not all is not fused."""
    fused: list[FusedLayer | None] = []
    for i, layer in enumerate(weights.layers):
        biases = (layer.q_bias, layer.k_bias, layer.v_bias)
        has_bias = [b is not None for b in biases]
        qkv = None if any(has_bias) and not all(has_bias) else ops.concat_linears([layer.q, layer.k, layer.v])
        if qkv is None:
            fused.append(None)
            continue
        qkv_bias = ops.xp.concatenate(biases) if all(has_bias) else None
        gate_up = None
        if layer.gate is not None and layer.up is not None:
            gate_up = ops.concat_linears([layer.gate, layer.up])
        experts = None
        if layer.experts_gate is not None and layer.experts_up is not None:
            experts = ops.concat_linears([layer.experts_gate, layer.experts_up])
        views: dict[str, Any] = {"q": qkv[1][0], "k": qkv[1][1], "v": qkv[1][2]}
        if gate_up is not None:
            views.update(gate=gate_up[1][0], up=gate_up[1][1])
        if experts is not None:
            views.update(experts_gate=experts[1][0], experts_up=experts[1][1])
        weights.layers[i] = replace(layer, **views)
        fused.append(FusedLayer(qkv[0], qkv_bias, gate_up[0] if gate_up is not None else None,
                                experts[0] if experts is not None else None))
    return fused


def _upload(weights: ModelWeights, ops: Ops) -> ModelWeights:
    """Move every array to the ops' device once, at load."""
    cache: dict[int, Any] = {}

    def put(x: Any) -> Any:
        if x is None:
            return None
        if id(x) not in cache:  # tied embeddings stay one object
            cache[id(x)] = ops.asarray(x) if isinstance(x, np.ndarray) else ops.upload_linear(x)
        return cache[id(x)]

    layers = [replace(layer, **{f: put(getattr(layer, f)) for f in LayerWeights.__slots__})
              for layer in weights.layers]
    return ModelWeights(embed=put(weights.embed), lm_head=put(weights.lm_head),
                        final_norm=put(weights.final_norm), layers=layers,
                        rope_freq_divisors=weights.rope_freq_divisors)
