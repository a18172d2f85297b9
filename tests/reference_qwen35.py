"""An independent float64 NumPy forward of `qwen3_5` (dense) and `qwen3_5_moe`, with the
MTP head: gated full attention, Gated DeltaNet layers, MoE with a shared expert.

Written from /work/shared/spec/MODELS.md sections 0, 5 and 6 straight from HF tensor names
and the HF config dict; it shares no code with the engine or its kernels. Slow and simple:
loops over tokens where that is clearer. Norms follow the HF checkpoint convention (N2,
x * (1 + w)) except `linear_attn.norm` (N3, plain w).

Entry points: `reference_logits`, `reference_hidden`, `reference_forward` (carries a
`RefState`, so a prompt can be fed in pieces), `reference_mtp_logits`, `reference_greedy`,
`reference_mtp_drafts`; the GDN building blocks (`causal_conv1d`, `recurrent_delta_rule`,
`chunked_delta_rule`, ...) are public for the kernel tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Cfg = dict[str, Any]
Weights = dict[str, np.ndarray]
L2_EPS = 1e-6  # HF l2norm eps inside the rsqrt


# ---------------------------------------------------------------------------------------
# config


def text_config(cfg: Cfg) -> Cfg:
    """The language-model part of a Qwen3.5 config (text_config, else the top level)."""
    inner = cfg.get("text_config")
    if not inner:
        return cfg
    merged = dict(inner)
    merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    merged["model_type"] = cfg.get("model_type", inner.get("model_type"))
    return merged


def layer_types(cfg: Cfg) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = int(cfg.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])]


def is_moe(cfg: Cfg) -> bool:
    return str(cfg["model_type"]).startswith("qwen3_5_moe")


def _rope_settings(cfg: Cfg) -> tuple[float, int]:
    """(theta, rotary dims) from rope_parameters or top-level keys; default rope only."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype != "default":
        raise NotImplementedError(f"reference: rope_type {rtype!r}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return theta, int(cfg["head_dim"] * factor)


# ---------------------------------------------------------------------------------------
# elementwise pieces


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """N1: x * rsqrt(mean(x^2) + eps) * w over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def zero_centred_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """N2 (HF Qwen3.5 norms): x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """N3 (linear_attn.norm): w * rmsnorm(x) * silu(z), per head over the last axis."""
    return rms_norm(x, w, eps) * silu(z)


def l2_normalize(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope_partial(x: np.ndarray, positions: np.ndarray, theta: float, rot_dim: int) -> np.ndarray:
    """Rotate-half RoPE on the first rot_dim dims of each head; x: [T, heads, hd]."""
    half = rot_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rot_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    out = x.copy()
    x1, x2 = x[..., :half], x[..., half:rot_dim]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot_dim] = x2 * cos + x1 * sin
    return out


# ---------------------------------------------------------------------------------------
# Gated DeltaNet building blocks (float64; shapes as in the kernels)


def causal_conv1d(m: np.ndarray, conv_state: np.ndarray, weight: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """m: [T, C] raw rows; conv_state: [K-1, C]; weight: [C, K]. Returns (silu(conv) [T, C],
    new conv_state = the last K-1 raw rows of [conv_state; m])."""
    num_hist = weight.shape[1] - 1
    window = np.concatenate([conv_state, m], axis=0)
    out = np.zeros_like(m, dtype=np.float64)
    for t in range(m.shape[0]):
        out[t] = np.sum(weight.T * window[t:t + num_hist + 1], axis=0)
    return silu(out), window[window.shape[0] - num_hist:].copy()


def gdn_gates(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """(g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), [T, Hv] each."""
    return -np.exp(a_log) * softplus(a + dt_bias), sigmoid(b)


def recurrent_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                         beta: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-by-token gated delta rule (MODELS.md 5.5 step 7). q, k: [T, Hk, dk] (already
    normalised/scaled); v: [T, Hv, dv]; g, beta: [T, Hv]; state: [Hv, dk, dv].
    Returns (o [T, Hv, dv], final state)."""
    s = state.astype(np.float64).copy()
    group = v.shape[1] // q.shape[1]
    out = np.zeros(v.shape, np.float64)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            kt, qt = k[t, h // group], q[t, h // group]
            s[h] *= math.exp(g[t, h])
            err = v[t, h] - s[h].T @ kt
            s[h] += np.outer(kt, beta[t, h] * err)
            out[t, h] = s[h].T @ qt
    return out, s


def _chunk_head(q, k, v, g, beta, s):
    """One chunk of one head of the WY/UT form (MODELS.md 5.6). q, k: [n, dk]; v: [n, dv]."""
    n = q.shape[0]
    cum = np.cumsum(g)
    decay = np.tril(np.exp(cum[:, None] - cum[None, :]))
    k_beta, v_beta = k * beta[:, None], v * beta[:, None]
    lower = np.eye(n) + np.tril((k_beta @ k.T) * decay, -1)
    u = np.linalg.solve(lower, v_beta)
    w = np.linalg.solve(lower, np.exp(cum)[:, None] * k_beta)
    v_new = u - w @ s
    out = (np.exp(cum)[:, None] * q) @ s + ((q @ k.T) * decay) @ v_new
    s_next = math.exp(cum[-1]) * s + (np.exp(cum[-1] - cum)[:, None] * k).T @ v_new
    return out, s_next


def chunked_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                       beta: np.ndarray, state: np.ndarray, chunk: int = 64
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The WY/UT chunked form (HF torch_chunk_gated_delta_rule); equal to
    `recurrent_delta_rule` up to rounding. Same arguments and results."""
    group = v.shape[1] // q.shape[1]
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for h in range(v.shape[1]):
        for t0 in range(0, q.shape[0], chunk):
            rows = slice(t0, min(q.shape[0], t0 + chunk))
            out[rows, h], s[h] = _chunk_head(q[rows, h // group], k[rows, h // group],
                                             v[rows, h], g[rows, h], beta[rows, h], s[h])
    return out, s
