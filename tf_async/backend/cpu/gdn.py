"""CPU (Numba) kernels of the Qwen3.5 / Qwen3-Next hybrid layers: the short causal conv,
the Gated DeltaNet gates, L2-normalised q/k, the gated delta rule, the gated RMSNorm (N3)
and the gated-attention output gate. Twins with the same signatures: cuda_kernels/gdn.py.

Arrays are float32, recurrent state float32. Output arrays are passed in; kernels return
nothing and update states in place. Shapes (one layer):

    C   = 2*Hk*dk + Hv*dv          conv channels, order [q | k | v] (in_proj_qkv rows)
    conv_state  [K-1, C]           last K-1 raw (pre-conv) rows of a stream, oldest first
    delta state [Hv, dk, dv]       HF layout S[h, i, j]; o = S^T q
    v-head h reads q/k head h // (Hv // Hk)

Batch invariance: every (row, channel) of the conv and every (row, head, value column) of
the delta rule is computed by one shared helper with a fixed operation order, so a row's
result never depends on the other rows of the call, on how a prompt is cut into calls, or
on the thread count (see `gated_delta_rule_column_parallel`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

DV_BLOCK = 16  # value columns per parallel task of the delta rule (any size gives equal bits)
CONV_BLOCK = 64  # channels per parallel task of the conv


@njit(nogil=True, cache=True, inline="always")
def _silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


@njit(nogil=True, cache=True, inline="always")
def _sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


# ---------------------------------------------------------------------------------------
# causal depthwise conv (+ SiLU) with a carried state of raw rows


@njit(nogil=True, cache=True, inline="always")
def _conv_channel_step(state, col, weight, c, x_val):
    """One row of channel c: silu(sum_j w[c, j] * window[j]), then push x_val into the
    state, whose column `col` holds channel c. window = [state rows (oldest first), x_val];
    the sum runs j = 0..K-1."""
    num_hist = state.shape[0]
    acc = np.float32(0.0)
    for j in range(num_hist):
        acc += weight[c, j] * state[j, col]
    acc += weight[c, num_hist] * x_val
    for j in range(num_hist - 1):
        state[j, col] = state[j + 1, col]
    if num_hist > 0:
        state[num_hist - 1, col] = x_val
    return _silu(acc)


@njit(nogil=True, cache=True)
def causal_conv1d_step(x, conv_state, weight, out):
    """One token of one stream. x, out: [C]; conv_state: [K-1, C] (updated); weight: [C, K]."""
    for c in range(x.shape[0]):
        out[c] = _conv_channel_step(conv_state, c, weight, c, x[c])


@njit(nogil=True, cache=True, parallel=True)
def causal_conv1d_rows(x, conv_state, weight, out):
    """Rows of one stream in time order. x, out: [T, C]; conv_state [K-1, C] carried through
    the rows. Parallel over channel blocks; bit-identical to T calls of the step kernel."""
    num_rows, num_channels = x.shape
    num_blocks = (num_channels + CONV_BLOCK - 1) // CONV_BLOCK
    for blk in prange(num_blocks):
        c1 = min(num_channels, (blk + 1) * CONV_BLOCK)
        for t in range(num_rows):
            for c in range(blk * CONV_BLOCK, c1):
                out[t, c] = _conv_channel_step(conv_state, c, weight, c, x[t, c])


@njit(nogil=True, cache=True, parallel=True)
def causal_conv1d_batch(x, conv_states, weight, row_seq, frozen, out):
    """Rows of many streams. x, out: [rows, C]; conv_states: [slots, K-1, C]; row_seq: [rows]
    int32 state slot of each row; frozen: [slots] uint8. A stream's rows must appear in time
    order. The rows of a frozen slot (a verify pass, docs/QWEN35.md section 5) run from a
    copy of its state, and its stored state is left as it was; they must be contiguous."""
    num_rows, num_channels = x.shape
    num_hist = conv_states.shape[1]
    num_blocks = (num_channels + CONV_BLOCK - 1) // CONV_BLOCK
    for blk in prange(num_blocks):
        c0 = blk * CONV_BLOCK
        c1 = min(num_channels, c0 + CONV_BLOCK)
        copy = np.empty((num_hist, CONV_BLOCK), np.float32)  # a frozen slot's history
        held = -1
        for r in range(num_rows):
            slot = row_seq[r]
            if frozen[slot]:
                if slot != held:
                    for j in range(num_hist):
                        for c in range(c0, c1):
                            copy[j, c - c0] = conv_states[slot, j, c]
                    held = slot
                for c in range(c0, c1):
                    out[r, c] = _conv_channel_step(copy, c - c0, weight, c, x[r, c])
            else:
                state = conv_states[slot]
                for c in range(c0, c1):
                    out[r, c] = _conv_channel_step(state, c, weight, c, x[r, c])


# ---------------------------------------------------------------------------------------
# gates and q/k normalisation


@njit(nogil=True, cache=True, inline="always")
def _softplus(x):
    # torch's softplus threshold: linear above 20
    if x > np.float32(20.0):
        return x
    return np.log1p(np.exp(x))


@njit(nogil=True, cache=True)
def gdn_gates(a, b, a_log, dt_bias, g_out, beta_out):
    """a, b: [rows, Hv] (in_proj_a / in_proj_b outputs); a_log, dt_bias: [Hv].
    g_out = -exp(A_log) * softplus(a + dt_bias) (log-decay); beta_out = sigmoid(b)."""
    for r in range(a.shape[0]):
        for h in range(a.shape[1]):
            decay_rate = np.exp(np.float32(a_log[h]))
            g_out[r, h] = -decay_rate * _softplus(a[r, h] + np.float32(dt_bias[h]))
            beta_out[r, h] = _sigmoid(b[r, h])


@njit(nogil=True, cache=True, inline="always")
def _l2_scale_head(src, r, col0, dim, eps, scale, dst, head):
    sum_sq = np.float32(0.0)
    for i in range(dim):
        x = src[r, col0 + i]
        sum_sq += x * x
    inv = np.float32(1.0) / np.sqrt(sum_sq + eps)
    for i in range(dim):
        dst[r, head, i] = src[r, col0 + i] * inv * scale


@njit(nogil=True, cache=True)
def gdn_qk_l2norm(mixed, num_k_heads, head_k_dim, eps, q_scale, q_out, k_out):
    """mixed: [rows, C] conv output ([q | k | v] channels). q_out, k_out: [rows, Hk, dk].
    k = k * rsqrt(sum k^2 + eps); q = q * rsqrt(sum q^2 + eps) * q_scale (q_scale = dk^-0.5)."""
    eps32 = np.float32(eps)
    qs32 = np.float32(q_scale)
    k_base = num_k_heads * head_k_dim
    for r in range(mixed.shape[0]):
        for hk in range(num_k_heads):
            _l2_scale_head(mixed, r, hk * head_k_dim, head_k_dim, eps32, qs32, q_out, hk)
            _l2_scale_head(mixed, r, k_base + hk * head_k_dim, head_k_dim, eps32,
                           np.float32(1.0), k_out, hk)


# ---------------------------------------------------------------------------------------
# gated delta rule


@njit(nogil=True, cache=True, inline="always")
def _delta_token(s, col0, j0, j1, q, k, v, g, beta, o, acc):
    """One token, one value head, value columns [j0, j1): the exact recurrence
        S <- exp(g) S;  e = v - S^T k;  S <- S + k (beta e)^T;  o = S^T q   (read after write)
    s: state whose column j - col0 holds value column j ([dk, dv] with col0 = 0, or a
    block's copy); q, k: [dk]; v, o: [dv]; acc: [dv] scratch. Sums over i run i = 0..dk-1
    per column, so each column's bits are independent of [j0, j1)."""
    alpha = np.exp(g)
    for j in range(j0, j1):
        acc[j] = np.float32(0.0)
        o[j] = np.float32(0.0)
    for i in range(s.shape[0]):
        k_i = k[i]
        for j in range(j0, j1):
            decayed = s[i, j - col0] * alpha
            s[i, j - col0] = decayed
            acc[j] += decayed * k_i
    for j in range(j0, j1):
        acc[j] = beta * (v[j] - acc[j])
    for i in range(s.shape[0]):
        k_i = k[i]
        q_i = q[i]
        for j in range(j0, j1):
            written = s[i, j - col0] + k_i * acc[j]
            s[i, j - col0] = written
            o[j] += written * q_i


@njit(nogil=True, cache=True)
def gated_delta_rule(q, k, v, g, beta, state, out):
    """The recurrent form: rows of one stream, one token at a time, all heads serially.
    q, k: [T, Hk, dk] (L2-normalised, q scaled); v: [T, Hv, dv]; g (log-decay), beta: [T, Hv];
    state: [Hv, dk, dv] float32 (updated); out: [T, Hv, dv]."""
    num_v_heads, _, head_v_dim = state.shape
    group = num_v_heads // q.shape[1]
    acc = np.empty(head_v_dim, np.float32)
    for t in range(q.shape[0]):
        for h in range(num_v_heads):
            hk = h // group
            _delta_token(state[h], 0, 0, head_v_dim, q[t, hk], k[t, hk], v[t, h], g[t, h],
                         beta[t, h], out[t, h], acc)


@njit(nogil=True, cache=True, parallel=True)
def gated_delta_rule_batch(q, k, v, g, beta, states, row_seq, frozen, out):
    """Rows of many streams (a round may mix prompt steps and decode rows). Shapes as in
    `gated_delta_rule` with states: [slots, Hv, dk, dv], row_seq: [rows] int32 (state slot
    of each row; a stream's rows in time order) and frozen: [slots] uint8 (as in
    `causal_conv1d_batch`: a frozen slot's rows, contiguous, run from a copy of its state,
    which stays as it was). Parallel over (v-head, dv block); each task runs every row in
    order, so a row sees exactly the state its stream had before it."""
    num_v_heads, head_k_dim, head_v_dim = states.shape[1:]
    group = num_v_heads // q.shape[1]
    num_blocks = (head_v_dim + DV_BLOCK - 1) // DV_BLOCK
    for task in prange(num_v_heads * num_blocks):
        h = task // num_blocks
        j0 = (task % num_blocks) * DV_BLOCK
        j1 = min(head_v_dim, j0 + DV_BLOCK)
        hk = h // group
        acc = np.empty(head_v_dim, np.float32)
        copy = np.empty((head_k_dim, DV_BLOCK), np.float32)  # a frozen slot's columns
        held = -1
        for r in range(q.shape[0]):
            slot = row_seq[r]
            if frozen[slot]:
                if slot != held:
                    for i in range(head_k_dim):
                        for j in range(j0, j1):
                            copy[i, j - j0] = states[slot, h, i, j]
                    held = slot
                _delta_token(copy, j0, j0, j1, q[r, hk], k[r, hk], v[r, h], g[r, h],
                             beta[r, h], out[r, h], acc)
            else:
                _delta_token(states[slot, h], 0, j0, j1, q[r, hk], k[r, hk], v[r, h], g[r, h],
                             beta[r, h], out[r, h], acc)


def gated_delta_rule_column_parallel(q, k, v, g, beta, state, out):
    """The "chunked" multi-row form used for prompt steps: same arguments as
    `gated_delta_rule` (one stream), parallel over (v-head, block of dv value columns).

    Why not a WY/UT chunked algorithm (HF `chunk_gated_delta_rule`, fla): it re-associates
    the sums (cumulative decays, triangular solves), so its fp32 result differs from the
    token-by-token recurrence in the last bits, and the result would depend on where a prompt
    is cut into steps and whether rows come one at a time. The engine's gates (stepped ==
    whole, concurrent == solo, drafted == plain) need bit-identity, so this kernel runs the
    exact recurrence per token in a fixed order and gets its parallelism from the value
    columns, which the delta rule never mixes: column j of S only ever reads k, q, v[j], g,
    beta. Every column therefore performs the same float32 operations, in the same order, as
    in `gated_delta_rule`, whatever the block size and thread count."""
    # One stream is the batch kernel with a single state slot (state[None] is a view).
    rows = np.zeros(q.shape[0], np.int32)
    gated_delta_rule_batch(q, k, v, g, beta, state[None], rows, np.zeros(1, np.uint8), out)


# ---------------------------------------------------------------------------------------
# output norm and gates


@njit(nogil=True, cache=True)
def gated_rms_norm(x, z, weight, eps, out):
    """N3 per value head: out = weight * (x * rsqrt(mean(x^2) + eps)) * silu(z).
    x, z, out: [rows, Hv, dv]; weight: [dv] (plain, never +1 shifted)."""
    eps32 = np.float32(eps)
    dim = x.shape[2]
    for r in range(x.shape[0]):
        for h in range(x.shape[1]):
            sum_sq = np.float32(0.0)
            for j in range(dim):
                sum_sq += x[r, h, j] * x[r, h, j]
            inv = np.float32(1.0) / np.sqrt(sum_sq / np.float32(dim) + eps32)
            for j in range(dim):
                out[r, h, j] = weight[j] * (x[r, h, j] * inv) * _silu(z[r, h, j])


@njit(nogil=True, cache=True)
def split_query_gate(qg, num_heads, head_dim, q_out, gate_out):
    """Gated attention q_proj output qg: [rows, nh * 2 * hd], per head [query | gate].
    q_out: [rows, nh, hd]; gate_out: [rows, nh * hd]."""
    for r in range(qg.shape[0]):
        for h in range(num_heads):
            base = h * 2 * head_dim
            for d in range(head_dim):
                q_out[r, h, d] = qg[r, base + d]
                gate_out[r, h * head_dim + d] = qg[r, base + head_dim + d]


@njit(nogil=True, cache=True)
def sigmoid_gate_mul(attn, gate, out):
    """out = attn * sigmoid(gate), all [rows, nh * hd] (out may be attn)."""
    for r in range(attn.shape[0]):
        for c in range(attn.shape[1]):
            out[r, c] = attn[r, c] * _sigmoid(gate[r, c])


@njit(nogil=True, cache=True)
def shared_expert_add(h, routed, shared, gate):
    """h += routed + shared * sigmoid(gate) in place: h, routed, shared [rows, H], gate
    [rows, 1]; each product and sum rounded to float32 in that order (the bits of
    sigmoid_gate_mul, then routed + shared, then h + that)."""
    for r in range(h.shape[0]):
        s = _sigmoid(gate[r, 0])
        for c in range(h.shape[1]):
            gated = np.float32(shared[r, c] * s)
            h[r, c] = h[r, c] + np.float32(routed[r, c] + gated)
