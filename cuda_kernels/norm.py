"""RMSNorm, RoPE and SwiGLU's silu(gate) * up.

rms_norm: grid (rows,), block NORM_THREADS (fixed, so the reduction order of a row never
depends on the launch). rope / silu_mul: one thread per element, grid-stride loops.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.env import block_sum, cuda, kernel

NORM_THREADS = 128
ELEMWISE_THREADS = 256


@cuda.jit(device=True)
def sum_squares(x, row, base, dim):
    # Thread t: fma(x_i, x_i, acc) for i = t, t + NORM_THREADS, ... ascending (x[row, base + i]).
    # Eight loads are issued before their fmas (one memory round trip per eight elements
    # instead of one each); the fmas keep the order, so the bits are those of the plain loop.
    tid = cuda.threadIdx.x
    acc = np.float32(0.0)
    i = tid
    while i + 7 * NORM_THREADS < dim:
        x0, x1 = x[row, base + i], x[row, base + i + NORM_THREADS]
        x2, x3 = x[row, base + i + 2 * NORM_THREADS], x[row, base + i + 3 * NORM_THREADS]
        x4, x5 = x[row, base + i + 4 * NORM_THREADS], x[row, base + i + 5 * NORM_THREADS]
        x6, x7 = x[row, base + i + 6 * NORM_THREADS], x[row, base + i + 7 * NORM_THREADS]
        acc = cuda.fma(x0, x0, acc)
        acc = cuda.fma(x1, x1, acc)
        acc = cuda.fma(x2, x2, acc)
        acc = cuda.fma(x3, x3, acc)
        acc = cuda.fma(x4, x4, acc)
        acc = cuda.fma(x5, x5, acc)
        acc = cuda.fma(x6, x6, acc)
        acc = cuda.fma(x7, x7, acc)
        i += 8 * NORM_THREADS
    while i < dim:
        xi = x[row, base + i]
        acc = cuda.fma(xi, xi, acc)
        i += NORM_THREADS
    return acc


@cuda.jit(device=True)
def inv_rms_of(acc, dim, eps, partial):
    # The block's partial sums (a block of NORM_THREADS) -> 1 / rms.
    total = block_sum(acc, partial)
    return np.float32(1.0) / math.sqrt(total / np.float32(dim) + np.float32(eps))


@kernel
def rms_norm(x, w, eps, out):
    # x, out: [rows, dim] f32; w: [dim] f32. Thread t sums x[t], x[t+128], ... in order,
    # then a shared-memory tree halves 128 -> 1 in a fixed order.
    partial = cuda.shared.array(NORM_THREADS, np.float32)
    row = cuda.blockIdx.x
    dim = x.shape[1]
    inv_rms = inv_rms_of(sum_squares(x, row, 0, dim), dim, eps, partial)
    i = cuda.threadIdx.x
    while i + 3 * NORM_THREADS < dim:  # four elements' loads in flight
        a0, a1 = x[row, i], x[row, i + NORM_THREADS]
        a2, a3 = x[row, i + 2 * NORM_THREADS], x[row, i + 3 * NORM_THREADS]
        w0, w1 = w[i], w[i + NORM_THREADS]
        w2, w3 = w[i + 2 * NORM_THREADS], w[i + 3 * NORM_THREADS]
        out[row, i] = (a0 * inv_rms) * w0
        out[row, i + NORM_THREADS] = (a1 * inv_rms) * w1
        out[row, i + 2 * NORM_THREADS] = (a2 * inv_rms) * w2
        out[row, i + 3 * NORM_THREADS] = (a3 * inv_rms) * w3
        i += 4 * NORM_THREADS
    while i < dim:
        out[row, i] = (x[row, i] * inv_rms) * w[i]
        i += NORM_THREADS


MAX_HELD = 32  # elements a thread holds in registers: rows up to 4096 wide in one pass
# (64 needs 255 registers and spills: ptxas -v)
_HELD_KERNELS: dict[int, object] = {}


def rms_norm_kernel(dim: int):
    """The rms_norm kernel for rows `dim` wide: rows of up to MAX_HELD * NORM_THREADS held in
    registers (the same bits as `rms_norm`), wider rows `rms_norm` itself."""
    held = 1
    while held * NORM_THREADS < dim:
        held *= 2
    if held > MAX_HELD:
        return rms_norm
    if held not in _HELD_KERNELS:
        _HELD_KERNELS[held] = _make_held_rms_norm(held)
    return _HELD_KERNELS[held]


def _make_held_rms_norm(held: int):
    @kernel
    def rms_norm_held(x, w, eps, out):
        # rms_norm for rows of at most held * NORM_THREADS: every load of the thread (x and w)
        # is issued up front (indices past the row read its last element; their x counts as
        # 0), and both stay in registers for the output. The same fmas in the
        # same order as rms_norm (adding fma(0, 0, acc) = acc changes nothing): the same bits.
        partial = cuda.shared.array(NORM_THREADS, np.float32)
        vals = cuda.local.array(held, np.float32)
        weights = cuda.local.array(held, np.float32)
        row = cuda.blockIdx.x
        dim = x.shape[1]
        tid = cuda.threadIdx.x
        for k in range(held):  # unrolled: constant indices keep both arrays in registers
            vals[k] = x[row, min(tid + k * NORM_THREADS, dim - 1)]
        for k in range(held):  # the weights too, before the block's reduction waits
            weights[k] = w[min(tid + k * NORM_THREADS, dim - 1)]
        acc = np.float32(0.0)
        for k in range(held):
            v = vals[k] if tid + k * NORM_THREADS < dim else np.float32(0.0)
            acc = cuda.fma(v, v, acc)
        inv_rms = inv_rms_of(acc, dim, eps, partial)
        for k in range(held):
            i = tid + k * NORM_THREADS
            if i < dim:
                out[row, i] = (vals[k] * inv_rms) * weights[k]

    return rms_norm_held


@kernel
def rope(x, positions, inv_freq, mscale):
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


@kernel
def silu_mul(gate, up, out):
    # gate, up, out: [rows, inter] f32; out = gate * sigmoid(gate) * up
    inter = gate.shape[1]
    total = gate.shape[0] * inter
    start = cuda.grid(1)
    for e in range(start, total, cuda.gridsize(1)):
        g = gate[e // inter, e % inter]
        sig = np.float32(1.0) / (np.float32(1.0) + math.exp(-g))
        out[e // inter, e % inter] = (g * sig) * up[e // inter, e % inter]
