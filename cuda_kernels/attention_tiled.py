"""Prompt attention with the keys shared by a block of query rows: the partial kernel of
cuda_kernels/attention.py for launches of many rows, giving every row the same partials (and so,
through the same combine kernel, the same bits) as that kernel.

Why: attention.py's partial kernel gives each (row, head group, chunk) its own block, so a
prompt step of n rows reads each key up to n times from L2 and spends a barrier-bound loop on
every 32 keys of every row. Here a block takes up to `rows_blk` consecutive rows and
`heads_blk` heads: every key tile (KEY_TILE positions) is loaded into shared memory once and
serves all of them.

Per row the arithmetic is attention.py's, step for step: the row's chunks (chunk_keys of its own
key count) cut into tiles from the chunk start; a score is the fma chain over d = lane,
lane + 32, ... of q * k, then the butterfly sum over the 32 lanes, times sm_scale; the online
softmax of the tile in one warp (lane j: key j; max and sum butterflies; p = exp(s - m'),
corr = exp(m - m')); acc_d = acc_d * corr, then fma(p_j, v_jd, acc_d) over the tile's keys
ascending, with v = 0 for keys past the chunk's end (attention.py never loads them); at a
chunk's end (acc, m, l) go to the same scratch slots. A row's state starts over at each chunk
start (acc 0, m -inf, l 0), as attention.py starts each chunk's block.

Rows of a block that belong to different sequences are served in one pass a sequence (the
rows' own block-table rows), so any launch may use this kernel; it pays off when rows share a
sequence (prompt steps). Grid: (row blocks, head blocks), ATTN_THREADS threads.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels import attention as _at
from cuda_kernels.env import SIMULATOR, cuda, kernel

ROWS_BLK_MAX = 8
_SMEM_Q_FLOATS = 4096  # rows_blk * heads_blk * max_hd at most (q in registers, sized by it)


def rows_per_block(heads_blk: int, max_hd: int) -> int:
    """Query rows a block (a compile-time constant of the kernel; never changes a row)."""
    return max(1, min(ROWS_BLK_MAX, _SMEM_Q_FLOATS // (heads_blk * max_hd)))


def _make_pass(kind: str, key_tile: int, max_hd: int, hd: int, heads_blk: int, rows_blk: int):
    load = _at._LOADERS[kind]
    threads, warps = _at.ATTN_THREADS, _at.ATTN_WARPS
    per_lane = max_hd // 32
    pairs = rows_blk * heads_blk  # (row, head) pairs of the block
    pairs_per_warp = (pairs + warps - 1) // warps  # warp w owns pairs w, w + warps, ...
    n_acc = (pairs * hd + threads - 1) // threads
    bfly_sums = _at._make_bfly_sums(key_tile, key_tile)
    neg_inf = _at.NEG_INF

    @cuda.jit(device=True)
    def tile_plan(pi, key0, seq, r0, row_seq, row_pos, n_rows, flags):
        # Lane 0 of the pair's warp: where the tile stands in the row's chunk.
        # flags[pi] = (in range, starts a chunk, keys of the chunk in the tile, ends the chunk,
        # chunk index, row); in range 0 for a pair past the block's rows or of another sequence.
        row = r0 + pi // heads_blk
        flags[pi, 0] = 0
        if pi < pairs and row < n_rows and row_seq[row] == seq:
            num_keys = row_pos[row] + 1
            if key0 < num_keys:
                chunk_len = _at._chunk_keys(num_keys)
                begin = (key0 // chunk_len) * chunk_len
                end = min(num_keys, begin + chunk_len)
                flags[pi, 0] = 1
                flags[pi, 1] = 1 if key0 == begin else 0
                flags[pi, 2] = min(end - key0, key_tile)
                flags[pi, 3] = 1 if key0 + key_tile >= end else 0
                flags[pi, 4] = key0 // chunk_len
                flags[pi, 5] = row

    @cuda.jit(device=True)
    def load_tile(kv_layer, k_scale, v_scale, bt_row, key0, max_keys, page_size, kv_head, ks, vs, slot_s):
        tid = cuda.threadIdx.x
        for j in range(tid, key_tile, threads):
            pos = key0 + j
            slot = np.int64(-1)
            if pos < max_keys:
                slot = np.int64(bt_row[pos // page_size]) * page_size + pos % page_size
            slot_s[j] = slot
        cuda.syncthreads()
        for e in range(tid, key_tile * max_hd, threads):
            j, d = e // max_hd, e % max_hd
            slot = slot_s[j]
            k_val, v_val = np.float32(0.0), np.float32(0.0)
            if slot >= 0 and d < hd:
                k_val = load(kv_layer, 0, slot, kv_head, d, k_scale)
                v_val = load(kv_layer, 1, slot, kv_head, d, v_scale)
            ks[j, d] = k_val
            vs[j, d] = v_val

    @cuda.jit(device=True)
    def softmax_pairs(ks, qr, sc, m_run, l_run, flags, ps, corr_s, sm_scale, scratch, head0, buf):
        # The warp's pairs: scores of the tile's keys, then attention.py's softmax step.
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        for k in range(pairs_per_warp):
            pi = warp + warps * k
            for j in range(key_tile):
                s = np.float32(0.0)
                for i in range(per_lane):
                    s = cuda.fma(qr[k * per_lane + i], ks[j, lane + 32 * i], s)
                sc[j] = s
            bfly_sums(sc, key_tile, buf)  # every thread of the block calls (uniform flow)
            live = pi < pairs and flags[min(pi, pairs - 1), 0] == 1
            score = neg_inf
            if live:
                if flags[pi, 1] == 1:  # a chunk starts: attention.py's fresh block
                    m_run[k], l_run[k] = neg_inf, np.float32(0.0)
                for j in range(key_tile):
                    if lane == j and j < flags[pi, 2]:
                        score = sc[j] * sm_scale
            m_old = m_run[k]
            m_new = max(m_old, _at._bfly_max(score, buf))
            p, corr = np.float32(0.0), np.float32(0.0)
            if m_new != neg_inf:
                if score != neg_inf:
                    p = np.float32(math.exp(score - m_new))
                if m_old != neg_inf:
                    corr = np.float32(math.exp(m_old - m_new))
            l_new = l_run[k] * corr + _at._bfly_sum(p, buf)
            if live:
                m_run[k], l_run[k] = m_new, l_new
                if lane < key_tile:
                    ps[pi, lane] = p
                if lane == 0:
                    corr_s[pi] = corr
                    if flags[pi, 3] == 1:
                        row, head, chunk = flags[pi, 5], head0 + pi % heads_blk, flags[pi, 4]
                        scratch[row, head, chunk, hd] = m_new
                        scratch[row, head, chunk, hd + 1] = l_new

    @cuda.jit(device=True)
    def accumulate(vs, ps, corr_s, flags, acc, scratch, head0):
        tid = cuda.threadIdx.x
        for a in range(n_acc):
            e = tid + a * threads
            if e < pairs * hd:
                pi, d = e // hd, e % hd
                if flags[pi, 0] == 1:
                    base = np.float32(0.0) if flags[pi, 1] == 1 else acc[a]
                    v = base * corr_s[pi]
                    valid = flags[pi, 2]
                    for j in range(key_tile):
                        vv = vs[j, d] if j < valid else np.float32(0.0)
                        v = cuda.fma(ps[pi, j], vv, v)
                    acc[a] = v
                    if flags[pi, 3] == 1:
                        scratch[flags[pi, 5], head0 + pi % heads_blk, flags[pi, 4], d] = v

    @cuda.jit(device=True)
    def run_pass(seq, q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size, sm_scale,
                 scratch, shared, local):
        ks, vs, ps, corr_s, slot_s, flags, buf = shared
        qr, sc, m_run, l_run, acc = local
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        r0, head0 = cuda.blockIdx.x * rows_blk, cuda.blockIdx.y * heads_blk
        kv_head = head0 // (q.shape[1] // kv_layer.shape[2])
        n_rows = q.shape[0]
        max_keys = 0
        for r in range(rows_blk):
            if r0 + r < n_rows and row_seq[r0 + r] == seq:
                max_keys = max(max_keys, row_pos[r0 + r] + 1)
        for k in range(pairs_per_warp):  # the warp's pairs' q, in registers
            pi = warp + warps * k
            row = r0 + pi // heads_blk
            for i in range(per_lane):
                d = lane + 32 * i
                qv = np.float32(0.0)
                if pi < pairs and row < n_rows and d < hd:
                    qv = q[row, head0 + pi % heads_blk, d]
                qr[k * per_lane + i] = qv
            m_run[k], l_run[k] = neg_inf, np.float32(0.0)
        bt_row = block_table[seq]
        for key0 in range(0, max_keys, key_tile):
            cuda.syncthreads()  # the previous tile is done with the shared arrays
            if lane == 0:
                for k in range(pairs_per_warp):
                    if warp + warps * k < pairs:
                        tile_plan(warp + warps * k, key0, seq, r0, row_seq, row_pos, n_rows, flags)
            load_tile(kv_layer, k_scale, v_scale, bt_row, key0, max_keys, page_size, kv_head, ks, vs, slot_s)
            cuda.syncthreads()
            softmax_pairs(ks, qr, sc, m_run, l_run, flags, ps, corr_s, sm_scale, scratch, head0, buf)
            cuda.syncthreads()
            accumulate(vs, ps, corr_s, flags, acc, scratch, head0)

    sizes = (pairs_per_warp * per_lane, pairs_per_warp, n_acc, pairs)
    return run_pass, sizes


def _make_kernel(kind: str, key_tile: int, max_hd: int, hd: int, heads_blk: int, rows_blk: int):
    run_pass, (n_q, n_pairs_warp, n_acc, pairs) = _make_pass(kind, key_tile, max_hd, hd, heads_blk, rows_blk)
    tile_shape, ps_shape, flags_shape = (key_tile, max_hd), (pairs, key_tile), (pairs, 6)
    buf_shape = (key_tile, _at.ATTN_THREADS) if SIMULATOR else (1, 1)  # exchange buffer, simulator only
    @kernel  # no register cap yet: ptxas (sm_90) uses 127-224 registers, no spill (untuned)
    def tiled_partial(q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size, sm_scale, scratch):  # noqa: E501
        # Arguments as attention.py's partial kernel; grid (row blocks, head blocks).
        # One allocation a line: the simulator tells shared arrays apart by their line.
        ks = cuda.shared.array(tile_shape, np.float32)
        vs = cuda.shared.array(tile_shape, np.float32)
        ps = cuda.shared.array(ps_shape, np.float32)
        corr_s = cuda.shared.array(pairs, np.float32)
        slot_s = cuda.shared.array(key_tile, np.int64)
        flags = cuda.shared.array(flags_shape, np.int64)
        buf = cuda.shared.array(buf_shape, np.float32)
        shared = (ks, vs, ps, corr_s, slot_s, flags, buf)
        local = (cuda.local.array(n_q, np.float32), cuda.local.array(key_tile, np.float32),
                 cuda.local.array(n_pairs_warp, np.float32), cuda.local.array(n_pairs_warp, np.float32),
                 cuda.local.array(n_acc, np.float32))
        seqs = cuda.local.array(rows_blk, np.int64)
        r0, n_rows = cuda.blockIdx.x * rows_blk, q.shape[0]
        n_seqs = 0
        for r in range(rows_blk):  # the block's sequences, in order of first row
            if r0 + r < n_rows:
                s = np.int64(row_seq[r0 + r])
                seen = False
                for k in range(n_seqs):
                    seen = seen or seqs[k] == s
                if not seen:
                    seqs[n_seqs] = s
                    n_seqs += 1
        for k in range(n_seqs):
            run_pass(seqs[k], q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size, sm_scale,
                     scratch, shared, local)

    return tiled_partial


_KERNELS: dict[tuple[str, int, int], object] = {}


def tiled_kernel(kv_kind: str, head_dim: int, heads_blk: int):
    """The kernel for KV dtype `kv_kind`, `head_dim` and `heads_blk` query heads a block
    (attention.heads_per_block); rows a block: rows_per_block."""
    key_tile, max_hd = _at.tile_for_head_dim(head_dim)
    key = (kv_kind, head_dim, heads_blk)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(kv_kind, key_tile, max_hd, head_dim, heads_blk, rows_per_block(heads_blk, max_hd))
    return _KERNELS[key]
