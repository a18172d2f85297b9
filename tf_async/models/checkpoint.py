"""What a loader returns: config, weights in HF layout, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .config import ModelConfig
from .weights import Linear

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
