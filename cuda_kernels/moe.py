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
ROUTE_SHARED = 512  # experts whose exp(logit - max) a warp keeps in shared memory (and in registers)
ROUTE_PER_LANE = ROUTE_SHARED // 32  # of those, the ones a lane holds: experts lane, lane + 32, ...
ROUTE_MAX_TOP_K = 32  # picks a row: lane j holds slot j's (the launcher refuses more)
ROUTE_SUM_GROUP = 8  # lane 0's sum loads this many exps, then adds them in order
COMBINE_THREADS = 128


@cuda.jit(device=True)
def _weight(logits, row, e, m, inv_sum):
    return np.float32(math.exp(logits[row, e] - m)) * inv_sum


@cuda.jit(device=True, inline=True)
def _better(w, e, best_w, best_e):
    """(w, e) comes before (best_w, best_e): weight descending, then id ascending."""
    return w > best_w or (w == best_w and e < best_e)


@cuda.jit(device=True)
def _sequential_sum(exps, warp, count):
    """exps[warp, 0] + exps[warp, 1] + ... + exps[warp, count - 1], added one by one in that
    order from 0.0; the loads go ROUTE_SUM_GROUP at a time ahead of their adds (in flight
    together instead of one load, one add), the adds stay one dependent chain: the same bits."""
    group = cuda.local.array(ROUTE_SUM_GROUP, np.float32)
    total = np.float32(0.0)
    full = count - count % ROUTE_SUM_GROUP
    for base in range(0, full, ROUTE_SUM_GROUP):
        for j in range(ROUTE_SUM_GROUP):
            group[j] = exps[warp, base + j]
        for j in range(ROUTE_SUM_GROUP):
            total += group[j]
    for e in range(full, count):
        total += exps[warp, e]
    return total


@cuda.jit(device=True, inline=True)
def _lane_best(vals, lane, logits, row, m, inv_sum, prev_w, prev_e):
    """The lane's first expert in (weight descending, id ascending) order among those it holds
    and has not given yet: its registers in id order (a given one's weight is -1 there, as is a
    slot past the row's experts), then the experts past ROUTE_SHARED (ids lane + ROUTE_SHARED,
    + 32, ...) that come after (prev_w, prev_e), the last pick. (-1, E) when there is none (a
    NaN weight is never taken)."""
    num_experts = np.int32(logits.shape[1])
    best_w = np.float32(-1.0)
    best_e = num_experts
    for j in range(ROUTE_PER_LANE):  # ids ascend with j: a tie keeps the lower id
        if vals[j] > best_w:
            best_w = vals[j]
            best_e = np.int32(lane + 32 * j)
    for e in range(ROUTE_SHARED + lane, num_experts, 32):  # ids above every register's
        w = _weight(logits, row, e, m, inv_sum)
        if w > best_w and _better(prev_w, prev_e, w, e):
            best_w = w
            best_e = np.int32(e)
    return best_w, best_e


@kernel
def moe_route(logits, top_k, norm_topk_prob, out_ids, out_weights):
    # logits: [rows, E] f32; out_ids: [rows, k] i32; out_weights: [rows, k] f32; k <= 32. A
    # warp a row, with the bits of one thread doing it all: the max (exact in any order); the
    # softmax's sum in ascending expert order (lane 0 adds the lanes' exps, kept in shared
    # memory); then k picks, each the first in (weight descending, id ascending) order of the
    # experts not yet picked: every lane offers its own first (_lane_best), a butterfly over
    # the lanes takes the first of those (a total order, so every lane gets the same pick),
    # and only the lane that gave it looks for its next; the renormalisation sums the picks in
    # slot order. Lane j keeps the first ROUTE_SHARED experts' logits, then weights, of ids j,
    # j + 32, ... in registers (loaded at once), and slot j's pick; each output is written once.
    exps = cuda.shared.array((ROUTE_WARPS, ROUTE_SHARED), np.float32)
    total_sh = cuda.shared.array(ROUTE_WARPS, np.float32)
    vals = cuda.local.array(ROUTE_PER_LANE, np.float32)  # logits, then exps, then weights
    warp, lane = cuda.threadIdx.x // 32, np.int32(cuda.threadIdx.x % 32)
    row = cuda.blockIdx.x * ROUTE_WARPS + warp
    live = row < logits.shape[0]
    row = min(row, logits.shape[0] - 1)  # a warp past the last row joins the shuffles only
    num_experts = np.int32(logits.shape[1])
    shared = min(num_experts, ROUTE_SHARED)
    for j in range(ROUTE_PER_LANE):  # every load first, then the max over them in id order
        e = lane + 32 * j
        vals[j] = logits[row, e] if e < shared else np.float32(0.0)
    m = logits[row, 0]
    for j in range(ROUTE_PER_LANE):
        if lane + 32 * j < shared:
            m = max(m, vals[j])
    for e in range(ROUTE_SHARED + lane, num_experts, 32):
        m = max(m, logits[row, e])
    m = warp_max(m)
    for j in range(ROUTE_PER_LANE):
        e = lane + 32 * j
        if e < shared:
            vals[j] = np.float32(math.exp(vals[j] - m))
            exps[warp, e] = vals[j]
    cuda.syncthreads()  # every warp of the block is here (none returns early)
    if lane == 0:
        total = _sequential_sum(exps, warp, shared)
        for e in range(shared, num_experts):
            total += np.float32(math.exp(logits[row, e] - m))
        total_sh[warp] = total
    cuda.syncthreads()
    inv_sum = np.float32(1.0) / total_sh[warp]
    for j in range(ROUTE_PER_LANE):  # the weights, as _weight has them; -1: no expert here
        vals[j] = vals[j] * inv_sum if lane + 32 * j < shared else np.float32(-1.0)
    own_w, own_e = _lane_best(vals, lane, logits, row, m, inv_sum, np.float32(np.inf), np.int32(-1))
    picked = np.float32(0.0)  # the picks' sum in slot order
    mine_w = np.float32(0.0)  # slot `lane`'s pick
    mine_e = np.int32(-1)
    for slot in range(top_k):
        best_w = own_w
        best_e = own_e
        offset = 16
        while offset > 0:  # ids as floats: exact below 2**24 (the simulator shuffles floats)
            other_w = _shfl_xor(best_w, offset)
            other_e = np.int32(_shfl_xor(np.float32(best_e), offset))
            if _better(other_w, other_e, best_w, best_e):
                best_w = other_w
                best_e = other_e
            offset //= 2
        if lane == slot:
            mine_w = best_w
            mine_e = best_e
        picked += best_w
        if own_e == best_e:  # this lane gave the pick: drop it, offer its next
            for j in range(ROUTE_PER_LANE):
                if np.int32(lane + 32 * j) == best_e:
                    vals[j] = np.float32(-1.0)
            own_w, own_e = _lane_best(vals, lane, logits, row, m, inv_sum, best_w, best_e)
    if live and lane < top_k:
        out_ids[row, lane] = mine_e if mine_e < num_experts else -1
        out_weights[row, lane] = mine_w / picked if norm_topk_prob else mine_w


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
