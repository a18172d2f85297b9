"""Matmuls out = x @ W.T for dense f32, dense bf16 (uint16 bits) and affine 4/8-bit weights,
plus the affine embedding gather.

Weights are read as 32-bit words: f32 (1 value a word), bf16 (2: element 2w in the low
half), affine 4-bit (8 codes, LSB first) and 8-bit (4 codes). Every array carries a leading
expert axis `[E, out, ...]` (E = 1 for a plain linear); `grouped` kernels pick the expert of
each row from `expert_ids` (MoE dispatch without a host round trip).

Reduction order of out[r, o] (the same in every kernel below, so the few-rows path and the
many-rows path give bit-identical rows, and neither depends on the batch):
  lane l of one warp takes words l, l+32, l+64, ... of row o in ascending order and, inside
  a word, elements j = 0..per_word-1: acc = fma(x[r, k], w(o, k), acc), k = word*per_word + j;
  then a butterfly sum over the 32 lanes (offsets 16, 8, 4, 2, 1).
  Affine dequantization: w(o, k) = fma(float(q), scale, bias).

Launch: block MATMUL_THREADS (4 warps; 2 in the simulator, each warp COLS_PER_WARP output columns), grid
(ceil(out_f / (4 * COLS_PER_WARP)), ceil(rows / rows_tile)). Each step, the block stages the
x slice of its rows for 32 words in shared memory ([rows_tile][per_word][32], lane-minor so
reads are conflict-free), then every warp reads 32 coalesced words per column.
- few-rows path (decode, memory bound): rows_tile = 1.
- many-rows path (prompt steps): rows_tile = MANY_ROWS_TILE; each weight word is decoded
  once and used for 8 rows.
"""

from __future__ import annotations

import numpy as np

from cuda_kernels.convert import f32_from_bits
from cuda_kernels.env import SIMULATOR, cuda, warp_sum

WARPS_PER_BLOCK = 2 if SIMULATOR else 4  # fewer Python threads in the simulator
MATMUL_THREADS = 32 * WARPS_PER_BLOCK
COLS_PER_WARP = 2
COLS_PER_BLOCK = WARPS_PER_BLOCK * COLS_PER_WARP
MANY_ROWS_TILE = 8
PER_WORD = {"f32": 1, "bf16": 2, "q8": 4, "q4": 8}


@cuda.jit(device=True)
def _decode_f32(word, j, scale, bias):  # noqa: ANN001, ANN201
    return word


@cuda.jit(device=True)
def _decode_bf16(word, j, scale, bias):  # noqa: ANN001, ANN201
    bits = np.int64(word)
    if j == 0:
        return f32_from_bits((bits & 0xFFFF) << 16)
    return f32_from_bits(bits & 0xFFFF0000)


@cuda.jit(device=True)
def _decode_q8(word, j, scale, bias):  # noqa: ANN001, ANN201
    q = (np.int64(word) >> (8 * j)) & 0xFF
    return cuda.fma(np.float32(q), scale, bias)


@cuda.jit(device=True)
def _decode_q4(word, j, scale, bias):  # noqa: ANN001, ANN201
    q = (np.int64(word) >> (4 * j)) & 0xF
    return cuda.fma(np.float32(q), scale, bias)


_DECODERS = {"f32": _decode_f32, "bf16": _decode_bf16, "q8": _decode_q8, "q4": _decode_q4}


def _make_stage(rows_tile: int, per_word: int):  # noqa: ANN202
    @cuda.jit(device=True)
    def stage(x, xs, row0, base_word):  # noqa: ANN001, ANN202
        # xs[r, j, l] = x[row0 + r, (base_word + l) * per_word + j]; zero outside x.
        rows, in_features = x.shape[0], x.shape[1]
        span = per_word * 32
        for t in range(cuda.threadIdx.x, rows_tile * span, MATMUL_THREADS):
            r = t // span
            rem = t % span
            k = base_word * per_word + rem
            val = np.float32(0.0)
            if row0 + r < rows and k < in_features:
                val = x[row0 + r, k]
            xs[r, rem % per_word, rem // per_word] = val

    return stage


def _make_kernel(kind: str, rows_tile: int, grouped: bool):  # noqa: ANN202
    per_word = PER_WORD[kind]
    decode = _DECODERS[kind]
    stage = _make_stage(rows_tile, per_word)
    num_acc = rows_tile * COLS_PER_WARP
    affine = kind in ("q4", "q8")

    @cuda.jit
    def kernel(x, w, scales, biases, group_size, expert_ids, out):  # noqa: ANN001, ANN202
        # x: [rows, in] f32; w: [E, out_f, words]; scales/biases: [E, out_f, groups];
        # expert_ids: [rows] i32 (grouped only); out: [rows, out_f] f32
        xs = cuda.shared.array((rows_tile, per_word, 32), np.float32)
        acc = cuda.local.array(num_acc, np.float32)
        lane = cuda.threadIdx.x % 32
        col0 = cuda.blockIdx.x * COLS_PER_BLOCK + (cuda.threadIdx.x // 32) * COLS_PER_WARP
        row0 = cuda.blockIdx.y * rows_tile
        out_f, words = w.shape[1], w.shape[2]
        expert = expert_ids[row0] if grouped else 0
        for a in range(num_acc):
            acc[a] = np.float32(0.0)
        for base_word in range(0, words, 32):
            stage(x, xs, row0, base_word)
            cuda.syncthreads()
            word_id = base_word + lane
            for c in range(COLS_PER_WARP):
                col = col0 + c
                if col < out_f and word_id < words:
                    word = w[expert, col, word_id]
                    scale = np.float32(0.0)
                    bias = np.float32(0.0)
                    if affine:
                        g = (word_id * per_word) // group_size
                        scale = scales[expert, col, g]
                        bias = biases[expert, col, g]
                    for j in range(per_word):
                        wv = decode(word, j, scale, bias)
                        for r in range(rows_tile):
                            a = r * COLS_PER_WARP + c
                            acc[a] = cuda.fma(xs[r, j, lane], wv, acc[a])
            cuda.syncthreads()
        for r in range(rows_tile):
            for c in range(COLS_PER_WARP):
                total = warp_sum(acc[r * COLS_PER_WARP + c])
                if lane == 0 and row0 + r < out.shape[0] and col0 + c < out_f:
                    out[row0 + r, col0 + c] = total

    return kernel


_KERNELS: dict[tuple[str, int, bool], object] = {}


def matmul_kernel(kind: str, rows_tile: int, grouped: bool = False):  # noqa: ANN201
    """The kernel for weight `kind` ('f32', 'bf16', 'q8', 'q4'), `rows_tile` (1 = few-rows
    path, MANY_ROWS_TILE = many-rows path) and `grouped` (rows_tile must be 1)."""
    if grouped and rows_tile != 1:
        raise ValueError("grouped (MoE) matmul runs one row per block")
    key = (kind, rows_tile, grouped)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(kind, rows_tile, grouped)
    return _KERNELS[key]


def launch_shape(rows: int, out_features: int, rows_tile: int) -> tuple[tuple[int, int], int]:
    """(grid, block) for a matmul kernel."""
    grid_x = (out_features + COLS_PER_BLOCK - 1) // COLS_PER_BLOCK
    grid_y = (rows + rows_tile - 1) // rows_tile
    return (grid_x, grid_y), MATMUL_THREADS


@cuda.jit
def embed_affine(codes, scales, biases, bits, group_size, ids, out):  # noqa: ANN001, ANN201
    # codes: [V, H*bits/32] u32; out[r] = dequant(codes[ids[r]]); grid (rows,)
    row = cuda.blockIdx.x
    token = ids[row]
    per_word = 32 // bits
    mask = (1 << bits) - 1
    for i in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        word = np.int64(codes[token, i // per_word])
        q = (word >> (bits * (i % per_word))) & mask
        g = i // group_size
        out[row, i] = cuda.fma(np.float32(q), scales[token, g], biases[token, g])
