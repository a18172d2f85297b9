"""MoE routing and the weighted combine of expert outputs.

Expert dispatch itself is the grouped matmul of cuda_kernels/matmul.py: row-slot
(r, j) runs through expert out_ids[r, j]'s weights, one row per block, so no host round
trip and no dependence on which other rows chose the same expert.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.env import cuda, kernel

ROUTE_THREADS = 64
COMBINE_THREADS = 128


@cuda.jit(device=True)
def _weight(logits, row, e, m, inv_sum):
    return np.float32(math.exp(logits[row, e] - m)) * inv_sum


@kernel
def moe_route(logits, top_k, norm_topk_prob, out_ids, out_weights):
    # logits: [rows, E] f32; out_ids: [rows, k] i32; out_weights: [rows, k] f32. One thread a
    # row: softmax over all E (sum in ascending expert order), then k picks in the order
    # (weight descending, id ascending) without a scratch array.
    row = cuda.grid(1)
    if row >= logits.shape[0]:
        return
    num_experts = logits.shape[1]
    m = logits[row, 0]
    for e in range(1, num_experts):
        m = max(m, logits[row, e])
    total = np.float32(0.0)
    for e in range(num_experts):
        total += np.float32(math.exp(logits[row, e] - m))
    inv_sum = np.float32(1.0) / total
    prev_w = np.float32(np.inf)
    prev_id = -1
    for slot in range(top_k):
        best_w = np.float32(-1.0)
        best_id = -1
        for e in range(num_experts):
            w = _weight(logits, row, e, m, inv_sum)
            if (w < prev_w or (w == prev_w and e > prev_id)) and w > best_w:
                best_w = w
                best_id = e
        out_ids[row, slot] = best_id
        out_weights[row, slot] = best_w
        prev_w = best_w
        prev_id = best_id
    if norm_topk_prob:
        picked = np.float32(0.0)
        for slot in range(top_k):
            picked += out_weights[row, slot]
        for slot in range(top_k):
            out_weights[row, slot] = out_weights[row, slot] / picked


@kernel
def moe_combine(expert_out, weights, out):
    # expert_out: [rows * k, H] (row-slot r*k + j); weights: [rows, k]; out: [rows, H].
    # out[r] = sum_j weights[r, j] * expert_out[r*k + j], j = 0..k-1 in order. grid (rows,)
    row = cuda.blockIdx.x
    top_k = weights.shape[1]
    for i in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        acc = np.float32(0.0)
        for j in range(top_k):
            acc = cuda.fma(weights[row, j], expert_out[row * top_k + j, i], acc)
        out[row, i] = acc
