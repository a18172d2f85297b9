"""Paged causal GQA attention over a lane's page table, f32 / bf16 / fp8 KV: split over keys
("flash-decoding") in two kernels, a partial kernel and a combine kernel.

One pair serves decode rows (one query row per stream) and multi-row launches (prompt steps,
draft verification rows; causal: row r sees keys 0..row_pos[r]). A row's result depends only
on its own query, its own keys and row_pos: never on the other rows, their number, the
block-table width or the grid, so a verify row is bit-identical to the same row decoded alone.

Chunks sit at fixed absolute positions that depend only on the row's own key count
n = row_pos + 1: chunk c covers keys [c * C, (c + 1) * C) cut to [0, row_pos], where C is the
smallest KEY_TILE * 2**k with at most MAX_CHUNKS chunks (chunk_keys(n)). Short rows get small
chunks (many blocks even for one decode row), long rows at most MAX_CHUNKS partials.

Partial kernel, per (row, head, chunk), fixed order: keys of the chunk in tiles of KEY_TILE
positions starting at the chunk start; in a tile one warp scores a key for every head of the
block: score_j = (butterfly sum over the 32 lanes, offsets 16, 8, 4, 2, 1, of lane l's s_l)
* sm_scale, where s_l = fma chain over d = l, l + 32, l + 64, ... ascending (starting at 0;
lane l loads K[j, d] and V[j, d] for those d: consecutive lanes, consecutive d); online
softmax from m = -inf, l = 0, acc = 0: m' = max(m, butterfly max of the tile's scores),
p_j = exp(score_j - m'),
l = l * exp(m - m') + butterfly sum of p (lane j holds p_j; lanes past the chunk's last key
hold 0); acc_d = acc_d * exp(m - m') then fma(p_j, v_jd, acc_d) for j ascending over the whole
tile (keys past the chunk's end have p_j = 0, v_jd = 0). It stores (acc_d, m, l) of the chunk.

Combine kernel, per (row, head), chunks c = 0 .. chunks-1 ascending: M = max m_c;
w_c = exp(m_c - M) (0 where m_c = -inf); L = fma(l_c, w_c, L) from L = 0;
num_d = fma(acc_cd, w_c, num_d) from 0; out_d = num_d / L. A row with one chunk takes the
same formula.

Launch (cuda_kernels/launch.py): partial grid (rows, num_heads // heads_per_block, z) with
ATTN_THREADS threads, where block z walks chunks z, z + gridDim.z, ... of its row (blocks
with nothing to do exit at once; z depends only on host-known shapes, so the launch can be
captured in a CUDA graph); combine grid (rows, num_heads) with COMBINE_THREADS threads.
Scratch [rows, num_heads, max_chunks, head_dim + 2] float32 holds the partials (acc_d, then
m, l), max_chunks from the block-table width (at most MAX_CHUNKS): a launch reads only the
chunks it wrote. Launches needing more than SCRATCH_BUDGET_BYTES run in slices of rows over
one scratch (same bits: rows are independent).
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels import qdot as _qd
from cuda_kernels.convert import from_bf16_bits, from_e4m3
from cuda_kernels.env import FULL_MASK, SIMULATOR, cuda, kernel

ATTN_THREADS = 64 if SIMULATOR else 256  # the block shape never changes a row
ATTN_WARPS = ATTN_THREADS // 32
MAX_HEADS_PER_BLOCK = ATTN_WARPS  # softmax: warp h owns head h
KEY_TILE = 8 if SIMULATOR else 32  # keys per tile in a chunk; a multiple of ATTN_WARPS
MAX_CHUNKS = 4 if SIMULATOR else 32  # chunks of one row, at most (the partials it keeps)
SLOT_SPAN = 16 if SIMULATOR else 256  # page-table lookups staged in shared memory at once
COMBINE_THREADS = 32 if SIMULATOR else 128
PARTIAL_MAX_REGISTERS = 65536 // (2 * ATTN_THREADS)  # two partial blocks a multiprocessor
TARGET_BLOCKS = 2048  # partial blocks per launch worth filling the GPU (grid only, never bits)
SCRATCH_BUDGET_BYTES = 64 << 20  # larger launches run in slices of rows (same bits)
NEG_INF = np.float32(-np.inf)
MAX_HEAD_DIM = 256

assert SLOT_SPAN % KEY_TILE == 0 and KEY_TILE % ATTN_WARPS == 0 and KEY_TILE <= 32


def chunk_keys(num_keys: int) -> int:
    """Keys per chunk of a row with `num_keys` keys: the smallest KEY_TILE * 2**k that cuts
    the row into at most MAX_CHUNKS chunks (a function of the row alone)."""
    keys = KEY_TILE
    while keys * MAX_CHUNKS < num_keys:
        keys *= 2
    return keys


_chunk_keys = cuda.jit(device=True)(chunk_keys)


@cuda.jit(device=True)
def _load_f32(kv_layer, kind, slot, kv_head, d, scale):
    return kv_layer[kind, slot, kv_head, d]


@cuda.jit(device=True)
def _load_bf16(kv_layer, kind, slot, kv_head, d, scale):
    return from_bf16_bits(kv_layer[kind, slot, kv_head, d])


@cuda.jit(device=True)
def _load_fp8(kv_layer, kind, slot, kv_head, d, scale):
    return from_e4m3(kv_layer[kind, slot, kv_head, d]) * scale


_LOADERS = {"f32": _load_f32, "bf16": _load_bf16, "fp8": _load_fp8}


# Butterfly reductions over the 32 lanes of a warp, offsets 16, 8, 4, 2, 1, v = op(v, other):
# the same arithmetic as env.warp_sum / env.warp_max, for several values at once. Under the
# simulator the exchange goes through `buf` [values, ATTN_THREADS] in shared memory (one
# allocation per kernel instead of one per shuffle), and every thread of the block must call.
if SIMULATOR:
    # One exchange per reduction: every thread publishes its values, then replays the whole
    # butterfly of its warp locally in float32 (lane l: t_l = op(t_l, t_(l ^ offset))), which
    # is what the shuffles compute on a GPU, at 2 barriers instead of 10 per reduction.
    _LANES = np.arange(32)

    def _warp_tree(values, op):
        t = np.array(values, dtype=np.float32)
        for k in range(5):
            t = op(t, t[_LANES ^ (16 >> k)]).astype(np.float32)
        return t

    def _bfly(v, buf, op):
        tid = cuda.threadIdx.x
        buf[0, tid] = v
        cuda.syncthreads()
        base = tid - tid % 32
        v = _warp_tree(buf[0, base : base + 32], op)[tid % 32]
        cuda.syncthreads()
        return np.float32(v)

    @cuda.jit(device=True)
    def _bfly_max(v, buf):
        return _bfly(v, buf, np.maximum)

    @cuda.jit(device=True)
    def _bfly_sum(v, buf):
        return _bfly(v, buf, np.add)

    def _make_bfly_sums(n: int, stride: int):
        @cuda.jit(device=True)
        def sums(vals, active, buf):
            # vals[i] for i % stride < active; the others are left as they are.
            tid = cuda.threadIdx.x
            for i in range(n):
                buf[i, tid] = vals[i]
            cuda.syncthreads()
            base = tid - tid % 32
            for i in range(n):
                if i % stride < active:
                    vals[i] = _warp_tree(buf[i, base : base + 32], np.add)[tid % 32]
            cuda.syncthreads()

        return sums

else:

    @cuda.jit(device=True, inline=True)
    def _bfly_max(v, buf):
        for k in range(5):
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16 >> k))
        return v

    @cuda.jit(device=True, inline=True)
    def _bfly_sum(v, buf):
        for k in range(5):
            v = v + cuda.shfl_xor_sync(FULL_MASK, v, 16 >> k)
        return v

    def _make_bfly_sums(n: int, stride: int):
        @cuda.jit(device=True, inline=True)
        def sums(vals, active, buf):
            for k in range(5):
                for i in range(n):
                    if i % stride < active:
                        vals[i] = vals[i] + cuda.shfl_xor_sync(FULL_MASK, vals[i], 16 >> k)

        return sums


def tile_for_head_dim(head_dim: int) -> tuple[int, int]:
    """(key_tile, max_head_dim) of the kernel variant for `head_dim` (shared memory < 48 KB)."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the CUDA attention kernel")
    max_hd = 32
    while max_hd < head_dim:
        max_hd *= 2
    return KEY_TILE, max_hd


def heads_per_block(num_heads: int, num_kv_heads: int) -> int:
    """The largest divisor of the GQA group size that fits one block."""
    group = num_heads // num_kv_heads
    return max(d for d in range(1, MAX_HEADS_PER_BLOCK + 1) if group % d == 0)


def max_chunks(table_width: int, page_size: int) -> int:
    """Chunks of a row whose block table has `table_width` pages, at most (a row of n <= that
    many keys has ceil(n / chunk_keys(n)) chunks: up to MAX_CHUNKS once n > KEY_TILE * MAX_CHUNKS
    / 2, not only at the table's full length)."""
    return min(MAX_CHUNKS, -(-table_width * page_size // KEY_TILE))


def scratch_shape(rows: int, num_heads: int, head_dim: int, table_width: int, page_size: int) -> tuple[int, ...]:
    """Scratch of one launch: [rows per slice, num_heads, max_chunks, head_dim + 2] float32."""
    chunks = max_chunks(table_width, page_size)
    per_row = num_heads * chunks * (head_dim + 2) * 4
    return (max(1, min(rows, SCRATCH_BUDGET_BYTES // per_row)), num_heads, chunks, head_dim + 2)


def chunk_blocks(rows: int, head_blocks: int, chunks: int) -> int:
    """gridDim.z of the partial kernel: enough blocks to fill the GPU, never more than chunks."""
    want = (TARGET_BLOCKS + rows * head_blocks - 1) // (rows * head_blocks)
    return max(1, min(chunks, want, 65535))


def _make_softmax_step(key_tile: int):
    @cuda.jit(device=True)
    def softmax_step(ps, corr_s, num_heads_blk, key0, key_end, m_run, l_run, buf):
        # Warp h updates head h's running max / sum and turns its scores into weights.
        # Every warp runs it (uniform flow); warps past num_heads_blk write nothing.
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        score = NEG_INF
        if warp < num_heads_blk and lane < key_tile and key0 + lane < key_end:
            score = ps[warp, lane]
        m_new = max(m_run, _bfly_max(score, buf))
        p = np.float32(0.0)
        corr = np.float32(0.0)
        if m_new != NEG_INF:
            if score != NEG_INF:
                p = np.float32(math.exp(score - m_new))
            if m_run != NEG_INF:
                corr = np.float32(math.exp(m_run - m_new))
        l_new = l_run * corr + _bfly_sum(p, buf)
        if warp < num_heads_blk:
            if lane < key_tile:
                ps[warp, lane] = p
            if lane == 0:
                corr_s[warp] = corr
        return m_new, l_new

    return softmax_step


def _make_partial_kernel(kind: str, key_tile: int, max_hd: int, hd: int, heads_blk: int):
    # hd (head_dim) and heads_blk (query heads a block) are compile-time constants: no
    # tests on them in the loops.
    load = _LOADERS[kind]
    softmax_step = _make_softmax_step(key_tile)
    max_pairs = (heads_blk * hd + ATTN_THREADS - 1) // ATTN_THREADS
    per_lane = max_hd // 32  # d = lane + 32 * i
    keys_per_warp = key_tile // ATTN_WARPS  # warp w scores keys w, w + WARPS, ... of a tile
    n_k = keys_per_warp * per_lane
    n_s = keys_per_warp * heads_blk
    bfly_sums = _make_bfly_sums(n_s, heads_blk)
    buf_shape = (n_s, ATTN_THREADS) if SIMULATOR else (1, 1)  # exchange buffer, simulator only

    # At most 128 registers: two blocks of ATTN_THREADS a multiprocessor instead of one (143
    # uncapped; ptxas spills 16 bytes at 128).
    jit = kernel if SIMULATOR else kernel(max_registers=PARTIAL_MAX_REGISTERS)

    @jit
    def partial_kernel(q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size, sm_scale, scratch):  # noqa: E501
        vs = cuda.shared.array((key_tile, max_hd), np.float32)
        qs = cuda.shared.array((heads_blk, max_hd), np.float32)
        ps = cuda.shared.array((heads_blk, key_tile), np.float32)
        corr_s = cuda.shared.array(heads_blk, np.float32)
        slot_s = cuda.shared.array(SLOT_SPAN, np.int64)
        acc = cuda.local.array(max_pairs, np.float32)
        kr = cuda.local.array(n_k, np.float32)
        sc = cuda.local.array(n_s, np.float32)
        buf = cuda.shared.array(buf_shape, np.float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        row = cuda.blockIdx.x
        head0 = cuda.blockIdx.y * heads_blk
        kv_head = head0 // (q.shape[1] // kv_layer.shape[2])
        num_keys = row_pos[row] + 1
        chunk_len = _chunk_keys(num_keys)
        n_chunks = (num_keys + chunk_len - 1) // chunk_len
        if cuda.blockIdx.z >= n_chunks:
            return  # the whole block: no chunk of this row for it
        bt_row = block_table[row_seq[row]]
        for e in range(tid, heads_blk * max_hd, ATTN_THREADS):
            h = e // max_hd
            d = e % max_hd
            qv = np.float32(0.0)
            if d < hd:
                qv = q[row, head0 + h, d]
            qs[h, d] = qv
        for chunk in range(cuda.blockIdx.z, n_chunks, cuda.gridDim.z):
            key_begin = chunk * chunk_len
            key_end = min(num_keys, key_begin + chunk_len)
            for a in range(max_pairs):
                acc[a] = np.float32(0.0)
            m_run = NEG_INF
            l_run = np.float32(0.0)
            for key0 in range(key_begin, key_end, key_tile):
                t0 = (key0 - key_begin) % SLOT_SPAN
                if t0 == 0:  # the next SLOT_SPAN keys' slots: one page-table lookup per key
                    cuda.syncthreads()  # qs written; the previous keys are done with slot_s
                    for j in range(tid, SLOT_SPAN, ATTN_THREADS):
                        pos = key0 + j
                        slot = np.int64(-1)
                        if pos < key_end:
                            slot = np.int64(bt_row[pos // page_size]) * page_size + pos % page_size
                        slot_s[j] = slot
                    cuda.syncthreads()
                # K of this warp's keys into registers, V of the tile into shared memory;
                # consecutive lanes read consecutive d.
                for t in range(keys_per_warp):
                    j = warp + t * ATTN_WARPS
                    slot = slot_s[t0 + j]
                    for i in range(per_lane):
                        d = lane + 32 * i
                        k_val = np.float32(0.0)
                        v_val = np.float32(0.0)
                        if slot >= 0 and d < hd:
                            k_val = load(kv_layer, 0, slot, kv_head, d, k_scale)
                            v_val = load(kv_layer, 1, slot, kv_head, d, v_scale)
                        kr[t * per_lane + i] = k_val
                        vs[j, d] = v_val
                for t in range(keys_per_warp):
                    for h in range(heads_blk):
                        s = np.float32(0.0)
                        for i in range(per_lane):
                            s = cuda.fma(qs[h, lane + 32 * i], kr[t * per_lane + i], s)
                        sc[t * heads_blk + h] = s
                bfly_sums(sc, heads_blk, buf)
                if lane == 0:
                    for t in range(keys_per_warp):
                        for h in range(heads_blk):
                            ps[h, warp + t * ATTN_WARPS] = sc[t * heads_blk + h] * sm_scale
                cuda.syncthreads()
                m_run, l_run = softmax_step(ps, corr_s, heads_blk, key0, key_end, m_run, l_run, buf)
                cuda.syncthreads()
                for a in range(max_pairs):
                    e = tid + a * ATTN_THREADS
                    if e < heads_blk * hd:
                        h = e // hd
                        d = e % hd
                        v = acc[a] * corr_s[h]
                        for j in range(key_tile):
                            v = cuda.fma(ps[h, j], vs[j, d], v)
                        acc[a] = v
                cuda.syncthreads()
            for a in range(max_pairs):
                e = tid + a * ATTN_THREADS
                if e < heads_blk * hd:
                    scratch[row, head0 + e // hd, chunk, e % hd] = acc[a]
            if lane == 0 and warp < heads_blk:
                scratch[row, head0 + warp, chunk, hd] = m_run
                scratch[row, head0 + warp, chunk, hd + 1] = l_run

    return partial_kernel


@cuda.jit(device=True)
def _chunk_weight(m_c, m_max):
    if m_c == NEG_INF:
        return np.float32(0.0)
    return np.float32(math.exp(m_c - m_max))


@cuda.jit(device=True)
def _combine(row_pos, scratch, out, vals):
    # out[row, head] (and vals[0, :hd]) from the row's chunk partials, chunks ascending
    # (module docstring).
    row = cuda.blockIdx.x
    head = cuda.blockIdx.y
    hd = out.shape[2]
    chunk_len = _chunk_keys(row_pos[row] + 1)
    n_chunks = (row_pos[row] + chunk_len) // chunk_len
    m_max = NEG_INF
    for c in range(n_chunks):
        m_max = max(m_max, scratch[row, head, c, hd])
    total = np.float32(0.0)
    for c in range(n_chunks):
        total = cuda.fma(scratch[row, head, c, hd + 1], _chunk_weight(scratch[row, head, c, hd], m_max), total)
    for d in range(cuda.threadIdx.x, hd, COMBINE_THREADS):
        num = np.float32(0.0)
        for c in range(n_chunks):
            num = cuda.fma(scratch[row, head, c, d], _chunk_weight(scratch[row, head, c, hd], m_max), num)
        value = num / total
        out[row, head, d] = value
        vals[0, d] = value


@kernel
def combine_kernel(row_pos, scratch, out):
    """out[row, head] from the row's chunk partials, chunks ascending (module docstring)."""
    vals = cuda.shared.array((1, MAX_HEAD_DIM), np.float32)
    _combine(row_pos, scratch, out, vals)


@kernel
def combine_quantize_kernel(row_pos, scratch, out, q4_order, xq, xs):
    """combine_kernel, and the head's values also written as int8 x: the bits of
    qdot.quantize_rows of out's rows [rows, nh * hd] (head_dim a multiple of qdot.CHUNK)."""
    vals = cuda.shared.array((1, MAX_HEAD_DIM), np.float32)
    _combine(row_pos, scratch, out, vals)
    cuda.syncthreads()
    chunks = out.shape[2] // _qd.CHUNK
    _qd.quantize_chunks(vals, MAX_HEAD_DIM, chunks, cuda.blockIdx.y * chunks, cuda.blockIdx.x, q4_order, xq, xs)


_KERNELS: dict[tuple[str, int, int], object] = {}  # (kv kind, head_dim, heads a block)


def attention_kernel(kv_kind: str, head_dim: int, heads_blk: int):
    """The partial kernel for KV dtype `kv_kind` ('f32', 'bf16', 'fp8'), `head_dim` and
    `heads_blk` query heads a block (heads_per_block)."""
    key_tile, max_hd = tile_for_head_dim(head_dim)
    key = (kv_kind, head_dim, heads_blk)
    if key not in _KERNELS:
        _KERNELS[key] = _make_partial_kernel(kv_kind, key_tile, max_hd, head_dim, heads_blk)
    return _KERNELS[key]
