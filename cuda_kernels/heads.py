"""Attention inputs in one launch: from the fused q|k|v projection of a round's rows, the
per-head RMSNorm (q_norm / k_norm, Qwen3), RoPE of q and k, and the K and V writes into the
arena (with conversion to its dtype), replacing five launches (two norms, two ropes, one KV
write). Each step is the expression of its one-op kernel (norm.rms_norm, norm.rope,
kv.kv_write_*): the same reduction order and the same float32 operations.

Launch: grid (rows, nh + 2 * nkv), block HEAD_THREADS; block (r, h) takes head h of row r:
h < nh a query head (-> q_out), then nkv key heads and nkv value heads (-> kv_layer).
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.convert import to_bf16_bits, to_e4m3
from cuda_kernels.env import cuda, kernel
from cuda_kernels.norm import NORM_THREADS, inv_rms_of, sum_squares

HEAD_THREADS = NORM_THREADS  # the norm's reduction tree is NORM_THREADS wide
MAX_HEAD_DIM = 512


@cuda.jit(device=True)
def _head_norm(qkv, row, base, hd, w, eps, buf, partial):
    # buf[0:hd] = rms_norm(qkv[row, base:base+hd]) * w, as norm.rms_norm computes a row
    inv_rms = inv_rms_of(sum_squares(qkv, row, base, hd), hd, eps, partial)
    for i in range(cuda.threadIdx.x, hd, NORM_THREADS):
        buf[i] = (qkv[row, base + i] * inv_rms) * w[i]


@cuda.jit(device=True)
def _roped(buf, i, half, pos, inv_freq, mscale):
    # element i of the head after rotate-half RoPE on its first 2*half dims (norm.rope)
    if i >= 2 * half:
        return buf[i]
    j = i % half
    angle = np.float64(pos) * np.float64(inv_freq[j])
    cos_a = np.float32(math.cos(angle) * mscale)
    sin_a = np.float32(math.sin(angle) * mscale)
    x1 = buf[j]
    x2 = buf[j + half]
    if i < half:
        return x1 * cos_a - x2 * sin_a
    return x2 * cos_a + x1 * sin_a


@cuda.jit(device=True)
def _as_f32(x, scale):
    return x


@cuda.jit(device=True)
def _as_bf16(x, scale):
    return to_bf16_bits(x)


@cuda.jit(device=True)
def _as_fp8(x, scale):
    return to_e4m3(np.float32(x) / scale)  # kv.kv_write_fp8: e4m3(x / scale)


def _make_kernel(convert):
    @kernel
    def attn_inputs(qkv, q_norm, k_norm, use_norm, eps, positions, inv_freq, mscale, kv_layer, slots,  # noqa: E501
                    k_scale, v_scale, q_out):
        # qkv: [rows, (nh + 2*nkv) * hd] f32; q_norm, k_norm: [hd] f32 (used when use_norm);
        # positions, slots: [rows] i64; inv_freq: [rot/2] f32; kv_layer: [2, slots, nkv, hd];
        # q_out: [rows, nh, hd] f32
        buf = cuda.shared.array(MAX_HEAD_DIM, np.float32)
        partial = cuda.shared.array(NORM_THREADS, np.float32)
        row, head, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        nh, hd, nkv = q_out.shape[1], q_out.shape[2], kv_layer.shape[2]
        base = head * hd
        is_value = head >= nh + nkv
        if use_norm and not is_value:  # uniform over the block: the barriers are safe
            _head_norm(qkv, row, base, hd, q_norm if head < nh else k_norm, eps, buf, partial)
        else:
            for i in range(tid, hd, HEAD_THREADS):
                buf[i] = qkv[row, base + i]
        cuda.syncthreads()
        half = inv_freq.shape[0]
        pos = positions[row]
        slot = slots[row]
        for i in range(tid, hd, HEAD_THREADS):
            if is_value:
                kv_layer[1, slot, head - nh - nkv, i] = convert(buf[i], np.float32(v_scale))
            elif head < nh:
                q_out[row, head, i] = _roped(buf, i, half, pos, inv_freq, mscale)
            else:
                kv_layer[0, slot, head - nh, i] = convert(_roped(buf, i, half, pos, inv_freq, mscale),
                                                          np.float32(k_scale))

    return attn_inputs


KERNELS = {"f32": _make_kernel(_as_f32), "bf16": _make_kernel(_as_bf16), "fp8": _make_kernel(_as_fp8)}
