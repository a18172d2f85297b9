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


# ---------------------------------------------------------------------------------------
# weights and per-stream state


def lm_prefix(weights: Weights) -> str:
    """`model.language_model.` (Qwen3.5 HF) or `model.` (text-only / Qwen3-Next layout)."""
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in weights:
            return prefix
    raise KeyError("no embed_tokens.weight under model.language_model. or model.")


def _w(weights: Weights, name: str) -> np.ndarray:
    return np.asarray(weights[name], dtype=np.float64)


def _linear(weights: Weights, name: str, x: np.ndarray) -> np.ndarray:
    return x @ _w(weights, name).T


def conv_weight(weights: Weights, name: str) -> np.ndarray:
    """conv1d weight as [C, K] from HF [C, 1, K] or MLX [C, K, 1]."""
    w = _w(weights, name)
    return w[:, 0, :] if w.shape[1] == 1 else w[:, :, 0]


def gdn_dims(cfg: Cfg) -> tuple[int, int, int, int, int]:
    """(Hk, Hv, dk, dv, K)."""
    return (int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
            int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]),
            int(cfg["linear_conv_kernel_dim"]))


@dataclass
class KVCache:
    """Keys/values of one attention layer with their positions (any order of appends)."""

    keys: list[np.ndarray] = field(default_factory=list)  # each [nkv, hd]
    values: list[np.ndarray] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


@dataclass
class RefState:
    """What one stream carries between calls: conv/delta state per GDN layer, KV per
    attention layer, and the number of tokens fed so far."""

    conv: dict[int, np.ndarray] = field(default_factory=dict)  # [K-1, C]
    delta: dict[int, np.ndarray] = field(default_factory=dict)  # [Hv, dk, dv]
    kv: dict[int, KVCache] = field(default_factory=dict)
    num_tokens: int = 0


def new_state(cfg: Cfg) -> RefState:
    cfg = text_config(cfg)
    hk, hv, dk, dv, kernel = gdn_dims(cfg)
    state = RefState()
    for layer, kind in enumerate(layer_types(cfg)):
        if kind == "linear_attention":
            state.conv[layer] = np.zeros((kernel - 1, 2 * hk * dk + hv * dv))
            state.delta[layer] = np.zeros((hv, dk, dv))
        else:
            state.kv[layer] = KVCache()
    return state


# ---------------------------------------------------------------------------------------
# mixers


def gated_attention(cfg: Cfg, weights: Weights, p: str, a: np.ndarray, positions: np.ndarray,
                    cache: KVCache) -> np.ndarray:
    """MODELS.md 5.4; p ends with 'self_attn.'. Appends this call's K/V to cache."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    theta, rot_dim = _rope_settings(cfg)
    qg = _linear(weights, p + "q_proj.weight", a).reshape(-1, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(-1, nh * hd)
    k = _linear(weights, p + "k_proj.weight", a).reshape(-1, nkv, hd)
    v = _linear(weights, p + "v_proj.weight", a).reshape(-1, nkv, hd)
    q = rope_partial(zero_centred_rms_norm(q, _w(weights, p + "q_norm.weight"), eps), positions,
                     theta, rot_dim)
    k = rope_partial(zero_centred_rms_norm(k, _w(weights, p + "k_norm.weight"), eps), positions,
                     theta, rot_dim)
    for t in range(a.shape[0]):
        cache.keys.append(k[t])
        cache.values.append(v[t])
        cache.positions.append(int(positions[t]))
    out = _attend(q, positions, cache, nh // nkv, hd)
    return (out * sigmoid(gate)) @ _w(weights, p + "o_proj.weight").T


def _attend(q: np.ndarray, positions: np.ndarray, cache: KVCache, group: int, hd: int
            ) -> np.ndarray:
    keys, values = np.stack(cache.keys), np.stack(cache.values)
    cached_pos = np.asarray(cache.positions)
    out = np.zeros((q.shape[0], q.shape[1], hd))
    for t in range(q.shape[0]):
        visible = cached_pos <= positions[t]
        for j in range(q.shape[1]):
            scores = keys[visible, j // group] @ q[t, j] / math.sqrt(hd)
            probs = np.exp(scores - scores.max())
            out[t, j] = (probs / probs.sum()) @ values[visible, j // group]
    return out.reshape(q.shape[0], -1)


def gated_deltanet(cfg: Cfg, weights: Weights, p: str, a: np.ndarray, conv_state: np.ndarray,
                   delta_state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MODELS.md 5.5; p ends with 'linear_attn.'. Returns (out, conv_state, delta_state)."""
    hk, hv, dk, dv, _ = gdn_dims(cfg)
    num_rows = a.shape[0]
    mixed, conv_state = causal_conv1d(_linear(weights, p + "in_proj_qkv.weight", a), conv_state,
                                      conv_weight(weights, p + "conv1d.weight"))
    q = l2_normalize(mixed[:, :hk * dk].reshape(num_rows, hk, dk)) / math.sqrt(dk)
    k = l2_normalize(mixed[:, hk * dk:2 * hk * dk].reshape(num_rows, hk, dk))
    v = mixed[:, 2 * hk * dk:].reshape(num_rows, hv, dv)
    g, beta = gdn_gates(_linear(weights, p + "in_proj_a.weight", a),
                        _linear(weights, p + "in_proj_b.weight", a),
                        _w(weights, p + "A_log"), _w(weights, p + "dt_bias"))
    o, delta_state = recurrent_delta_rule(q, k, v, g, beta, delta_state)
    z = _linear(weights, p + "in_proj_z.weight", a).reshape(num_rows, hv, dv)
    y = gated_rms_norm(o, z, _w(weights, p + "norm.weight"), cfg["rms_norm_eps"])
    return _linear(weights, p + "out_proj.weight", y.reshape(num_rows, hv * dv)), conv_state, delta_state


# ---------------------------------------------------------------------------------------
# feed-forward


def swiglu_mlp(weights: Weights, p: str, x: np.ndarray) -> np.ndarray:
    gate = _linear(weights, p + "gate_proj.weight", x)
    return (silu(gate) * _linear(weights, p + "up_proj.weight", x)) @ _w(weights, p + "down_proj.weight").T


def expert_weights(weights: Weights, p: str, expert: int, moe_inter: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate [Im, H], up [Im, H], down [H, Im]) of one expert: fused HF
    (`experts.gate_up_proj` [E, 2Im, H] gate rows first, `experts.down_proj` [E, H, Im]) or
    per-expert `experts.e.{gate,up,down}_proj.weight`."""
    if p + "experts.gate_up_proj" in weights:
        gate_up = _w(weights, p + "experts.gate_up_proj")[expert]
        return gate_up[:moe_inter], gate_up[moe_inter:], _w(weights, p + "experts.down_proj")[expert]
    e = f"{p}experts.{expert}."
    return (_w(weights, e + "gate_proj.weight"), _w(weights, e + "up_proj.weight"),
            _w(weights, e + "down_proj.weight"))


def sparse_moe(cfg: Cfg, weights: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """MODELS.md 5.8: softmax over all experts, top-k, renormalise (always for Qwen3.5-MoE),
    plus the shared expert scaled by sigmoid(shared_expert_gate . x)."""
    top_k, moe_inter = cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    logits = _linear(weights, p + "gate.weight", x)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        route = probs[t, chosen] / probs[t, chosen].sum()
        for expert, weight in zip(chosen, route, strict=True):
            gate, up, down = expert_weights(weights, p, int(expert), moe_inter)
            out[t] += weight * ((silu(gate @ x[t]) * (up @ x[t])) @ down.T)
    shared = swiglu_mlp(weights, p + "shared_expert.", x)
    return out + sigmoid(_linear(weights, p + "shared_expert_gate.weight", x)) * shared


def feed_forward(cfg: Cfg, weights: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """p ends with 'mlp.'."""
    return sparse_moe(cfg, weights, p, x) if is_moe(cfg) else swiglu_mlp(weights, p, x)


# ---------------------------------------------------------------------------------------
# trunk


def _decoder_layer(cfg: Cfg, weights: Weights, p: str, layer: int, h: np.ndarray,
                   positions: np.ndarray, state: RefState) -> np.ndarray:
    eps = cfg["rms_norm_eps"]
    a = zero_centred_rms_norm(h, _w(weights, p + "input_layernorm.weight"), eps)
    if layer in state.delta:
        mixed, state.conv[layer], state.delta[layer] = gated_deltanet(
            cfg, weights, p + "linear_attn.", a, state.conv[layer], state.delta[layer])
    else:
        mixed = gated_attention(cfg, weights, p + "self_attn.", a, positions, state.kv[layer])
    h = h + mixed
    x = zero_centred_rms_norm(h, _w(weights, p + "post_attention_layernorm.weight"), eps)
    return h + feed_forward(cfg, weights, p + "mlp.", x)


def lm_head(cfg: Cfg, weights: Weights, hidden: np.ndarray) -> np.ndarray:
    """Logits of final-normed hidden rows (lm_head.weight, or the tied embedding)."""
    name = "lm_head.weight"
    if cfg.get("tie_word_embeddings") or name not in weights:
        name = lm_prefix(weights) + "embed_tokens.weight"
    return hidden @ _w(weights, name).T


def reference_forward(cfg: Cfg, weights: Weights, token_ids: list[int] | np.ndarray,
                      state: RefState | None = None) -> tuple[np.ndarray, np.ndarray, RefState]:
    """Feed token_ids after what `state` already holds. Returns (logits [T, V], final-normed
    hidden [T, H], state)."""
    cfg = text_config(cfg)
    state = state if state is not None else new_state(cfg)
    prefix = lm_prefix(weights)
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = state.num_tokens + np.arange(len(ids))
    h = _w(weights, prefix + "embed_tokens.weight")[ids]
    for layer in range(cfg["num_hidden_layers"]):
        h = _decoder_layer(cfg, weights, f"{prefix}layers.{layer}.", layer, h, positions, state)
    state.num_tokens += len(ids)
    hidden = zero_centred_rms_norm(h, _w(weights, prefix + "norm.weight"), cfg["rms_norm_eps"])
    return lm_head(cfg, weights, hidden), hidden, state


def reference_logits(cfg: Cfg, weights: Weights, token_ids: list[int] | np.ndarray) -> np.ndarray:
    """[T, V] float64 logits of a whole prompt."""
    return reference_forward(cfg, weights, token_ids)[0]


def reference_hidden(cfg: Cfg, weights: Weights, token_ids: list[int] | np.ndarray) -> np.ndarray:
    """[T, H] final-normed hidden rows (what lm_head and the MTP head read)."""
    return reference_forward(cfg, weights, token_ids)[1]


def reference_greedy(cfg: Cfg, weights: Weights, prompt: list[int], num_new: int) -> list[int]:
    """Plain greedy decoding: the num_new tokens after prompt."""
    logits, _, state = reference_forward(cfg, weights, prompt)
    out = [int(np.argmax(logits[-1]))]
    while len(out) < num_new:
        logits, _, state = reference_forward(cfg, weights, [out[-1]], state)
        out.append(int(np.argmax(logits[-1])))
    return out


# ---------------------------------------------------------------------------------------
# MTP head (MODELS.md 6.3-6.5)


def reference_mtp(cfg: Cfg, weights: Weights, hidden_rows: np.ndarray, next_tokens: list[int],
                  positions: np.ndarray, cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
    """MTP forward of slots at `positions`: slot s pairs (token x_{s+1}, hidden h_s).
    hidden_rows: [S, H] final-normed trunk rows (or the previous MTP output when drafting).
    Appends K/V to the MTP cache. Returns (logits [S, V] for x_{s+2}, normed output [S, H])."""
    cfg = text_config(cfg)
    eps = cfg["rms_norm_eps"]
    embed = _w(weights, lm_prefix(weights) + "embed_tokens.weight")[np.asarray(next_tokens)]
    e = zero_centred_rms_norm(embed, _w(weights, "mtp.pre_fc_norm_embedding.weight"), eps)
    g = zero_centred_rms_norm(np.atleast_2d(hidden_rows), _w(weights, "mtp.pre_fc_norm_hidden.weight"), eps)
    u = _linear(weights, "mtp.fc.weight", np.concatenate([e, g], axis=-1))  # embedding first
    p = "mtp.layers.0."
    a = zero_centred_rms_norm(u, _w(weights, p + "input_layernorm.weight"), eps)
    u = u + gated_attention(cfg, weights, p + "self_attn.", a, np.asarray(positions), cache)
    x = zero_centred_rms_norm(u, _w(weights, p + "post_attention_layernorm.weight"), eps)
    u = u + feed_forward(cfg, weights, p + "mlp.", x)
    out = zero_centred_rms_norm(u, _w(weights, "mtp.norm.weight"), eps)
    return lm_head(cfg, weights, out), out


def reference_mtp_logits(cfg: Cfg, weights: Weights, hidden_rows: np.ndarray,
                         next_tokens: list[int] | int, start_pos: int = 0) -> np.ndarray:
    """Logits [S, V] of the MTP head over slots start_pos.. with a fresh MTP cache (slot s
    attends to slots start_pos..s). A single row (hidden [H], one token) is slot start_pos."""
    tokens = [next_tokens] if isinstance(next_tokens, int) else list(next_tokens)
    positions = start_pos + np.arange(len(tokens))
    return reference_mtp(cfg, weights, np.atleast_2d(hidden_rows), tokens, positions, KVCache())[0]


def reference_mtp_drafts(cfg: Cfg, weights: Weights, prompt: list[int], num_drafts: int
                         ) -> tuple[int, list[int]]:
    """Greedy MTP drafting after a prompt x_0..x_n: returns (x_{n+1}, [d_1..d_k]).
    Sync slots 0..n with (x_{s+1}, h_s); d_1 from slot n; step i >= 2 feeds
    (d_{i-1}, previous MTP normed output) at position n+i-1."""
    logits, hidden, _ = reference_forward(cfg, weights, prompt)
    next_token = int(np.argmax(logits[-1]))
    cache = KVCache()
    tokens = list(prompt[1:]) + [next_token]
    mtp_logits, mtp_out = reference_mtp(cfg, weights, hidden, tokens, np.arange(len(prompt)), cache)
    drafts = [int(np.argmax(mtp_logits[-1]))]
    prev, pos = mtp_out[-1:], len(prompt)
    while len(drafts) < num_drafts:
        mtp_logits, prev = reference_mtp(cfg, weights, prev, [drafts[-1]], np.array([pos]), cache)
        drafts.append(int(np.argmax(mtp_logits[-1])))
        pos += 1
    return next_token, drafts
