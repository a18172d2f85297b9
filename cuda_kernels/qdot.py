"""Affine 4/8-bit matmul on 8-bit activations: out = x @ W.T, x quantized per chunk of 32.

Numerics, the same on every path (rows per block, features per warp, words in flight,
grouped or not), so a row's bits never depend on the rows sharing the launch:
- quantize_rows: for each row and chunk of CHUNK = 32 elements of x, amax = max |x|,
  d = amax / 127, inv = 127 / amax (float32 divisions), xi = the exact product x * inv rounded
  to the nearest integer, ties to even, as int8 (all 0 when amax is 0); the chunk keeps
  (d, d * sum(xi)).
- Weight element k of feature o is s * q + b (q its code; s, b those of k's group, a group
  being whole chunks). A chunk's share of the dot product is then
      s * d * sum(q * xi) + b * d * sum(xi),
  where sum(q * xi) is an exact integer (dp4a: unsigned code bytes times signed x bytes).
- Reduction order of out[r, o]: lane l of one warp takes chunks l, l + 32, l + 64, ...
  ascending: acc = fma(s * d, float(sum(q * xi)), acc); acc = fma(b, d * sum(xi), acc); then
  the butterfly over the 32 lanes (offsets 16, 8, 4, 2, 1).
Byte order of xi (what the weight words need): a q4 word holds 8 codes, element 2i in the
low nibble of byte i and 2i + 1 in its high nibble, so w & 0x0F0F0F0F are the even codes as
bytes and (w >> 4) & 0x0F0F0F0F the odd ones; xi is stored per 8 elements as
(x0, x2, x4, x6, x1, x3, x5, x7). q8 words hold 4 codes as bytes: natural order.

Work split: a `matmul.Variant` (rows a block, features a warp, chunks a lane in flight,
warps a block): each lane loads a chunk's weight words as 16-byte loads (a warp load: 512
contiguous bytes), decodes them once and uses them for every row of the block; the next
step's words are loaded before the current step is computed. x's bytes and chunk scales
come through L1. The epilogues are the matmul module's (store, add, swiglu).
"""

from __future__ import annotations

import numpy as np

from cuda_kernels import matmul as mm
from cuda_kernels.env import SIMULATOR, cuda, kernel, warp_max, warp_sum
from cuda_kernels.norm import NORM_THREADS, inv_rms_of, sum_squares

CHUNK = 32
WORDS_PER_CHUNK = {"q4": 4, "q8": 8}
QUANT_WARPS = 4  # warps a block of quantize_rows; 32 * QUANT_WARPS == norm.NORM_THREADS
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: fma(v, inv, M) - M is v * inv to the nearest integer


if SIMULATOR:  # cuda.fma rounds twice in the simulator: the exact product in float64 instead

    @cuda.jit(device=True)
    def _nearest(v, inv):
        t = np.float64(v) * np.float64(inv)  # exact
        return np.float32((t + 6755399441055744.0) - 6755399441055744.0)  # 1.5 * 2**52

else:

    @cuda.jit(device=True)
    def _nearest(v, inv):
        # The exact product v * inv (|v * inv| <= 127.x) rounded once to the nearest
        # integer, ties to even: the ulp of 1.5 * 2**23 is 1.
        return cuda.fma(v, inv, _MAGIC) - _MAGIC


def x_position(q4_order: bool, j: int) -> int:
    """Byte of element j of a chunk in its quantized row (the order q4 or q8 words need)."""
    return (j // 8) * 8 + (j % 2) * 4 + (j % 8) // 2 if q4_order else j


@cuda.jit(device=True)
def _chunk_scales(amax):
    d = amax / np.float32(127.0)
    inv = np.float32(127.0) / amax if amax > np.float32(0.0) else np.float32(0.0)
    return d, inv


@cuda.jit(device=True)
def _level(v, inv):
    return min(max(_nearest(v, inv), np.float32(-127.0)), np.float32(127.0))


_position = cuda.jit(device=True)(x_position)


@cuda.jit(device=True)
def _quantize_serial(vals, row, c, q4_order, xq, xs):
    # Chunk c of the row from its 32 values, one thread (the simulator's form)
    amax = np.float32(0.0)
    for j in range(CHUNK):
        amax = max(amax, abs(vals[j]))
    d, inv = _chunk_scales(amax)
    total = np.float32(0.0)
    for j in range(CHUNK):
        r = _level(vals[j], inv)
        xq[row, c * CHUNK + _position(q4_order, j)] = np.int8(r)
        total += r  # exact: integers of at most 32 * 127
    xs[row, 2 * c] = d
    xs[row, 2 * c + 1] = d * total


@cuda.jit(device=True)
def _quantize_warp(v, lane, chunk, chunks, row, q4_order, xq, xs):
    # Chunk `chunk` of the row, value v of element `lane` in each lane of one warp (every lane
    # runs the shuffles; a warp past the last chunk stores nothing)
    d, inv = _chunk_scales(warp_max(abs(v)))
    r = _level(v, inv)
    total = warp_sum(r)  # exact: integers of at most 32 * 127
    if chunk < chunks:
        xq[row, chunk * CHUNK + _position(q4_order, lane)] = np.int8(r)
        if lane == 0:
            xs[row, 2 * chunk] = d
            xs[row, 2 * chunk + 1] = d * total


if SIMULATOR:  # one thread a chunk, no shuffles (each costs the simulator two barriers)
    QUANT_THREADS = QUANT_WARPS

    @kernel
    def quantize_rows(x, q4_order, xq, xs):
        row = cuda.blockIdx.x
        c = cuda.blockIdx.y * QUANT_WARPS + cuda.threadIdx.x
        if c < x.shape[1] // CHUNK:
            _quantize_serial(x[row, c * CHUNK : (c + 1) * CHUNK], row, c, q4_order, xq, xs)

    @kernel
    def rms_norm_quantize(x, w, eps, q4_order, xq, xs):
        partial = cuda.shared.array(NORM_THREADS, np.float32)
        vals = cuda.local.array(CHUNK, np.float32)
        row, dim = cuda.blockIdx.x, x.shape[1]
        inv_rms = inv_rms_of(sum_squares(x, row, 0, dim), dim, eps, partial)
        c = cuda.blockIdx.y * QUANT_WARPS + cuda.threadIdx.x
        if cuda.threadIdx.x < QUANT_WARPS and c < dim // CHUNK:
            for j in range(CHUNK):
                vals[j] = (x[row, c * CHUNK + j] * inv_rms) * w[c * CHUNK + j]
            _quantize_serial(vals, row, c, q4_order, xq, xs)

else:
    QUANT_THREADS = 32 * QUANT_WARPS

    @kernel
    def quantize_rows(x, q4_order, xq, xs):
        # x: [rows, K] f32; xq: [rows, K] int8; xs: [rows, 2 * K / 32] f32 (d, d * sum(xi))
        # per chunk. Grid (rows, chunk blocks), block QUANT_THREADS: one warp a chunk, lane j
        # its element j.
        chunk = cuda.blockIdx.y * QUANT_WARPS + cuda.threadIdx.x // 32
        lane, chunks = cuda.threadIdx.x % 32, x.shape[1] // CHUNK
        v = x[cuda.blockIdx.x, min(chunk, chunks - 1) * CHUNK + lane]
        _quantize_warp(v, lane, chunk, chunks, cuda.blockIdx.x, q4_order, xq, xs)

    @kernel
    def rms_norm_quantize(x, w, eps, q4_order, xq, xs):
        # quantize_rows of rms_norm(x, w, eps): each block works out the row's 1 / rms as
        # norm.rms_norm does (the same threads, order and bits), then quantizes its chunks of
        # the normed row (the same expression as rms_norm's output). Grid as quantize_rows.
        partial = cuda.shared.array(NORM_THREADS, np.float32)
        row, dim = cuda.blockIdx.x, x.shape[1]
        inv_rms = inv_rms_of(sum_squares(x, row, 0, dim), dim, eps, partial)
        chunk = cuda.blockIdx.y * QUANT_WARPS + cuda.threadIdx.x // 32
        lane, chunks = cuda.threadIdx.x % 32, dim // CHUNK
        i = min(chunk, chunks - 1) * CHUNK + lane
        _quantize_warp((x[row, i] * inv_rms) * w[i], lane, chunk, chunks, row, q4_order, xq, xs)


if SIMULATOR:

    @cuda.jit(device=True)
    def quantize_chunks(vals, width, count, chunk0, row, q4_order, xq, xs):
        # Chunks chunk0 .. chunk0 + count - 1 of the row from the block's own values (shared):
        # value i is vals[i // width, i % width]. One thread a chunk (the simulator's form)
        chunk_vals = cuda.local.array(CHUNK, np.float32)
        for c in range(cuda.threadIdx.x, count, cuda.blockDim.x):
            for j in range(CHUNK):
                i = c * CHUNK + j
                chunk_vals[j] = vals[i // width, i % width]
            _quantize_serial(chunk_vals, row, chunk0 + c, q4_order, xq, xs)

else:

    @cuda.jit(device=True)
    def quantize_chunks(vals, width, count, chunk0, row, q4_order, xq, xs):
        # As above, one warp a chunk (every thread of the block calls; the bits of quantize_rows)
        lane, warps = cuda.threadIdx.x % 32, cuda.blockDim.x // 32
        for c in range(cuda.threadIdx.x // 32, count, warps):
            i = c * CHUNK + lane
            _quantize_warp(vals[i // width, i % width], lane, chunk0 + c, chunk0 + count, row, q4_order, xq, xs)


def quantize_shape(rows: int, in_features: int, norm: bool = False) -> tuple[tuple[int, int], int]:
    """(grid, block) of quantize_rows, or of rms_norm_quantize (norm: NORM_THREADS a block,
    the threads of rms_norm's reduction)."""
    chunks = in_features // CHUNK
    return (rows, (chunks + QUANT_WARPS - 1) // QUANT_WARPS), NORM_THREADS if norm else QUANT_THREADS


def _make_fetch(kind: str, variant: mm.Variant):
    unroll, feats, wpc = variant.unroll, variant.feats, WORDS_PER_CHUNK[kind]

    @cuda.jit(device=True)
    def fetch(w_rows, c0, chunks, wb):
        # wb[(u * feats + f) * wpc + i] = word i of chunk c0 + 32u of feature f (chunks that exist)
        for u in range(unroll):
            if c0 + 32 * u < chunks:
                for f in range(feats):
                    at = mm._at(w_rows[f], (c0 + 32 * u) * wpc)
                    for h in range(wpc // 4):
                        s = (u * feats + f) * wpc + 4 * h
                        wb[s], wb[s + 1], wb[s + 2], wb[s + 3] = mm._ld_u32x4(at, 4 * h)

    return fetch


def _make_chunk_math(kind: str, variant: mm.Variant, group_chunks: int):
    rows_tile, feats, wpc = variant.rows_tile, variant.feats, WORDS_PER_CHUNK[kind]
    q4 = kind == "q4"
    nib = np.uint32(0x0F0F0F0F)

    @cuda.jit(device=True)
    def chunk_math(x_rows, xs_rows, s_rows, b_rows, c, cw, at, work, acc):
        # Chunk c of every row and feature; its words are cw[at + f * wpc + i].
        codes, sv, xw = work
        g = c // group_chunks
        for f in range(feats):
            sv[2 * f], sv[2 * f + 1] = mm._ld_f32(s_rows[f], g), mm._ld_f32(b_rows[f], g)
            for i in range(wpc):
                word = cw[at + f * wpc + i]
                if q4:
                    codes[f * 8 + 2 * i] = word & nib
                    codes[f * 8 + 2 * i + 1] = (word >> np.uint32(4)) & nib
                else:
                    codes[f * 8 + i] = word
        for r in range(rows_tile):
            x_at = mm._at(x_rows[r], c * 8)  # 8 words of int8 x a chunk
            xw[0], xw[1], xw[2], xw[3] = mm._ld_x_u32x4(x_at, 0)
            xw[4], xw[5], xw[6], xw[7] = mm._ld_x_u32x4(x_at, 4)
            d, e = mm._ld_f32x2(xs_rows[r], 2 * c)
            for f in range(feats):
                isum = np.int32(0)
                for i in range(8):
                    isum = mm._dp4a(codes[f * 8 + i], xw[i], isum)
                a = r * feats + f
                acc[a] = cuda.fma(sv[2 * f] * d, np.float32(isum), acc[a])
                acc[a] = cuda.fma(sv[2 * f + 1], e, acc[a])

    return chunk_math


def _make_kernel(kind: str, variant: mm.Variant, group_chunks: int, grouped: bool, epilogue: str,
                 x_repeat: int = 1):
    rows_tile, feats, unroll, warps = variant.rows_tile, variant.feats, variant.unroll, variant.warps
    wpc = WORDS_PER_CHUNK[kind]
    outs = feats // 2 if epilogue == "swiglu" else feats
    slots, num_acc, num_codes, num_sv = unroll * feats * wpc, rows_tile * feats, 8 * feats, 2 * feats
    refs = mm._make_refs(variant, True, epilogue == "swiglu")
    fetch, chunk_math = _make_fetch(kind, variant), _make_chunk_math(kind, variant, group_chunks)
    prefetch_scales, store = mm._make_prefetch_scales(feats), mm._make_store(variant, epilogue)

    @kernel
    def qdot_k(xq, xs, w, scales, biases, expert_ids, out):
        # xq: [rows, K / 4] u32 (int8 x, quantize_rows' order); xs: [rows, 2 * K / 32] f32;
        # w: [E, out_f, K * bits / 32] u32; scales/biases: [E, out_f, groups] f32;
        # expert_ids: [rows] i32 (grouped only; rows_tile 1); out: [rows, out_f] f32.
        lane = cuda.threadIdx.x % 32
        feat0 = (cuda.blockIdx.y * warps + cuda.threadIdx.x // 32) * outs
        row0 = cuda.blockIdx.x * rows_tile
        x_rows = cuda.local.array(rows_tile, mm._REF)
        xs_rows = cuda.local.array(rows_tile, mm._REF)
        w_rows = cuda.local.array(feats, mm._REF)
        s_rows = cuda.local.array(feats, mm._REF)
        b_rows = cuda.local.array(feats, mm._REF)
        expert = expert_ids[row0] if grouped else 0
        refs(xq, w, scales, biases, expert, row0, feat0, x_rows, w_rows, s_rows, b_rows)
        for r in range(rows_tile):
            xs_rows[r] = mm._row2(xs, min(row0 + r, xs.shape[0] - 1))
        if x_repeat > 1:  # grouped, one row a block: out row (slot) row0 multiplies x row row0 // k
            x_rows[0] = mm._row2(xq, row0 // x_repeat)
            xs_rows[0] = mm._row2(xs, row0 // x_repeat)
        acc = cuda.local.array(num_acc, np.float32)
        for a in range(num_acc):
            acc[a] = np.float32(0.0)
        wb = cuda.local.array(slots, np.uint32)  # the next step's words, in flight
        cw = cuda.local.array(slots, np.uint32)  # this step's words
        work = (cuda.local.array(num_codes, np.uint32), cuda.local.array(num_sv, np.float32),
                cuda.local.array(8, np.uint32))
        chunks = w.shape[2] // wpc
        c = lane
        fetch(w_rows, c, chunks, wb)
        prefetch_scales(s_rows, b_rows, scales.shape[2], lane)
        while c < chunks:
            for s in range(slots):
                cw[s] = wb[s]
            fetch(w_rows, c + 32 * unroll, chunks, wb)
            for u in range(unroll):
                if c + 32 * u < chunks:
                    chunk_math(x_rows, xs_rows, s_rows, b_rows, c + 32 * u, cw, u * feats * wpc, work, acc)
            c += 32 * unroll
        store(acc, row0, feat0, lane, out)

    return qdot_k


_KERNELS: dict[tuple[str, mm.Variant, int, bool, str, int], object] = {}


def qdot_kernel(kind: str, variant: mm.Variant, group_chunks: int, grouped: bool = False,
                epilogue: str = "store", x_repeat: int = 1):
    """The kernel for affine `kind` ('q4', 'q8') and `variant`; group_chunks: chunks of 32
    per scale group (a compile-time constant). As matmul.matmul_kernel otherwise. x_repeat
    (grouped only): out row r multiplies x row r // x_repeat (MoE slots of one token: the
    token's row once in x instead of top_k copies; the same products, so the same bits)."""
    if kind not in WORDS_PER_CHUNK or group_chunks < 1:
        raise ValueError(f"qdot: kind {kind!r}, {group_chunks} chunks a group")
    if grouped and variant.rows_tile != 1:
        raise ValueError("grouped (MoE) matmul runs one row per block")
    if x_repeat < 1 or (x_repeat > 1 and not grouped):
        raise ValueError(f"qdot: x_repeat {x_repeat} (> 1 only for grouped rows)")
    if epilogue not in mm.EPILOGUES or (epilogue == "swiglu" and variant.feats % 2):
        raise ValueError(f"matmul epilogue {epilogue!r} with {variant.feats} features a warp")
    key = (kind, variant, group_chunks, grouped, epilogue, x_repeat)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(kind, variant, group_chunks, grouped, epilogue, x_repeat)
    return _KERNELS[key]


def plan(rows: int, out_features: int, path: str, grouped: bool = False) -> mm.Variant:
    """The variant of a launch (none changes a row's bits)."""
    if path == "many" and not grouped:  # the fastest at 8 rows, H200 (bench_qdot.py)
        if rows <= 4 or out_features > 4096:
            return mm.Variant(4, 4, 1, True)
        return mm.Variant(mm.MANY_ROWS_TILE, 4, 1, True)
    if rows <= 1 or grouped:  # the fastest at every Qwen3-8B shape, one row, H200
        return mm.Variant(1, 2, 1, True)
    return mm.Variant(2, 2, 1, True)


def supports(in_features: int, group_size: int) -> bool:
    """Whether a weight fits this kernel: whole chunks, each inside one scale group."""
    return in_features % CHUNK == 0 and group_size % CHUNK == 0 and in_features % group_size == 0
