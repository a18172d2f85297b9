"""RMSNorm, RoPE and SwiGLU's silu(gate) * up.

rms_norm: grid (rows,), block NORM_THREADS (fixed, so the reduction order of a row never
depends on the launch). rope / silu_mul: one thread per element, grid-stride loops.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.env import cuda

NORM_THREADS = 128
ELEMWISE_THREADS = 256


@cuda.jit
def rms_norm(x, w, eps, out):  # noqa: ANN001, ANN201
    # x, out: [rows, dim] f32; w: [dim] f32. Thread t sums x[t], x[t+128], ... in order,
    # then a shared-memory tree halves 128 -> 1 in a fixed order.
    partial = cuda.shared.array(NORM_THREADS, np.float32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    dim = x.shape[1]
    acc = np.float32(0.0)
    for i in range(tid, dim, NORM_THREADS):
        xi = x[row, i]
        acc = cuda.fma(xi, xi, acc)
    partial[tid] = acc
    cuda.syncthreads()
    stride = NORM_THREADS // 2
    while stride > 0:
        if tid < stride:
            partial[tid] = partial[tid] + partial[tid + stride]
        cuda.syncthreads()
        stride //= 2
    inv_rms = np.float32(1.0) / math.sqrt(partial[0] / np.float32(dim) + np.float32(eps))
    for i in range(tid, dim, NORM_THREADS):
        out[row, i] = (x[row, i] * inv_rms) * w[i]


@cuda.jit
def rope(x, positions, inv_freq, mscale):  # noqa: ANN001, ANN201
    # x: [rows, heads, hd] in place; rotate-half on the first 2*len(inv_freq) dims.
    # The angle is formed in float64 (positions reach 1e5; float32 would lose the phase).
    rows, heads = x.shape[0], x.shape[1]
    half = inv_freq.shape[0]
    total = rows * heads * half
    start = cuda.grid(1)
    for e in range(start, total, cuda.gridsize(1)):
        i = e % half
        head = (e // half) % heads
        row = e // (half * heads)
        angle = np.float64(positions[row]) * np.float64(inv_freq[i])
        cos_a = np.float32(math.cos(angle) * mscale)
        sin_a = np.float32(math.sin(angle) * mscale)
        x1 = x[row, head, i]
        x2 = x[row, head, i + half]
        x[row, head, i] = x1 * cos_a - x2 * sin_a
        x[row, head, i + half] = x2 * cos_a + x1 * sin_a


@cuda.jit
def silu_mul(gate, up, out):  # noqa: ANN001, ANN201
    # gate, up, out: [rows, inter] f32; out = gate * sigmoid(gate) * up
    inter = gate.shape[1]
    total = gate.shape[0] * inter
    start = cuda.grid(1)
    for e in range(start, total, cuda.gridsize(1)):
        g = gate[e // inter, e % inter]
        sig = np.float32(1.0) / (np.float32(1.0) + math.exp(-g))
        out[e // inter, e % inter] = (g * sig) * up[e // inter, e % inter]
