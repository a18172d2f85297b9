"""The DFlash / DFlash2 drafter's own ops (docs/DFLASH.md), CUDA twins of
tf_async/backend/cpu/dflash.py with the same signatures, and their launchers (the drafter's
kernels keep their launch geometry beside them; each launcher checks dtypes and shapes first).

    grouped_conv    grid (B,), threads over H: out[t, h] = sum_o base[o, h] x[t-o, h]
                    + taps[t, o, h // group_size] x[t-o, h], zero before the block
    block_attention grid (B, nh): scores into a scratch row, max, exp and sum, then
                    out[d] = sum_t p[t] v[t, d] / sum (keys in ascending order)
    topk_rows       grid (R, 1): k block-wide passes, each the next largest (value desc, id
                    asc); with SPLIT_TOPK, grid (R, S) over S segments of each row, then
                    grid (R,) over the segments' candidates: the same ids and values
    select_chain    one block: row by row, each candidate's score in a thread, the first best
                    picked, the pick is the next row's predecessor
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.env import SIMULATOR, cuda, kernel

CONV_THREADS = 128
ATTN_THREADS = 128
TOPK_THREADS = 256
CHAIN_THREADS = 32  # >= top_k
MAX_TOP_K = CHAIN_THREADS
# Two-phase top-k (on since session 28): a row's vocabulary in up to TOPK_SEGMENTS segments
# of at least TOPK_SEGMENT_MIN ids, a block each, then a block a row merges their candidates
# (the same ids and values as the one-pass kernel: tests/test_gpu_dflash.py runs both). The
# one-pass kernel gives a 248k vocabulary's 16 rows 16 blocks: 3.55 ms of a 27B DFlash2 round
# (one H100); with the split, DFlash2 with every draft accepted went from 3.83x to 4.05x plain.
SPLIT_TOPK = True
TOPK_SEGMENTS = 64
TOPK_SEGMENT_MIN = 1024


# ---- grouped dynamic convolution ---------------------------------------------------------
@kernel
def _grouped_conv(x, taps, base, group_size, out):
    t = cuda.blockIdx.x
    for h in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        g = h // group_size
        acc = np.float32(0.0)
        for o in range(base.shape[0]):
            if t >= o:
                v = x[t - o, h]
                acc = acc + base[o, h] * v
                acc = acc + taps[t, o, g] * v
        out[t, h] = acc


# ---- block attention ---------------------------------------------------------------------
@cuda.jit(device=True)
def _block_reduce(buf, value, is_max):
    # every thread's value -> the block's max (is_max) or sum, in a fixed tree order
    tid = cuda.threadIdx.x
    buf[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            if is_max:
                buf[tid] = max(buf[tid], buf[tid + stride])
            else:
                buf[tid] = buf[tid] + buf[tid + stride]
        cuda.syncthreads()
        stride //= 2
    result = buf[0]
    cuda.syncthreads()
    return result


@kernel
def _block_attention(q, keys, values, visible, sm_scale, scratch, out):
    b = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    num_keys = keys.shape[0]
    head_dim = q.shape[2]
    kvh = h // (q.shape[1] // keys.shape[1])
    buf = cuda.shared.array(ATTN_THREADS, np.float32)
    local = np.float32(-np.inf)
    for t in range(tid, num_keys, cuda.blockDim.x):
        s = np.float32(-np.inf)
        if visible[b, t]:
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot = dot + q[b, h, d] * keys[t, kvh, d]
            s = dot * sm_scale
        scratch[b, h, t] = s
        local = max(local, s)
    top = _block_reduce(buf, local, True)
    part = np.float32(0.0)
    for t in range(tid, num_keys, cuda.blockDim.x):
        p = np.float32(0.0)
        if visible[b, t]:
            p = np.float32(math.exp(scratch[b, h, t] - top))
        scratch[b, h, t] = p
        part += p
    total = _block_reduce(buf, part, False)
    for d in range(tid, head_dim, cuda.blockDim.x):
        acc = np.float32(0.0)
        for t in range(num_keys):
            acc = acc + scratch[b, h, t] * values[t, kvh, d]
        out[b, h, d] = acc / total


# ---- candidate selector ------------------------------------------------------------------
@cuda.jit(device=True)
def _better(v, i, best_v, best_i):
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit(device=True)
def _block_best(vals, ids, best_v, best_i):
    """The block's best (value desc, id asc) of each thread's (best_v, best_i), in vals[0], ids[0]."""
    tid = cuda.threadIdx.x
    vals[tid] = best_v
    ids[tid] = best_i
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride and _better(vals[tid + stride], ids[tid + stride], vals[tid], ids[tid]):
            vals[tid] = vals[tid + stride]
            ids[tid] = ids[tid + stride]
        cuda.syncthreads()
        stride //= 2


@kernel
def _topk_segments(logits, top_k, segment, seg_ids, seg_values):
    # block (row, s): the top_k of ids [s * segment, (s + 1) * segment), value desc, id asc, a
    # block-wide pass each; a segment with fewer (or NaNs) ends in (vocab, -inf). One segment
    # of the whole vocabulary is the one-pass top-k
    row, seg = cuda.blockIdx.x, cuda.blockIdx.y
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    first = seg * segment
    last = min(vocab, first + segment)
    vals = cuda.shared.array(TOPK_THREADS, np.float32)
    ids = cuda.shared.array(TOPK_THREADS, np.int64)
    prev_v = np.float32(np.inf)
    prev_i = np.int64(-1)
    for slot in range(top_k):
        best_v = np.float32(-np.inf)
        best_i = np.int64(vocab)
        for i in range(first + tid, last, cuda.blockDim.x):
            v = logits[row, i]
            after = v < prev_v or (v == prev_v and i > prev_i)
            if after and _better(v, i, best_v, best_i):
                best_v = v
                best_i = i
        _block_best(vals, ids, best_v, best_i)
        prev_v = vals[0]
        prev_i = ids[0]
        if tid == 0:
            seg_ids[row, seg, slot] = prev_i
            seg_values[row, seg, slot] = prev_v
        cuda.syncthreads()


@kernel
def _topk_merge(seg_ids, seg_values, top_k, vocab, out_ids, out_values):
    # block row: the top_k of its segments' candidates (the row's top_k is among them), in
    # the same order; a sentinel (vocab, -inf) loses to every id of the row
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    count = seg_ids.shape[1] * seg_ids.shape[2]
    vals = cuda.shared.array(TOPK_THREADS, np.float32)
    ids = cuda.shared.array(TOPK_THREADS, np.int64)
    prev_v = np.float32(np.inf)
    prev_i = np.int64(-1)
    for slot in range(top_k):
        best_v = np.float32(-np.inf)
        best_i = vocab
        for c in range(tid, count, cuda.blockDim.x):
            v = seg_values[row, c // seg_ids.shape[2], c % seg_ids.shape[2]]
            i = seg_ids[row, c // seg_ids.shape[2], c % seg_ids.shape[2]]
            after = v < prev_v or (v == prev_v and i > prev_i)
            if after and _better(v, i, best_v, best_i):
                best_v = v
                best_i = i
        _block_best(vals, ids, best_v, best_i)
        prev_v = vals[0]
        prev_i = ids[0]
        if tid == 0:
            out_ids[row, slot] = prev_i
            out_values[row, slot] = prev_v
        cuda.syncthreads()


@kernel
def _select_chain(cand_ids, cand_values, projected, predecessor, successor, anchor_id, out_path):
    tid = cuda.threadIdx.x
    top_k = cand_ids.shape[1]
    rank = projected.shape[1]
    scores = cuda.shared.array(CHAIN_THREADS, np.float32)
    prev = cuda.shared.array(1, np.int64)
    if tid == 0:
        prev[0] = anchor_id
    cuda.syncthreads()
    for t in range(cand_ids.shape[0]):
        if tid < top_k:
            c = cand_ids[t, tid]
            pair = np.float32(0.0)
            for i in range(rank):
                pair = pair + (predecessor[prev[0], i] * projected[t, i]) * successor[c, i]
            scores[tid] = cand_values[t, tid] + pair
        cuda.syncthreads()
        if tid == 0:
            best = 0
            for j in range(1, top_k):
                if scores[j] > scores[best]:
                    best = j
            prev[0] = cand_ids[t, best]
            out_path[t] = cand_ids[t, best]
        cuda.syncthreads()


# ---- launchers ---------------------------------------------------------------------------
def _go(fn, grid, block, stream, *args) -> None:
    if stream is None:
        fn[grid, block](*args)
    else:
        fn[grid, block, stream](*args)


def _check(name, array, dtype, ndim) -> None:
    if str(array.dtype) != dtype or array.ndim != ndim:
        raise ValueError(f"dflash {name}: expected {dtype} with {ndim} axes, got "
                         f"{array.dtype} {tuple(array.shape)}")


def grouped_conv(x, taps, base, group_size, out, stream=None) -> None:
    """x [B, H], taps [B, K, G], base [K, H], out [B, H], all f32; G * group_size == H."""
    for name, array, ndim in (("x", x, 2), ("taps", taps, 3), ("base", base, 2), ("out", out, 2)):
        _check(name, array, "float32", ndim)
    rows, hidden = x.shape
    if (tuple(taps.shape) != (rows, base.shape[0], hidden // group_size) or hidden % group_size
            or base.shape[1] != hidden or tuple(out.shape) != (rows, hidden)):
        raise ValueError(f"dflash grouped_conv: shapes x {x.shape} taps {taps.shape} base "
                         f"{base.shape} out {out.shape} group_size {group_size} do not fit")
    if rows:
        _go(_grouped_conv, rows, CONV_THREADS, stream, x, taps, base, int(group_size), out)


def attention_scratch_shape(rows: int, num_heads: int, num_keys: int) -> tuple[int, int, int]:
    return rows, num_heads, num_keys


def block_attention(q, keys, values, visible, sm_scale, scratch, out, stream=None) -> None:
    """q [B, nh, hd], keys/values [T, nkv, hd], visible [B, T] uint8, scratch [B, nh, T],
    out [B, nh, hd] (f32 but visible); nh a multiple of nkv; every row sees a key."""
    for name, array, ndim in (("q", q, 3), ("keys", keys, 3), ("values", values, 3),
                              ("scratch", scratch, 3), ("out", out, 3)):
        _check(name, array, "float32", ndim)
    _check("visible", visible, "uint8", 2)
    rows, num_heads, head_dim = q.shape
    num_keys, num_kv = keys.shape[:2]
    if (num_heads % num_kv or keys.shape[2] != head_dim or tuple(values.shape) != tuple(keys.shape)
            or tuple(visible.shape) != (rows, num_keys) or tuple(out.shape) != tuple(q.shape)
            or tuple(scratch.shape) != attention_scratch_shape(rows, num_heads, num_keys)):
        raise ValueError(f"dflash block_attention: shapes q {q.shape} keys {keys.shape} values "
                         f"{values.shape} visible {visible.shape} scratch {scratch.shape} do not fit")
    if rows:
        _go(_block_attention, (rows, num_heads), ATTN_THREADS, stream, q, keys, values, visible,
            np.float32(sm_scale), scratch, out)


def topk_segments(vocab: int) -> tuple[int, int]:
    """(segments, ids a segment) of the two-phase top-k over a vocabulary."""
    count = max(1, min(TOPK_SEGMENTS, vocab // TOPK_SEGMENT_MIN))
    return count, -(-vocab // count)


def topk_rows(logits, top_k, out_ids, out_values, stream=None, scratch=None) -> None:
    """logits [R, V] f32 -> out_ids [R, k] int64, out_values [R, k] f32 (value desc, id asc).
    scratch: (ids [R, S, k] int64, values [R, S, k] f32) for S = topk_segments(V)[0]: the
    two-phase kernels (same results); None: the one-pass kernel."""
    _check("logits", logits, "float32", 2)
    _check("out_ids", out_ids, "int64", 2)
    _check("out_values", out_values, "float32", 2)
    rows, vocab = logits.shape
    if not 0 < top_k <= vocab or tuple(out_ids.shape) != (rows, top_k) or tuple(out_values.shape) != (rows, top_k):
        raise ValueError(f"dflash topk_rows: top_k {top_k} of {vocab}, outputs {out_ids.shape} "
                         f"{out_values.shape}")
    if not rows:
        return
    if scratch is None:  # one segment, its candidates the result
        _go(_topk_segments, (rows, 1), TOPK_THREADS, stream, logits, int(top_k), np.int64(vocab),
            out_ids.reshape(rows, 1, top_k), out_values.reshape(rows, 1, top_k))
        return
    seg_ids, seg_values = scratch
    segments, segment = topk_segments(vocab)
    _check("scratch ids", seg_ids, "int64", 3)
    _check("scratch values", seg_values, "float32", 3)
    if tuple(seg_ids.shape) != (rows, segments, top_k) or tuple(seg_values.shape) != (rows, segments, top_k):
        raise ValueError(f"dflash topk_rows: scratch {seg_ids.shape} {seg_values.shape}, expected "
                         f"{(rows, segments, top_k)}")
    _go(_topk_segments, (rows, segments), TOPK_THREADS, stream, logits, int(top_k), np.int64(segment),
        seg_ids, seg_values)
    _go(_topk_merge, rows, TOPK_THREADS, stream, seg_ids, seg_values, int(top_k), np.int64(vocab),
        out_ids, out_values)


def select_chain(cand_ids, cand_values, projected, predecessor, successor, anchor_id, out_path,
                 stream=None) -> None:
    """cand_ids [R, k] int64, cand_values [R, k] f32, projected [R, r], predecessor/successor
    [V, r] f32 -> out_path [R] int64; k <= MAX_TOP_K; ids within the codebooks."""
    _check("cand_ids", cand_ids, "int64", 2)
    _check("out_path", out_path, "int64", 1)
    for name, array in (("cand_values", cand_values), ("projected", projected),
                        ("predecessor", predecessor), ("successor", successor)):
        _check(name, array, "float32", 2)
    rows, top_k = cand_ids.shape
    vocab, rank = predecessor.shape
    if (not 0 < top_k <= MAX_TOP_K or tuple(cand_values.shape) != (rows, top_k)
            or tuple(projected.shape) != (rows, rank) or tuple(successor.shape) != (vocab, rank)
            or tuple(out_path.shape) != (rows,) or not 0 <= anchor_id < vocab):
        raise ValueError(f"dflash select_chain: candidates {cand_ids.shape} projected "
                         f"{projected.shape} codebooks {predecessor.shape} anchor {anchor_id}")
    if rows:
        _go(_select_chain, 1, CHAIN_THREADS, stream, cand_ids, cand_values, projected,
            predecessor, successor, np.int64(anchor_id), out_path)


__all__ = ["SIMULATOR", "attention_scratch_shape", "block_attention", "grouped_conv",
           "select_chain", "topk_rows"]
