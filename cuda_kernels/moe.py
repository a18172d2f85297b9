"""MoE routing and the weighted combine of expert outputs.

Expert dispatch itself is the grouped matmul of cuda_kernels/matmul.py: row-slot
(r, j) runs through expert out_ids[r, j]'s weights, one row per block, so no host round
trip and no dependence on which other rows chose the same expert.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.env import _shfl_xor, cuda, kernel, warp_max

ROUTE_WARPS = 4  # rows a block of moe_route: a warp a row
ROUTE_SHARED = 512  # experts whose exp(logit - max) a warp keeps in shared memory
COMBINE_THREADS = 128


@cuda.jit(device=True)
def _weight(logits, row, e, m, inv_sum):
    return np.float32(math.exp(logits[row, e] - m)) * inv_sum


@cuda.jit(device=True, inline=True)
def _better(w, e, best_w, best_e):
    """(w, e) comes before (best_w, best_e): weight descending, then id ascending."""
    return w > best_w or (w == best_w and e < best_e)


@kernel
def moe_route(logits, top_k, norm_topk_prob, out_ids, out_weights):
    # logits: [rows, E] f32; out_ids: [rows, k] i32; out_weights: [rows, k] f32. A warp a row,
    # with the bits of one thread doing it all: the max (exact in any order); the softmax's
    # sum in ascending expert order (lane 0 adds the lanes' exps, kept in shared memory);
    # then k picks, each the first in (weight descending, id ascending) order of the experts
    # not yet picked (each lane's best, then a butterfly over the lanes: a total order, so
    # every lane gets the same pick); the renormalisation sums the picks in slot order.
    exps = cuda.shared.array((ROUTE_WARPS, ROUTE_SHARED), np.float32)
    total_sh = cuda.shared.array(ROUTE_WARPS, np.float32)
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    row = cuda.blockIdx.x * ROUTE_WARPS + warp
    live = row < logits.shape[0]
    row = min(row, logits.shape[0] - 1)  # a warp past the last row joins the shuffles only
    num_experts = logits.shape[1]
    m = logits[row, 0]
    for e in range(lane, num_experts, 32):
        m = max(m, logits[row, e])
    m = warp_max(m)
    shared = min(num_experts, ROUTE_SHARED)
    for e in range(lane, shared, 32):
        exps[warp, e] = np.float32(math.exp(logits[row, e] - m))
    cuda.syncthreads()  # every warp of the block is here (none returns early)
    if lane == 0:
        total = np.float32(0.0)
        for e in range(shared):
            total += exps[warp, e]
        for e in range(shared, num_experts):
            total += np.float32(math.exp(logits[row, e] - m))
        total_sh[warp] = total
    cuda.syncthreads()
    inv_sum = np.float32(1.0) / total_sh[warp]
    for e in range(lane, shared, 32):  # the weights, as _weight has them
        exps[warp, e] = exps[warp, e] * inv_sum
    prev_w = np.float32(np.inf)
    prev_e = -1
    for slot in range(top_k):
        best_w = np.float32(-1.0)
        best_e = num_experts
        for e in range(lane, num_experts, 32):
            w = exps[warp, e] if e < ROUTE_SHARED else _weight(logits, row, e, m, inv_sum)
            if _better(prev_w, prev_e, w, e) and _better(w, e, best_w, best_e):
                best_w = w
                best_e = e
        offset = 16
        while offset > 0:  # ids as floats: exact below 2**24 (the simulator shuffles floats)
            other_w = _shfl_xor(best_w, offset)
            other_e = np.int32(_shfl_xor(np.float32(best_e), offset))
            if _better(other_w, other_e, best_w, best_e):
                best_w = other_w
                best_e = other_e
            offset //= 2
        if live and lane == 0:
            out_ids[row, slot] = best_e if best_e < num_experts else -1
            out_weights[row, slot] = best_w
        prev_w = best_w
        prev_e = best_e
    if live and lane == 0 and norm_topk_prob:
        picked = np.float32(0.0)
        for slot in range(top_k):
            picked += out_weights[row, slot]
        for slot in range(top_k):
            out_weights[row, slot] = out_weights[row, slot] / picked


@kernel
def moe_combine(expert_out, weights, out):
    # expert_out: [rows * k, H] (row-slot r*k + j); weights: [rows, k]; out: [rows, H].
    # out[r] = sum_j weights[r, j] * expert_out[r*k + j], j = 0..k-1 in order. grid (rows,)
    # grid (rows, column blocks): the block of (r, b) takes columns b * blockDim .. (one a
    # thread): the same operations per element whatever the grid
    row = cuda.blockIdx.x
    top_k = weights.shape[1]
    i = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.shape[1]:
        acc = np.float32(0.0)
        for j in range(top_k):
            acc = cuda.fma(weights[row, j], expert_out[row * top_k + j, i], acc)
        out[row, i] = acc
