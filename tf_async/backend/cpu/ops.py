"""CpuOps: the Ops of docs/KERNELS.md on NumPy arrays, backed by the Numba kernels.

Each method checks dtype, shape and contiguity (and the index values that a kernel would
use as addresses) before calling a kernel, so that a bad call raises a clear ValueError
instead of reading or writing out of bounds inside compiled code.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from ..base import Capabilities
from ..weights import AffineWeight, DenseWeight, FusedLinear, Linear, LinearParts
from . import gdn, kernels

KV_DTYPES: dict[str, Any] = {
    "f32": np.float32, "float32": np.float32,
    "bf16": np.uint16, "bfloat16": np.uint16,
    "fp8": np.uint8, "fp8_e4m3": np.uint8, "e4m3": np.uint8,
}


def _check(array: Any, name: str, dtype: Any, ndim: int | None = None) -> np.ndarray:
    """`array` must be a C-contiguous NumPy array of `dtype` (and rank `ndim`)."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (use np.ascontiguousarray)")
    return array


def _check_shape(array: np.ndarray, name: str, shape: tuple[int, ...]) -> None:
    if array.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {array.shape}")


def _check_range(values: np.ndarray, name: str, low: int, high: int) -> None:
    """Every value of the 1-D index array in [low, high)."""
    if kernels.any_out_of_range(values, low, high):
        raise ValueError(f"{name}: values must lie in [{low}, {high}), got "
                         f"[{int(values.min())}, {int(values.max())}]")


def _check_affine(w: AffineWeight) -> None:
    if w.bits not in (4, 8):
        raise ValueError(f"AffineWeight: bits must be 4 or 8, got {w.bits}")
    _check(w.codes, "AffineWeight.codes", np.uint32, 2)
    groups = w.in_features // w.group_size if w.group_size > 0 else -1
    if groups <= 0 or groups * w.group_size != w.in_features:
        raise ValueError(f"AffineWeight: group_size {w.group_size} does not divide "
                         f"in_features {w.in_features}")
    for name, array in (("scales", w.scales), ("biases", w.biases)):
        _check(array, f"AffineWeight.{name}", np.float32, 2)
        _check_shape(array, f"AffineWeight.{name}", (w.out_features, groups))


def _check_weight(w: Any) -> None:
    if isinstance(w, AffineWeight):
        _check_affine(w)
    elif isinstance(w, DenseWeight):
        _check(w.w, "DenseWeight.w", np.float32, 2)
    else:
        raise ValueError(f"unknown weight kind {type(w).__name__} (expected a 2-D Linear)")


def _check_kv(kv: Any, layer: int) -> np.ndarray:
    if not isinstance(kv, np.ndarray) or kv.dtype not in (np.float32, np.uint16, np.uint8):
        raise ValueError("kv: expected a numpy array of float32, uint16 (bf16) or uint8 (fp8)")
    _check(kv, "kv", kv.dtype, 5)
    if kv.shape[1] != 2:
        raise ValueError(f"kv: expected [layers, 2, slots, kv_heads, head_dim], got {kv.shape}")
    if not 0 <= layer < kv.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {kv.shape[0]})")
    return kv


def _layer_scales(kv_scales: Any, kv: np.ndarray, layer: int) -> tuple[float, float]:
    if kv_scales is None:
        return 1.0, 1.0
    _check(kv_scales, "kv_scales", np.float32, 2)
    _check_shape(kv_scales, "kv_scales", (kv.shape[0], 2))
    return float(kv_scales[layer, 0]), float(kv_scales[layer, 1])


def _int8_x_fits(w: AffineWeight) -> bool:
    """The rule of cuda_kernels.qdot.supports: whole chunks of 32 inside each scale group."""
    return w.in_features % 32 == 0 and w.group_size % 32 == 0


class CpuOps:
    """Ops on the CPU: NumPy arrays in and out, Numba kernels inside (docs/KERNELS.md)."""

    name = "cpu"
    xp = np
    capabilities = Capabilities()  # host sampler, checks on the host already, no graphs

    def __init__(self, int8_x: bool = False) -> None:
        self._checked: dict[int, Linear] = {}  # id -> uploaded weight (kept alive: no id reuse)
        # int8_x: affine matmuls on int8 x, with the GPU's numerics and order (the CPU twin of
        # cuda_kernels/qdot.py; a slow reference for checking the GPU backend). Off: float32 x.
        self.int8_x = int8_x

    def asarray(self, array: np.ndarray) -> np.ndarray:
        """To the device: identity on the CPU."""
        return array

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)

    def upload_linear(self, w: Linear) -> Linear:
        """Weights already live in host memory; they are checked once here so that `linear`
        can skip the checks on the step path. Stacked experts are checked expert by expert."""
        array = w.codes if isinstance(w, AffineWeight) else w.w
        for expert in (w.expert(e) for e in range(array.shape[0])) if array.ndim == 3 else (w,):
            _check_weight(expert)
        self._checked[id(w)] = w
        return w

    def synchronize(self) -> None:
        """Kernels run synchronously on the CPU."""

    def unchecked(self) -> AbstractContextManager[None]:
        """The CPU's checks read host memory (no sync to save): they always run."""
        return nullcontext()

    # ------------------------------------------------------------------ matmuls
    def linear(self, x: np.ndarray, w: FusedLinear, bias: np.ndarray | None = None) -> np.ndarray:
        """x [..., in] @ w.T (+ bias) -> [..., out_f]; LinearParts: the parts side by side."""
        if isinstance(w, LinearParts):
            out = np.concatenate([self.linear(x, part) for part in w.parts], axis=-1)
            return self._add_bias(out, bias, w.out_features)
        if self._checked.get(id(w)) is not w:
            _check_weight(w)
        _check(x, "linear x", np.float32)
        if x.ndim == 0 or x.shape[-1] != w.in_features:
            raise ValueError(f"linear: x has shape {x.shape}, weight expects in_features "
                             f"{w.in_features}")
        rows = x.reshape(-1, w.in_features)
        out = np.empty((rows.shape[0], w.out_features), np.float32)
        if isinstance(w, AffineWeight) and self.int8_x and _int8_x_fits(w):
            xq = np.empty(rows.shape, np.int8)
            xs = np.empty((rows.shape[0], 2 * rows.shape[1] // 32), np.float32)
            kernels.quantize_rows_int8(rows, w.bits == 4, xq, xs)
            kernels.matmul_affine_int8x(xq, xs, w.codes, w.scales, w.biases, w.bits, w.group_size, out)
        elif isinstance(w, AffineWeight):
            kernels.matmul_affine(rows, w.codes, w.scales, w.biases, w.bits, w.group_size, out)
        else:
            kernels.matmul_dense(rows, w.w, out)
        return self._add_bias(out, bias, w.out_features).reshape(*x.shape[:-1], w.out_features)

    @staticmethod
    def _add_bias(out: np.ndarray, bias: np.ndarray | None, out_features: int) -> np.ndarray:
        if bias is not None:
            _check(bias, "linear bias", np.float32, 1)
            _check_shape(bias, "linear bias", (out_features,))
            out += bias
        return out

    def embed(self, w: Linear, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` [rows] int64 of the table w [V, H] -> [rows, H] float32."""
        if self._checked.get(id(w)) is not w:
            _check_weight(w)
        _check(ids, "embed ids", np.int64, 1)
        _check_range(ids, "embed ids", 0, w.out_features)
        out = np.empty((ids.shape[0], w.in_features), np.float32)
        if isinstance(w, AffineWeight):
            kernels.embed_affine(w.codes, w.scales, w.biases, w.bits, w.group_size, ids, out)
        else:
            kernels.embed_dense(w.w, ids, out)
        return out

    # ------------------------------------------------------------------ row-wise ops
    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """RMS-normalise the last axis of x (any leading dims) and scale by w [dim]."""
        _check(x, "rms_norm x", np.float32)
        _check(w, "rms_norm weight", np.float32, 1)
        if x.ndim == 0 or x.shape[-1] != w.shape[0]:
            raise ValueError(f"rms_norm: x shape {x.shape} does not end in weight dim {w.shape[0]}")
        out = np.empty_like(x)
        rows = x.reshape(-1, w.shape[0])
        kernels.rms_norm(rows, w, float(eps), out.reshape(rows.shape))
        return out

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
             mscale: float) -> None:
        """RoPE in place. x [rows, heads, hd], positions [rows] int64, inv_freq [rot/2]."""
        _check(x, "rope x", np.float32, 3)
        _check(positions, "rope positions", np.int64, 1)
        _check(inv_freq, "rope inv_freq", np.float32, 1)
        _check_shape(positions, "rope positions", (x.shape[0],))
        if 2 * inv_freq.shape[0] > x.shape[2]:
            raise ValueError(f"rope: rotary dims {2 * inv_freq.shape[0]} exceed head_dim {x.shape[2]}")
        kernels.rope(x, positions, inv_freq, float(mscale))

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """silu(gate) * up, both [..., I]."""
        _check(gate, "silu_mul gate", np.float32)
        _check(up, "silu_mul up", np.float32)
        _check_shape(up, "silu_mul up", gate.shape)
        out = np.empty_like(gate)
        width = gate.shape[-1] if gate.ndim else 1
        kernels.silu_mul(gate.reshape(-1, width), up.reshape(-1, width), out.reshape(-1, width))
        return out

    # ------------------------------------------------------------------ KV cache
    def alloc_kv(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str) -> np.ndarray:
        """Zeroed arena [num_layers, 2, num_slots, num_kv_heads, head_dim] of the KV dtype
        (f32 -> float32, bf16 -> uint16 bits, fp8 -> uint8 E4M3FN)."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r}: expected one of f32, bf16, fp8")
        shape = (num_layers, 2, num_slots, num_kv_heads, head_dim)
        if min(shape) < 1:
            raise ValueError(f"alloc_kv: every dimension must be >= 1, got {shape}")
        return np.zeros(shape, KV_DTYPES[kv_dtype])

    def kv_write(self, kv: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray,
                 slots: np.ndarray, kv_scales: np.ndarray | None) -> None:
        """Store k, v [rows, nkv, hd] float32 at `slots` [rows] int64 of `layer`."""
        _check_kv(kv, layer)
        _check(k, "kv_write k", np.float32, 3)
        _check(v, "kv_write v", np.float32, 3)
        _check(slots, "kv_write slots", np.int64, 1)
        _check_shape(k, "kv_write k", (slots.shape[0], *kv.shape[3:]))
        _check_shape(v, "kv_write v", k.shape)
        _check_range(slots, "kv_write slots", 0, kv.shape[2])
        k_scale, v_scale = _layer_scales(kv_scales, kv, layer)
        kernels.kv_write(k, v, kv[layer], slots, k_scale, v_scale)

    def attention(self, q: np.ndarray, kv: np.ndarray, layer: int, kv_scales: np.ndarray | None,
                  block_table: np.ndarray, row_seq: np.ndarray, row_pos: np.ndarray,
                  page_size: int, sm_scale: float) -> np.ndarray:
        """Causal paged GQA attention of q [rows, nh, hd] over `layer` -> [rows, nh, hd]."""
        _check_kv(kv, layer)
        _check(q, "attention q", np.float32, 3)
        if q.shape[2] != kv.shape[4] or q.shape[1] % kv.shape[3] != 0:
            raise ValueError(f"attention: q shape {q.shape} does not fit kv heads/dim "
                             f"{kv.shape[3:]}")
        self._check_pages(kv, block_table, row_seq, row_pos, q.shape[0], page_size)
        k_scale, v_scale = _layer_scales(kv_scales, kv, layer)
        out = np.empty_like(q)
        kernels.paged_attention(q, kv[layer], k_scale, v_scale, block_table, row_seq, row_pos,
                                page_size, float(sm_scale), out)
        return out

    def zero_pages(self, kv: np.ndarray, page_ids: np.ndarray, page_size: int) -> None:
        """Zero the K and V slots of `page_ids` [n] int32 in every layer."""
        _check_kv(kv, 0)
        _check(page_ids, "zero_pages page_ids", np.int32, 1)
        num_pages = self._num_pages(kv, page_size)
        _check_range(page_ids, "zero_pages page_ids", 0, num_pages)
        kernels.zero_pages(kv, page_ids, page_size)

    @staticmethod
    def _num_pages(kv: np.ndarray, page_size: int) -> int:
        if page_size < 1 or kv.shape[2] % page_size != 0:
            raise ValueError(f"page_size {page_size} does not divide num_slots {kv.shape[2]}")
        return kv.shape[2] // page_size

    def _check_pages(self, kv: np.ndarray, block_table: np.ndarray, row_seq: np.ndarray,
                     row_pos: np.ndarray, rows: int, page_size: int) -> None:
        _check(block_table, "attention block_table", np.int32, 2)
        _check(row_seq, "attention row_seq", np.int32, 1)
        _check(row_pos, "attention row_pos", np.int64, 1)
        _check_shape(row_seq, "attention row_seq", (rows,))
        _check_shape(row_pos, "attention row_pos", (rows,))
        num_pages = self._num_pages(kv, page_size)
        bad_row = kernels.first_bad_page_row(block_table, row_seq, row_pos, page_size, num_pages)
        if bad_row >= 0:
            raise ValueError(
                f"attention: row {bad_row} (stream {int(row_seq[bad_row])}, position "
                f"{int(row_pos[bad_row])}) needs a block_table entry outside [0, {num_pages}) "
                f"or a stream outside block_table {block_table.shape}")

    # ------------------------------------------------------------------ MoE
    def moe(self, x: np.ndarray, router: Linear, gate: Linear, up: Linear, down: Linear,
            top_k: int, norm_topk_prob: bool) -> np.ndarray:
        """Top-k mixture of SwiGLU experts. x [rows, H]; gate/up/down stacked [E, ...].
        Each expert's rows go through the same matmul kernels; a row's expert outputs are
        summed in slot order j = 0..k-1, so the sum never depends on other rows."""
        _check(x, "moe x", np.float32, 2)
        logits = self.linear(x, router)
        num_experts = logits.shape[1]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe: top_k {top_k} not in [1, {num_experts}]")
        ids = np.empty((x.shape[0], top_k), np.int32)
        weights = np.empty((x.shape[0], top_k), np.float32)
        kernels.moe_route(logits, top_k, bool(norm_topk_prob), ids, weights)
        expert_out = np.zeros((x.shape[0], top_k, x.shape[1]), np.float32)
        for e in np.unique(ids).tolist():
            rows, slots = np.nonzero(ids == e)
            x_e = x[rows]
            h = self.silu_mul(self.linear(x_e, gate.expert(e)), self.linear(x_e, up.expert(e)))
            expert_out[rows, slots] = self.linear(h, down.expert(e))
        out = np.zeros_like(x)
        for j in range(top_k):
            out += weights[:, j, None] * expert_out[:, j]
        return out

    # ------------------------------------------------------------------ layer ops
    # CudaOps fuses each into fewer launches (the same bits); here each is the basic ops it
    # stands for, so the CPU runs the decoder's one layer code with the bits of those ops.
    def concat_linears(self, ws: list[Linear]) -> tuple[LinearParts, list[Linear]]:
        """ws kept apart (the checkpoint holds them: a concatenation would be a second copy)."""
        return LinearParts(tuple(ws)), list(ws)

    def rms_norm_for(self, x: np.ndarray, w: np.ndarray, eps: float,
                     linear: FusedLinear) -> np.ndarray:
        return self.rms_norm(x, w, eps)

    def attn_inputs(self, qkv: np.ndarray, q_norm: np.ndarray | None, k_norm: np.ndarray | None,
                    eps: float, positions: np.ndarray, inv_freq: np.ndarray, mscale: float,
                    kv: np.ndarray, layer: int, slots: np.ndarray, kv_scales: np.ndarray | None,
                    num_heads: int) -> np.ndarray:
        _check_kv(kv, layer)
        nkv, hd = kv.shape[3], kv.shape[4]
        rows, q_width, k_width = qkv.shape[0], num_heads * hd, nkv * hd
        _check(qkv, "attn_inputs qkv", np.float32, 2)
        _check_shape(qkv, "attn_inputs qkv", (rows, q_width + 2 * k_width))
        q, k, v = (np.ascontiguousarray(qkv[:, lo:hi]).reshape(rows, -1, hd) for lo, hi in
                   ((0, q_width), (q_width, q_width + k_width), (q_width + k_width, qkv.shape[1])))
        if q_norm is not None:
            assert k_norm is not None
            q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        self.rope(q, positions, inv_freq, mscale)
        self.rope(k, positions, inv_freq, mscale)
        self.kv_write(kv, layer, k, v, slots, kv_scales)
        return q

    def attention_for(self, q: np.ndarray, kv: np.ndarray, layer: int,
                      kv_scales: np.ndarray | None, block_table: np.ndarray, row_seq: np.ndarray,
                      row_pos: np.ndarray, page_size: int, sm_scale: float,
                      linear: Linear) -> np.ndarray:
        out = self.attention(q, kv, layer, kv_scales, block_table, row_seq, row_pos, page_size,
                             sm_scale)
        return out.reshape(q.shape[0], q.shape[1] * q.shape[2])

    def linear_into(self, x: np.ndarray, w: Linear, out: np.ndarray) -> np.ndarray:
        out += self.linear(x, w)
        return out

    def swiglu_linear(self, x: np.ndarray, gate_up: FusedLinear) -> np.ndarray:
        if not isinstance(gate_up, LinearParts) or len(gate_up.parts) != 2:
            raise ValueError("swiglu_linear: expected concat_linears([gate, up])")
        gate, up = gate_up.parts
        return self.silu_mul(self.linear(x, gate), self.linear(x, up))

    # ------------------------------------------------------------------ Gated DeltaNet
    def causal_conv1d(self, x: np.ndarray, conv_states: np.ndarray, weight: np.ndarray,
                      row_lanes: np.ndarray) -> np.ndarray:
        out = np.empty(x.shape, np.float32)
        gdn.causal_conv1d_batch(x, conv_states, weight, row_lanes, out)
        return out

    def gdn_qk_l2norm(self, mixed: np.ndarray, num_k_heads: int, head_k_dim: int, eps: float,
                      q_scale: float) -> tuple[np.ndarray, np.ndarray]:
        shape = (mixed.shape[0], num_k_heads, head_k_dim)
        q, k = np.empty(shape, np.float32), np.empty(shape, np.float32)
        gdn.gdn_qk_l2norm(mixed, num_k_heads, head_k_dim, eps, q_scale, q, k)
        return q, k

    def gdn_gates(self, a: np.ndarray, b: np.ndarray, a_log: np.ndarray,
                  dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g, beta = np.empty(a.shape, np.float32), np.empty(a.shape, np.float32)
        gdn.gdn_gates(a, b, a_log, dt_bias, g, beta)
        return g, beta

    def gated_delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                         beta: np.ndarray, states: np.ndarray, row_lanes: np.ndarray) -> np.ndarray:
        out = np.empty(v.shape, np.float32)
        gdn.gated_delta_rule_batch(q, k, v, g, beta, states, row_lanes, out)
        return out

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray,
                       eps: float) -> np.ndarray:
        out = np.empty(x.shape, np.float32)
        gdn.gated_rms_norm(x, z, weight, eps, out)
        return out

    def split_query_gate(self, qg: np.ndarray, num_heads: int,
                         head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        rows = qg.shape[0]
        q = np.empty((rows, num_heads, head_dim), np.float32)
        gate = np.empty((rows, num_heads * head_dim), np.float32)
        gdn.split_query_gate(qg, num_heads, head_dim, q, gate)
        return q, gate

    def sigmoid_gate_mul(self, x: np.ndarray, gate: np.ndarray) -> None:
        gdn.sigmoid_gate_mul(x, gate, x)
