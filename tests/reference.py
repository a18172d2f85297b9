"""An independent float64 NumPy forward pass (llama, qwen2, qwen3, qwen3_moe).

Written from docs/spec MODELS.md sections 0-4 straight from HF tensor names and the HF
config dict, sharing no code with the engine, so decoder logits can be checked against it.
Slow and simple on purpose: whole sequence, no cache, loops over tokens where clearer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Cfg = dict[str, Any]
Weights = dict[str, np.ndarray]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def head_dim(cfg: Cfg) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def rope_params(cfg: Cfg) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict with 'rope_type') from old or transformers-5 style keys."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return theta, params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor, orig = s["factor"], s.get("original_max_position_embeddings", 8192)
    low_ff, high_ff = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    out = inv.copy()
    for i, f in enumerate(inv):
        wavelen = 2 * math.pi / f
        if wavelen > orig / low_ff:
            out[i] = f / factor
        elif wavelen >= orig / high_ff:
            smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
            out[i] = (1 - smooth) * f / factor + smooth * f
    return out


def _yarn(inv: np.ndarray, s: dict[str, Any], cfg: Cfg, dim: int, theta: float) -> tuple[np.ndarray, float]:
    factor = s["factor"]
    orig = s.get("original_max_position_embeddings") or cfg["max_position_embeddings"]

    def corr(rotations: float) -> float:
        return dim * math.log(orig / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo, hi = corr(s.get("beta_fast", 32)), corr(s.get("beta_slow", 1))
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0.0, 1.0)
    scaled = inv / factor * ramp + inv * (1 - ramp)
    if s.get("attention_factor") is not None:
        mscale = float(s["attention_factor"])
    elif s.get("mscale") and s.get("mscale_all_dim"):
        mscale = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
    else:
        mscale = _yarn_mscale(factor)
    return scaled, mscale


def rope_inv_freq(cfg: Cfg) -> tuple[np.ndarray, float]:
    """(inverse frequencies [hd/2], attention factor multiplying cos and sin)."""
    dim = head_dim(cfg)
    theta, s = rope_params(cfg)
    inv = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = s["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / s["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, s), 1.0
    if kind == "yarn":
        return _yarn(inv, s, cfg, dim, theta)
    raise ValueError(f"reference: unsupported rope type {kind!r}")


def apply_rope(x: np.ndarray, positions: np.ndarray, cfg: Cfg) -> np.ndarray:
    """Rotate-half RoPE. x: [T, heads, hd]; positions: [T]."""
    inv, mscale = rope_inv_freq(cfg)
    angles = np.outer(positions, inv)  # [T, hd/2]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :] * mscale
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :] * mscale
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _proj(w: Weights, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def attention(cfg: Cfg, w: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """Causal GQA self-attention of layer prefix `p` on normed input x [T, H]."""
    T, nh, nkv, hd = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    eps = cfg["rms_norm_eps"]
    q = _proj(w, p + "self_attn.q_proj", x).reshape(T, nh, hd)
    k = _proj(w, p + "self_attn.k_proj", x).reshape(T, nkv, hd)
    v = _proj(w, p + "self_attn.v_proj", x).reshape(T, nkv, hd)
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):  # per-head norm before RoPE
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
    positions = np.arange(T)
    q, k = apply_rope(q, positions, cfg), apply_rope(k, positions, cfg)
    out = np.zeros((T, nh, hd))
    group = nh // nkv
    causal = np.tril(np.ones((T, T), dtype=bool))
    for head in range(nh):
        kv = head // group
        scores = q[:, head] @ k[:, kv].T / math.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out[:, head] = probs @ v[:, kv]
    return _proj(w, p + "self_attn.o_proj", out.reshape(T, nh * hd))


def mlp(w: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """SwiGLU with weights `<p>gate_proj`, `<p>up_proj`, `<p>down_proj`."""
    gate = x @ w[p + "gate_proj.weight"].T
    up = x @ w[p + "up_proj.weight"].T
    return (silu(gate) * up) @ w[p + "down_proj.weight"].T


def moe(cfg: Cfg, w: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """Qwen3-MoE: softmax over all experts, top-k, optional renormalisation."""
    top_k = cfg["num_experts_per_tok"]
    logits = x @ w[p + "mlp.gate.weight"].T  # [T, E]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen]
        if cfg.get("norm_topk_prob", False):
            weights = weights / weights.sum()
        for e, weight in zip(chosen, weights, strict=True):
            out[t] += weight * mlp(w, f"{p}mlp.experts.{e}.", x[t:t + 1])[0]
    return out


def is_sparse(cfg: Cfg, layer: int) -> bool:
    return (cfg["model_type"] == "qwen3_moe" and cfg.get("num_experts", 0) > 0
            and layer not in (cfg.get("mlp_only_layers") or [])
            and (layer + 1) % (cfg.get("decoder_sparse_step") or 1) == 0)


def reference_logits(cfg: Cfg, weights: Weights, token_ids: list[int]) -> np.ndarray:
    """Logits [T, V] float64 for `token_ids` at positions 0..T-1 (HF names and config)."""
    w = {name: np.asarray(arr, dtype=np.float64) for name, arr in weights.items()}
    eps = cfg["rms_norm_eps"]
    h = w["model.embed_tokens.weight"][np.asarray(token_ids)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = h + attention(cfg, w, p, rms_norm(h, w[p + "input_layernorm.weight"], eps))
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + (moe(cfg, w, p, x) if is_sparse(cfg, layer) else mlp(w, p + "mlp.", x))
    h = rms_norm(h, w["model.norm.weight"], eps)
    tied = cfg.get("tie_word_embeddings", False)
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    return h @ head.T
