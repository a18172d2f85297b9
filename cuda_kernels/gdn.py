"""Numba CUDA twins of tf_async/backend/cpu/gdn.py (same launcher names and signatures, plus
an optional `stream`). Arguments are device arrays (CuPy or Numba) or, in the simulator and
in tests, host NumPy arrays. Imports numba/numpy/math only.

Layout of the work:
- conv: one thread per channel and stream; it walks the stream's rows in order and carries
  its channel of the conv state, so rows of one stream see exactly the history a one-row
  call would; streams' runs of rows go to different blocks.
- delta rule: one thread block per (stream, v-head, 32 value columns), the block's part of
  the fp32 state in registers (a warp per 32 rows of dk); rows of the stream are processed
  sequentially inside the block; a column's dot products over dk are summed per warp, then
  across warps in a fixed order (not the CPU twin's order: the twins agree within a bound,
  and every GPU path has the same bits). For batches, the rows of one stream must be
  contiguous in the round (the engine lays rows out stream by stream): the block of row r
  is active only when r starts its stream's run of rows (row 0, or row_seq[r-1] != row_seq[r]).
  q and k of the current row go through shared memory.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from cuda_kernels.env import add_rn, kernel, mul_rn, warp_sum

MAX_HEAD_K_DIM = 256  # shared-memory q/k rows of the delta-rule block
MAX_CONV_HISTORY = 8  # K - 1 of a frozen lane's conv history held by a thread
CONV_RUN_BLOCKS = 64  # grid rows of a batched conv launch: streams' runs of rows in parallel
_ELEMENTWISE_THREADS = 128


@cuda.jit(device=True, inline=True)
def _silu(x):
    return x / (float32(1.0) + math.exp(-x))


@cuda.jit(device=True, inline=True)
def _sigmoid(x):
    return float32(1.0) / (float32(1.0) + math.exp(-x))


def _blocks(count: int, threads: int) -> int:
    return max(1, (count + threads - 1) // threads)


# ---------------------------------------------------------------------------------------
# causal conv


@cuda.jit(device=True, inline=True)
def _conv_channel_step(state, c, weight, x_val):
    num_hist = state.shape[0]
    acc = float32(0.0)
    for j in range(num_hist):
        acc += weight[c, j] * state[j, c]
    acc += weight[c, num_hist] * x_val
    for j in range(num_hist - 1):
        state[j, c] = state[j + 1, c]
    if num_hist > 0:
        state[num_hist - 1, c] = x_val
    return _silu(acc)


@cuda.jit(device=True, inline=True)
def _conv_history_step(history, num_hist, c, weight, x_val):
    """`_conv_channel_step` on a thread's copy of channel c's history (a frozen lane)."""
    acc = float32(0.0)
    for j in range(num_hist):
        acc += weight[c, j] * history[j]
    acc += weight[c, num_hist] * x_val
    for j in range(num_hist - 1):
        history[j] = history[j + 1]
    if num_hist > 0:
        history[num_hist - 1] = x_val
    return _silu(acc)


@kernel
def _conv_rows_kernel(x, conv_state, weight, out):
    c = cuda.grid(1)
    if c >= x.shape[1]:
        return
    for t in range(x.shape[0]):
        out[t, c] = _conv_channel_step(conv_state, c, weight, x[t, c])


@kernel
def _conv_batch_kernel(x, conv_states, weight, row_seq, frozen, out):
    # grid (channel blocks, CONV_RUN_BLOCKS or fewer): block y takes the runs of rows (a
    # stream's rows, contiguous) that start at rows y, y + gridDim.y, ...; a thread walks its
    # channel through a run in order, as one thread walked every row before.
    c = cuda.grid(1)
    if c >= x.shape[1]:
        return
    num_hist = conv_states.shape[1]
    history = cuda.local.array(MAX_CONV_HISTORY, float32)
    for first in range(cuda.blockIdx.y, x.shape[0], cuda.gridDim.y):
        slot = row_seq[first]
        if first > 0 and row_seq[first - 1] == slot:
            continue  # not the first row of its stream's run
        end = first + 1
        while end < x.shape[0] and row_seq[end] == slot:
            end += 1
        if frozen[slot]:
            for j in range(num_hist):
                history[j] = conv_states[slot, j, c]
            for r in range(first, end):
                out[r, c] = _conv_history_step(history, num_hist, c, weight, x[r, c])
        else:
            for r in range(first, end):
                out[r, c] = _conv_channel_step(conv_states[slot], c, weight, x[r, c])


def causal_conv1d_step(x, conv_state, weight, out, stream=0) -> None:
    """One token of one stream. x, out: [C]; conv_state: [K-1, C]; weight: [C, K]."""
    num_channels = x.shape[0]
    _conv_rows_kernel[_blocks(num_channels, _ELEMENTWISE_THREADS), _ELEMENTWISE_THREADS, stream](
        x.reshape(1, num_channels), conv_state, weight, out.reshape(1, num_channels))


def causal_conv1d_rows(x, conv_state, weight, out, stream=0) -> None:
    """Rows of one stream in time order. x, out: [T, C]; conv_state: [K-1, C] carried."""
    threads = _ELEMENTWISE_THREADS
    _conv_rows_kernel[_blocks(x.shape[1], threads), threads, stream](x, conv_state, weight, out)


def causal_conv1d_batch(x, conv_states, weight, row_seq, frozen, out, stream=0) -> None:
    """Rows of many streams. conv_states: [slots, K-1, C]; row_seq: [rows] int32; frozen:
    [slots] uint8 (a frozen slot's rows run from a thread's copy of its history; its state
    stays as it was). The rows of one stream must be contiguous and in time order (as for
    `gated_delta_rule_batch`): its run is one thread's work a channel, other runs go in
    parallel."""
    if conv_states.shape[1] > MAX_CONV_HISTORY:
        raise ValueError(f"causal conv: kernel size {conv_states.shape[1] + 1} > "
                         f"{MAX_CONV_HISTORY + 1}")
    threads = _ELEMENTWISE_THREADS
    if x.shape[0] == 0:
        return
    grid = (_blocks(x.shape[1], threads), min(x.shape[0], CONV_RUN_BLOCKS))
    _conv_batch_kernel[grid, threads, stream](x, conv_states, weight, row_seq, frozen, out)


# ---------------------------------------------------------------------------------------
# gates and q/k normalisation


@cuda.jit(device=True, inline=True)
def _softplus(x):
    if x > float32(20.0):
        return x
    return math.log1p(math.exp(x))


@kernel
def _gates_kernel(a, b, a_log, dt_bias, g_out, beta_out):
    idx = cuda.grid(1)
    num_heads = a.shape[1]
    if idx >= a.shape[0] * num_heads:
        return
    r = idx // num_heads
    h = idx % num_heads
    decay_rate = math.exp(float32(a_log[h]))
    g_out[r, h] = -decay_rate * _softplus(a[r, h] + float32(dt_bias[h]))
    beta_out[r, h] = _sigmoid(b[r, h])


def gdn_gates(a, b, a_log, dt_bias, g_out, beta_out, stream=0) -> None:
    """g_out = -exp(A_log) * softplus(a + dt_bias); beta_out = sigmoid(b). [rows, Hv]."""
    count = a.shape[0] * a.shape[1]
    threads = _ELEMENTWISE_THREADS
    _gates_kernel[_blocks(count, threads), threads, stream](a, b, a_log, dt_bias, g_out, beta_out)


# The per-head norms run a warp a (row, head): lane l takes elements l, l + 32, ... of the
# head, sums its squares in that order, and warp_sum adds the lanes' sums (a fixed order).


@cuda.jit(device=True, inline=True)
def _l2_scale_head(src, r, col0, dim, eps, scale, dst, head, lane):
    part = float32(0.0)
    for i in range(lane, dim, 32):
        x = src[r, col0 + i]
        part += x * x
    inv = float32(1.0) / math.sqrt(warp_sum(part) + eps)
    for i in range(lane, dim, 32):
        dst[r, head, i] = src[r, col0 + i] * inv * scale


@kernel
def _qk_l2norm_kernel(mixed, num_k_heads, head_k_dim, eps, q_scale, q_out, k_out):
    idx, lane = cuda.grid(1) // 32, cuda.threadIdx.x % 32
    if idx >= mixed.shape[0] * num_k_heads:
        lane = head_k_dim  # a warp past the last head: it only joins the shuffles
        idx = 0
    r = idx // num_k_heads
    hk = idx % num_k_heads
    _l2_scale_head(mixed, r, hk * head_k_dim, head_k_dim, eps, q_scale, q_out, hk, lane)
    _l2_scale_head(mixed, r, (num_k_heads + hk) * head_k_dim, head_k_dim, eps, float32(1.0),
                   k_out, hk, lane)


def gdn_qk_l2norm(mixed, num_k_heads, head_k_dim, eps, q_scale, q_out, k_out, stream=0) -> None:
    """q_out, k_out: [rows, Hk, dk] L2-normalised q (times q_scale) and k of mixed [rows, C]."""
    count = mixed.shape[0] * num_k_heads * 32
    threads = _ELEMENTWISE_THREADS
    _qk_l2norm_kernel[_blocks(count, threads), threads, stream](
        mixed, num_k_heads, head_k_dim, np.float32(eps), np.float32(q_scale), q_out, k_out)


# ---------------------------------------------------------------------------------------
# gated delta rule


# A block owns 32 value columns (one a lane) of one v-head of one stream and keeps that
# part of the state in registers for all the stream's rows of the round: warp w holds rows
# i = 32w .. 32w + 31 of the columns (DELTA_ROWS_A_WARP values a thread), so the state is read
# from memory once and written once a round, with every load of a warp coalesced. Per row, a
# column's dot products over i (k . decayed state, q . updated state) are summed in a fixed
# order whatever the rows or streams of the round: each warp over its 32 i ascending, then
# the warps' partial sums in warp order. Grid (rows, Hv, ceil(dv / 32)): the block of row r
# works only when r starts its stream's run of rows.
DELTA_ROWS_A_WARP = 32
MAX_DELTA_WARPS = MAX_HEAD_K_DIM // DELTA_ROWS_A_WARP


@cuda.jit(device=True, inline=True)
def _delta_rows(q, k, v, g, beta, head_state, keep, r0, r1, h, hk, out):
    """Rows r0 .. r1 - 1 of head h of one stream; head_state: [dk, dv] (written back unless
    `keep` is False: a frozen lane, whose state is read and never written)."""
    q_sh = cuda.shared.array(MAX_HEAD_K_DIM, float32)
    k_sh = cuda.shared.array(MAX_HEAD_K_DIM, float32)
    red_a = cuda.shared.array((MAX_DELTA_WARPS, 32), float32)
    red_o = cuda.shared.array((MAX_DELTA_WARPS, 32), float32)
    s = cuda.local.array(DELTA_ROWS_A_WARP, float32)
    tid, lane, warp = cuda.threadIdx.x, cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    warps = cuda.blockDim.x // 32
    head_k_dim, head_v_dim = q.shape[2], v.shape[2]
    # Indices as unsigned integers: Numba adds no negative-index wraparound to their loads
    # (with it, each of the 2 x 32 state accesses of a thread cost ~15 instructions of 64-bit
    # address arithmetic and the kernel 174 registers).
    col = np.uint64(cuda.blockIdx.z * 32 + lane)
    live = col < head_v_dim
    base = np.uint64(warp * DELTA_ROWS_A_WARP)
    rows_here = min(np.uint64(DELTA_ROWS_A_WARP), np.uint64(max(head_k_dim - warp * DELTA_ROWS_A_WARP, 0)))
    for i in range(DELTA_ROWS_A_WARP):
        s[i] = head_state[base + np.uint64(i), col] if live and i < rows_here else float32(0.0)
    for r in range(r0, r1):
        cuda.syncthreads()  # the previous row is done with q_sh, k_sh and red_o
        for i in range(tid, head_k_dim, cuda.blockDim.x):
            q_sh[i] = q[r, hk, i]
            k_sh[i] = k[r, hk, i]
        cuda.syncthreads()
        alpha = math.exp(g[r, h])
        part = float32(0.0)
        for i in range(DELTA_ROWS_A_WARP):
            if i < rows_here:
                decayed = s[i] * alpha
                s[i] = decayed
                part += decayed * k_sh[base + np.uint64(i)]
        red_a[warp, lane] = part
        cuda.syncthreads()
        acc = red_a[0, lane]
        for w in range(1, warps):
            acc += red_a[w, lane]
        v_j = v[r, h, col] if live else float32(0.0)
        beta_err = beta[r, h] * (v_j - acc)
        part = float32(0.0)
        for i in range(DELTA_ROWS_A_WARP):
            if i < rows_here:
                written = s[i] + k_sh[base + np.uint64(i)] * beta_err
                s[i] = written
                part += written * q_sh[base + np.uint64(i)]
        red_o[warp, lane] = part
        cuda.syncthreads()
        if warp == 0 and live:
            o_j = red_o[0, lane]
            for w in range(1, warps):
                o_j += red_o[w, lane]
            out[r, h, col] = o_j
    if keep and live:
        for i in range(DELTA_ROWS_A_WARP):
            if i < rows_here:
                head_state[base + np.uint64(i), col] = s[i]


@kernel
def _delta_stream_kernel(q, k, v, g, beta, state, out):
    h = cuda.blockIdx.y
    hk = h // (state.shape[0] // q.shape[1])
    _delta_rows(q, k, v, g, beta, state[h], True, 0, q.shape[0], h, hk, out)


@kernel
def _delta_batch_kernel(q, k, v, g, beta, states, row_seq, frozen, out):
    first_row = cuda.blockIdx.x
    h = cuda.blockIdx.y
    slot = row_seq[first_row]
    if first_row > 0 and row_seq[first_row - 1] == slot:
        return  # not the first row of its stream: that stream's block does this row
    hk = h // (states.shape[1] // q.shape[1])
    end = first_row + 1
    while end < q.shape[0] and row_seq[end] == slot:
        end += 1
    _delta_rows(q, k, v, g, beta, states[slot, h], frozen[slot] == 0, first_row, end, h, hk, out)


def _delta_launch(q, state_shape) -> tuple[int, int]:
    """(column blocks, threads) of a delta-rule launch: 32 value columns a block, a warp per 32
    rows of dk."""
    num_v_heads, head_k_dim, head_v_dim = state_shape[-3:]
    if head_k_dim > MAX_HEAD_K_DIM or q.shape[2] != head_k_dim:
        raise ValueError(f"gated delta rule: head_k_dim {q.shape[2]} vs state {head_k_dim} "
                         f"(max {MAX_HEAD_K_DIM})")
    if num_v_heads % q.shape[1]:
        raise ValueError(f"gated delta rule: Hv={num_v_heads} not a multiple of Hk={q.shape[1]}")
    return _blocks(head_v_dim, 32), 32 * _blocks(head_k_dim, DELTA_ROWS_A_WARP)


def gated_delta_rule(q, k, v, g, beta, state, out, stream=0) -> None:
    """Rows of one stream. q, k: [T, Hk, dk]; v, out: [T, Hv, dv]; g, beta: [T, Hv];
    state: [Hv, dk, dv] float32. Blocks per (v-head, 32 value columns), rows in order."""
    column_blocks, threads = _delta_launch(q, state.shape)
    if q.shape[0] == 0:
        return
    _delta_stream_kernel[(1, state.shape[0], column_blocks), threads, stream](
        q, k, v, g, beta, state, out)


def gated_delta_rule_column_parallel(q, k, v, g, beta, state, out, stream=0) -> None:
    """The multi-row ("chunked") prompt form; on the GPU it is the same kernel as
    `gated_delta_rule`: blocks already split the value columns (see the CPU docstring)."""
    gated_delta_rule(q, k, v, g, beta, state, out, stream)


def gated_delta_rule_batch(q, k, v, g, beta, states, row_seq, frozen, out, stream=0) -> None:
    """Rows of many streams; states: [slots, Hv, dk, dv]; row_seq: [rows] int32; frozen:
    [slots] uint8 (a frozen slot's rows run from the registers' copy of its state, and its
    state stays as it was). The rows of one stream must be contiguous and in time order."""
    column_blocks, threads = _delta_launch(q, states.shape)
    if q.shape[0] == 0:
        return
    _delta_batch_kernel[(q.shape[0], states.shape[1], column_blocks), threads, stream](
        q, k, v, g, beta, states, row_seq, frozen, out)


# ---------------------------------------------------------------------------------------
# output norm and gates


@kernel
def _gated_rms_norm_kernel(x, z, weight, eps, out):
    idx, lane = cuda.grid(1) // 32, cuda.threadIdx.x % 32
    num_heads, dim = x.shape[1], x.shape[2]
    if idx >= x.shape[0] * num_heads:
        lane = dim  # a warp past the last head: it only joins the shuffles
        idx = 0
    r = idx // num_heads
    h = idx % num_heads
    part = float32(0.0)
    for j in range(lane, dim, 32):
        part += x[r, h, j] * x[r, h, j]
    inv = float32(1.0) / math.sqrt(warp_sum(part) / float32(dim) + eps)
    for j in range(lane, dim, 32):
        out[r, h, j] = weight[j] * (x[r, h, j] * inv) * _silu(z[r, h, j])


def gated_rms_norm(x, z, weight, eps, out, stream=0) -> None:
    """N3: out = weight * (x * rsqrt(mean(x^2) + eps)) * silu(z); [rows, Hv, dv]. A warp a
    (row, head)."""
    count = x.shape[0] * x.shape[1] * 32
    threads = _ELEMENTWISE_THREADS
    _gated_rms_norm_kernel[_blocks(count, threads), threads, stream](
        x, z, weight, np.float32(eps), out)


@kernel
def _split_query_gate_kernel(qg, num_heads, head_dim, q_out, gate_out):
    idx = cuda.grid(1)
    width = num_heads * head_dim
    if idx >= qg.shape[0] * width:
        return
    r = idx // width
    h = (idx % width) // head_dim
    d = idx % head_dim
    q_out[r, h, d] = qg[r, h * 2 * head_dim + d]
    gate_out[r, h * head_dim + d] = qg[r, h * 2 * head_dim + head_dim + d]


def split_query_gate(qg, num_heads, head_dim, q_out, gate_out, stream=0) -> None:
    """qg: [rows, nh*2*hd] (per head [query | gate]) -> q_out [rows, nh, hd], gate_out [rows, nh*hd]."""
    count = qg.shape[0] * num_heads * head_dim
    threads = _ELEMENTWISE_THREADS
    _split_query_gate_kernel[_blocks(count, threads), threads, stream](
        qg, num_heads, head_dim, q_out, gate_out)


@kernel
def _sigmoid_gate_mul_kernel(attn, gate, out):
    idx = cuda.grid(1)
    width = attn.shape[1]
    if idx >= attn.shape[0] * width:
        return
    r = idx // width
    c = idx % width
    out[r, c] = attn[r, c] * _sigmoid(gate[r, c])


def sigmoid_gate_mul(attn, gate, out, stream=0) -> None:
    """out = attn * sigmoid(gate), [rows, nh*hd]."""
    count = attn.shape[0] * attn.shape[1]
    threads = _ELEMENTWISE_THREADS
    _sigmoid_gate_mul_kernel[_blocks(count, threads), threads, stream](attn, gate, out)


@kernel
def _shared_expert_add_kernel(h, routed, shared, gate):
    idx = cuda.grid(1)
    width = h.shape[1]
    if idx >= h.shape[0] * width:
        return
    r = idx // width
    c = idx % width
    gated = mul_rn(shared[r, c], _sigmoid(gate[r, 0]))  # sigmoid_gate_mul's product, rounded
    h[r, c] = add_rn(h[r, c], add_rn(routed[r, c], gated))


def shared_expert_add(h, routed, shared, gate, stream=0) -> None:
    """h += routed + shared * sigmoid(gate) in place: h, routed, shared [rows, H], gate [rows, 1].
    The bits of sigmoid_gate_mul(shared, gate broadcast), then routed + shared, then h + that
    (each step rounded to float32: no FMA contraction)."""
    count = h.shape[0] * h.shape[1]
    threads = _ELEMENTWISE_THREADS
    _shared_expert_add_kernel[_blocks(count, threads), threads, stream](h, routed, shared, gate)
