"""Paged causal GQA attention over a lane's page table, f32 / bf16 / fp8 KV.

One kernel serves decode rows (one query row per stream) and multi-row launches (prompt
steps, draft verification rows): a block owns one query row and up to MAX_HEADS_PER_BLOCK
query heads of one KV head, so a row's result never depends on the other rows, and a
verify row is bit-identical to the same row decoded alone.

Per (row, head) the order is fixed: keys 0..row_pos in tiles of `key_tile` positions
starting at 0; in a tile, score_j = (sum_d fma(q_d, k_jd)) * sm_scale with d ascending;
online softmax: m' = max(m, butterfly max of the tile), p_j = exp(score_j - m'),
l = l * exp(m - m') + butterfly sum of p; acc_d = acc_d * exp(m - m') then fma(p_j, v_jd)
for j ascending; out = acc / l.

Launch: grid (rows, num_heads // heads_per_block), block ATTN_THREADS.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.convert import from_bf16_bits, from_e4m3
from cuda_kernels.env import SIMULATOR, cuda, warp_max, warp_sum

ATTN_THREADS = 64 if SIMULATOR else 256  # the block shape never changes a row
ATTN_WARPS = ATTN_THREADS // 32
MAX_HEADS_PER_BLOCK = ATTN_WARPS  # softmax: warp h owns head h
NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True)
def _load_f32(kv_layer, kind, slot, kv_head, d, scale):  # noqa: ANN001, ANN201
    return kv_layer[kind, slot, kv_head, d]


@cuda.jit(device=True)
def _load_bf16(kv_layer, kind, slot, kv_head, d, scale):  # noqa: ANN001, ANN201
    return from_bf16_bits(kv_layer[kind, slot, kv_head, d])


@cuda.jit(device=True)
def _load_fp8(kv_layer, kind, slot, kv_head, d, scale):  # noqa: ANN001, ANN201
    return from_e4m3(kv_layer[kind, slot, kv_head, d]) * scale


_LOADERS = {"f32": _load_f32, "bf16": _load_bf16, "fp8": _load_fp8}


def tile_for_head_dim(head_dim: int) -> tuple[int, int]:
    """(key_tile, max_head_dim) of the kernel variant for `head_dim` (shared memory < 48 KB)."""
    if head_dim <= 128:
        return 32, 128
    if head_dim <= 256:
        return 16, 256
    raise ValueError(f"head_dim {head_dim} > 256 is not supported by the CUDA attention kernel")


def heads_per_block(num_heads: int, num_kv_heads: int) -> int:
    """The largest divisor of the GQA group size that fits one block."""
    group = num_heads // num_kv_heads
    return max(d for d in range(1, MAX_HEADS_PER_BLOCK + 1) if group % d == 0)


def _make_tile_loader(load, key_tile: int):  # noqa: ANN001, ANN202
    @cuda.jit(device=True)
    def load_tile(kv_layer, k_scale, v_scale, bt_row, page_size, kv_head, key0, num_keys, ks, vs):  # noqa: ANN001, ANN202
        head_dim = kv_layer.shape[3]
        for e in range(cuda.threadIdx.x, key_tile * head_dim, ATTN_THREADS):
            j = e // head_dim
            d = e % head_dim
            pos = key0 + j
            k_val = np.float32(0.0)
            v_val = np.float32(0.0)
            if pos < num_keys:
                slot = bt_row[pos // page_size] * page_size + pos % page_size
                k_val = load(kv_layer, 0, slot, kv_head, d, k_scale)
                v_val = load(kv_layer, 1, slot, kv_head, d, v_scale)
            ks[j, d] = k_val
            vs[j, d] = v_val

    return load_tile


def _make_softmax_step(key_tile: int):  # noqa: ANN202
    @cuda.jit(device=True)
    def softmax_step(ps, corr_s, num_heads_blk, key0, num_keys, m_run, l_run):  # noqa: ANN001, ANN202
        # Warp h updates head h's running max / sum and turns its scores into weights.
        # Every warp runs it (uniform flow); warps past num_heads_blk write nothing.
        warp = cuda.threadIdx.x // 32
        lane = cuda.threadIdx.x % 32
        score = NEG_INF
        if warp < num_heads_blk and lane < key_tile and key0 + lane < num_keys:
            score = ps[warp, lane]
        m_new = max(m_run, warp_max(score))
        p = np.float32(0.0)
        corr = np.float32(0.0)
        if m_new != NEG_INF:
            if score != NEG_INF:
                p = np.float32(math.exp(score - m_new))
            if m_run != NEG_INF:
                corr = np.float32(math.exp(m_run - m_new))
        l_new = l_run * corr + warp_sum(p)
        if warp < num_heads_blk:
            if lane < key_tile:
                ps[warp, lane] = p
            if lane == 0:
                corr_s[warp] = corr
        return m_new, l_new

    return softmax_step


def _make_kernel(kind: str, key_tile: int, max_hd: int):  # noqa: ANN202
    load_tile = _make_tile_loader(_LOADERS[kind], key_tile)
    softmax_step = _make_softmax_step(key_tile)
    max_pairs = MAX_HEADS_PER_BLOCK * max_hd // ATTN_THREADS
    padded_hd = max_hd + 1  # a padded K row: score reads of 32 keys hit 32 banks

    @cuda.jit
    def kernel(q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size, sm_scale, heads_blk, out):  # noqa: ANN001, ANN202
        ks = cuda.shared.array((key_tile, padded_hd), np.float32)
        vs = cuda.shared.array((key_tile, max_hd), np.float32)
        qs = cuda.shared.array((MAX_HEADS_PER_BLOCK, max_hd), np.float32)
        ps = cuda.shared.array((MAX_HEADS_PER_BLOCK, key_tile), np.float32)
        corr_s = cuda.shared.array(MAX_HEADS_PER_BLOCK, np.float32)
        acc = cuda.local.array(max_pairs, np.float32)
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x
        head0 = cuda.blockIdx.y * heads_blk
        hd = q.shape[2]
        kv_head = head0 // (q.shape[1] // kv_layer.shape[2])
        num_keys = row_pos[row] + 1
        bt_row = block_table[row_seq[row]]
        for e in range(tid, heads_blk * hd, ATTN_THREADS):
            qs[e // hd, e % hd] = q[row, head0 + e // hd, e % hd]
        for a in range(max_pairs):
            acc[a] = np.float32(0.0)
        m_run = NEG_INF
        l_run = np.float32(0.0)
        for key0 in range(0, num_keys, key_tile):
            load_tile(kv_layer, k_scale, v_scale, bt_row, page_size, kv_head, key0, num_keys, ks, vs)
            cuda.syncthreads()
            for e in range(tid, heads_blk * key_tile, ATTN_THREADS):
                s = np.float32(0.0)
                for d in range(hd):
                    s = cuda.fma(qs[e // key_tile, d], ks[e % key_tile, d], s)
                ps[e // key_tile, e % key_tile] = s * sm_scale
            cuda.syncthreads()
            m_run, l_run = softmax_step(ps, corr_s, heads_blk, key0, num_keys, m_run, l_run)
            cuda.syncthreads()
            for a in range(max_pairs):
                e = tid + a * ATTN_THREADS
                if e < heads_blk * hd:
                    v = acc[a] * corr_s[e // hd]
                    for j in range(key_tile):
                        v = cuda.fma(ps[e // hd, j], vs[j, e % hd], v)
                    acc[a] = v
            cuda.syncthreads()
        if tid % 32 == 0 and tid // 32 < heads_blk:
            corr_s[tid // 32] = l_run
        cuda.syncthreads()
        for a in range(max_pairs):
            e = tid + a * ATTN_THREADS
            if e < heads_blk * hd:
                out[row, head0 + e // hd, e % hd] = acc[a] / corr_s[e // hd]

    return kernel


_KERNELS: dict[tuple[str, int, int], object] = {}


def attention_kernel(kv_kind: str, head_dim: int):  # noqa: ANN201
    """The paged attention kernel for KV dtype `kv_kind` ('f32', 'bf16', 'fp8')."""
    key_tile, max_hd = tile_for_head_dim(head_dim)
    key = (kv_kind, key_tile, max_hd)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(kv_kind, key_tile, max_hd)
    return _KERNELS[key]
