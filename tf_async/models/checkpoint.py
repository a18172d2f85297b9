"""What a loader returns: config, weights in HF layout, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..backend.weights import Linear
from .config import ModelConfig

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


@dataclass(slots=True)
class LayerWeights:
    input_norm: np.ndarray  # [H] f32
    post_norm: np.ndarray  # [H] f32
    q: Linear  # [nh*hd, H]
    k: Linear  # [nkv*hd, H]
    v: Linear  # [nkv*hd, H]
    o: Linear  # [H, nh*hd]
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [hd] (qwen3)
    k_norm: np.ndarray | None = None
    gate: Linear | None = None  # dense MLP [I, H]
    up: Linear | None = None  # [I, H]
    down: Linear | None = None  # [H, I]
    router: Linear | None = None  # MoE [E, H]
    experts_gate: Linear | None = None  # stacked [E, Im, H]
    experts_up: Linear | None = None  # stacked [E, Im, H]
    experts_down: Linear | None = None  # stacked [E, H, Im]


@dataclass(slots=True)
class ModelWeights:
    embed: Linear  # [V, H]
    lm_head: Linear  # [V, H]; the same object as embed when tied
    final_norm: np.ndarray  # [H]
    layers: list[LayerWeights]
    rope_freq_divisors: np.ndarray | None = None  # GGUF llama3 `rope_freqs.weight` [rot/2]


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    path: str
    meta: dict[str, object] = field(default_factory=dict)


def dense_hf_state(weights: ModelWeights) -> dict[str, np.ndarray]:
    """Float32 weights under HF names, dequantized (what a quantized checkpoint really holds);
    for exporting, comparing with other frameworks and tests. Dense (non-MoE) models."""
    out = {"model.embed_tokens.weight": weights.embed.dequantize(), "model.norm.weight": weights.final_norm}
    if weights.lm_head is not weights.embed:
        out["lm_head.weight"] = weights.lm_head.dequantize()
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.input_norm
        out[p + "post_attention_layernorm.weight"] = layer.post_norm
        for name in ("q", "k", "v", "o"):
            out[p + f"self_attn.{name}_proj.weight"] = getattr(layer, name).dequantize()
        for name in ("gate", "up", "down"):
            linear = getattr(layer, name)
            if linear is None:
                raise ValueError("dense_hf_state: MoE layers are not supported")
            out[p + f"mlp.{name}_proj.weight"] = linear.dequantize()
    return out
