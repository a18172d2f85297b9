"""CpuOps: the Ops of docs/KERNELS.md on NumPy arrays, backed by the Numba kernels.

Each method checks dtype, shape and contiguity (and the index values that a kernel would
use as addresses, backend/checks.py shared with CudaOps) before calling a kernel, so that a
bad call raises a clear BadInputError (a ValueError) instead of reading or writing out of
bounds inside compiled code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ...errors import BadInputError
from ..base import Capabilities
from ..checks import (
    check_affine,
    check_array,
    check_kv,
    check_kv_dtype,
    check_shape,
    check_shared_expert_add,
    kv_shape,
    num_pages_of,
)
from ..weights import AffineWeight, DenseWeight, FusedLinear, Linear, LinearParts
from . import gdn, int8_matmul, kernels


def _check_range(values: np.ndarray, name: str, low: int, high: int) -> None:
    """Every value of the 1-D index array in [low, high)."""
    if kernels.any_out_of_range(values, low, high):
        raise BadInputError(f"{name}: values must lie in [{low}, {high}), got "
                         f"[{int(values.min())}, {int(values.max())}]")


def _check_weight(w: Any) -> None:
    if isinstance(w, AffineWeight):
        check_affine(w, ndim=2)
    elif isinstance(w, DenseWeight):
        check_array(w.w, "DenseWeight.w", np.float32, 2)
    else:
        raise BadInputError(f"unknown weight kind {type(w).__name__} (expected a 2-D Linear)")


def _layer_scales(kv_scales: Any, kv: np.ndarray, layer: int) -> tuple[float, float]:
    if kv_scales is None:
        return 1.0, 1.0
    check_array(kv_scales, "kv_scales", np.float32, 2)
    check_shape(kv_scales, "kv_scales", (kv.shape[0], 2))
    return float(kv_scales[layer, 0]), float(kv_scales[layer, 1])


def _int8_x_fits(w: Any) -> bool:
    """The rule of cuda_kernels.qdot.supports: whole chunks of 32 inside each scale group."""
    return isinstance(w, AffineWeight) and w.in_features % 32 == 0 and w.group_size % 32 == 0


class CpuOps:
    """Ops on the CPU: NumPy arrays in and out, Numba kernels inside (docs/KERNELS.md)."""

    name = "cpu"
    xp = np
    # host sampler, no graphs; the runner checks a round's indices once (round_checks)
    capabilities = Capabilities(round_checks=True)

    def __init__(self, int8_x: bool = True) -> None:
        # id -> uploaded weight or concat_linears of them (kept alive: no id reuse)
        self._checked: dict[int, FusedLinear] = {}
        self._plans: dict[int, _MatmulPlan] = {}  # id -> plan of a weight in _checked
        # int8_x (the default): affine matmuls on int8 x where the weight fits (_int8_x_fits:
        # the GPU's rule), with the GPU's numerics and order (cuda_kernels/qdot.py), on byte
        # SIMD (int8_matmul; kernels.matmul_affine_int8x for groups of 32 * 3, 5, ...).
        # Off: float32 x (kernels.matmul_affine).
        self.int8_x = int8_x
        self.index_checks = True  # False inside unchecked(): the caller checked the indices

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

    @contextmanager
    def unchecked(self) -> Iterator[None]:
        """Skip the per-op index range checks (a kernel call each: slots, block-table pages)
        inside the block; the runner checked the round's indices once on its packed copy.
        Dtype, layout and shape checks still run."""
        before, self.index_checks = self.index_checks, False
        try:
            yield
        finally:
            self.index_checks = before

    # ------------------------------------------------------------------ matmuls
    def linear(self, x: np.ndarray, w: FusedLinear, bias: np.ndarray | None = None) -> np.ndarray:
        """x [..., in] @ w.T (+ bias) -> [..., out_f]; LinearParts: the parts side by side."""
        plan = self._plan(w)
        if not (type(x) is np.ndarray and x.dtype == np.float32 and x.flags.c_contiguous):
            check_array(x, "linear x", np.float32)
        if x.ndim == 0 or x.shape[-1] != plan.in_features:
            raise BadInputError(f"linear: x has shape {x.shape}, weight expects in_features "
                                f"{plan.in_features}")
        rows = x if x.ndim == 2 else x.reshape(-1, plan.in_features)
        out = np.empty((rows.shape[0], plan.out_features), np.float32)
        plan.run(rows, out)
        out = self._add_bias(out, bias, plan.out_features)
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], plan.out_features)

    def _plan(self, w: FusedLinear) -> _MatmulPlan:
        """How `w` is multiplied, checked once for a weight this ops uploaded (or a
        concat_linears of them) and kept; other weights (an expert's view made per call)
        are checked every time and not kept."""
        plan = self._plans.get(id(w))
        if plan is not None and plan.weight is w:
            return plan
        keep = self._checked.get(id(w)) is w
        plan = _MatmulPlan(w, self.int8_x, self._checked, keep)
        if keep:
            self._plans[id(w)] = plan
        return plan

    @staticmethod
    def _add_bias(out: np.ndarray, bias: np.ndarray | None, out_features: int) -> np.ndarray:
        if bias is not None:
            check_array(bias, "linear bias", np.float32, 1)
            check_shape(bias, "linear bias", (out_features,))
            out += bias
        return out

    def embed(self, w: Linear, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` [rows] int64 of the table w [V, H] -> [rows, H] float32."""
        if self._checked.get(id(w)) is not w:
            _check_weight(w)
        check_array(ids, "embed ids", np.int64, 1)
        if self.index_checks:
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
        check_array(x, "rms_norm x", np.float32)
        check_array(w, "rms_norm weight", np.float32, 1)
        if x.ndim == 0 or x.shape[-1] != w.shape[0]:
            raise BadInputError(f"rms_norm: x shape {x.shape} does not end in weight dim {w.shape[0]}")
        out = np.empty_like(x)
        rows = x.reshape(-1, w.shape[0])
        kernels.rms_norm(rows, w, float(eps), out.reshape(rows.shape))
        return out

    def rope(self, x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
             mscale: float) -> None:
        """RoPE in place. x [rows, heads, hd], positions [rows] int64, inv_freq [rot/2]."""
        check_array(x, "rope x", np.float32, 3)
        _check_rope(positions, inv_freq, x.shape[0], x.shape[2])
        kernels.rope(x, positions, inv_freq, float(mscale))

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """silu(gate) * up, both [..., I]."""
        check_array(gate, "silu_mul gate", np.float32)
        check_array(up, "silu_mul up", np.float32)
        check_shape(up, "silu_mul up", gate.shape)
        out = np.empty_like(gate)
        width = gate.shape[-1] if gate.ndim else 1
        kernels.silu_mul(gate.reshape(-1, width), up.reshape(-1, width), out.reshape(-1, width))
        return out

    # ------------------------------------------------------------------ KV cache
    def alloc_kv(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str) -> np.ndarray:
        """Zeroed arena [num_layers, 2, num_slots, num_kv_heads, head_dim] of the KV dtype
        (f32 -> float32, bf16 -> uint16 bits, fp8 -> uint8 E4M3FN)."""
        dtype = check_kv_dtype(kv_dtype)
        return np.zeros(kv_shape(num_layers, num_slots, num_kv_heads, head_dim), dtype)

    def kv_write(self, kv: np.ndarray, layer: int, k: np.ndarray, v: np.ndarray,
                 slots: np.ndarray, kv_scales: np.ndarray | None) -> None:
        """Store k, v [rows, nkv, hd] float32 at `slots` [rows] int64 of `layer`."""
        check_kv(kv, layer)
        check_array(k, "kv_write k", np.float32, 3)
        check_array(v, "kv_write v", np.float32, 3)
        _check_slots(slots, k.shape[0], kv, self.index_checks)
        check_shape(k, "kv_write k", (slots.shape[0], *kv.shape[3:]))
        check_shape(v, "kv_write v", k.shape)
        k_scale, v_scale = _layer_scales(kv_scales, kv, layer)
        kernels.kv_write(k, v, kv[layer], slots, k_scale, v_scale)

    def attention(self, q: np.ndarray, kv: np.ndarray, layer: int, kv_scales: np.ndarray | None,
                  block_table: np.ndarray, row_seq: np.ndarray, row_pos: np.ndarray,
                  page_size: int, sm_scale: float) -> np.ndarray:
        """Causal paged GQA attention of q [rows, nh, hd] over `layer` -> [rows, nh, hd]."""
        check_kv(kv, layer)
        check_array(q, "attention q", np.float32, 3)
        if q.shape[2] != kv.shape[4] or q.shape[1] % kv.shape[3] != 0:
            raise BadInputError(f"attention: q shape {q.shape} does not fit kv heads/dim "
                             f"{kv.shape[3:]}")
        self._check_pages(kv, block_table, row_seq, row_pos, q.shape[0], page_size)
        k_scale, v_scale = _layer_scales(kv_scales, kv, layer)
        out = np.empty_like(q)
        kernels.paged_attention(q, kv[layer], k_scale, v_scale, block_table, row_seq, row_pos,
                                page_size, float(sm_scale), out)
        return out

    def zero_pages(self, kv: np.ndarray, page_ids: np.ndarray, page_size: int) -> None:
        """Zero the K and V slots of `page_ids` [n] int32 in every layer."""
        check_kv(kv, 0)
        check_array(page_ids, "zero_pages page_ids", np.int32, 1)
        num_pages = num_pages_of(kv, page_size)
        _check_range(page_ids, "zero_pages page_ids", 0, num_pages)
        kernels.zero_pages(kv, page_ids, page_size)

    def _check_pages(self, kv: np.ndarray, block_table: np.ndarray, row_seq: np.ndarray,
                     row_pos: np.ndarray, rows: int, page_size: int) -> None:
        check_array(block_table, "attention block_table", np.int32, 2)
        check_array(row_seq, "attention row_seq", np.int32, 1)
        check_array(row_pos, "attention row_pos", np.int64, 1)
        check_shape(row_seq, "attention row_seq", (rows,))
        check_shape(row_pos, "attention row_pos", (rows,))
        num_pages = num_pages_of(kv, page_size)
        if not self.index_checks:  # the runner checked the round's pages (unchecked())
            return
        bad_row = kernels.first_bad_page_row(block_table, row_seq, row_pos, page_size, num_pages)
        if bad_row >= 0:
            raise BadInputError(
                f"attention: row {bad_row} (stream {int(row_seq[bad_row])}, position "
                f"{int(row_pos[bad_row])}) needs a block_table entry outside [0, {num_pages}) "
                f"or a stream outside block_table {block_table.shape}")

    # ------------------------------------------------------------------ MoE
    def moe(self, x: np.ndarray, router: Linear, gate: Linear, up: Linear, down: Linear,
            top_k: int, norm_topk_prob: bool, *, gate_up: FusedLinear | None = None) -> np.ndarray:
        """Top-k mixture of SwiGLU experts. x [rows, H]; gate/up/down stacked [E, ...].
        Each expert's rows go through the same matmul kernels; a row's expert outputs are
        summed in slot order j = 0..k-1, so the sum never depends on other rows. gate_up
        (the parts gate and up) adds nothing here."""
        check_array(x, "moe x", np.float32, 2)
        logits = self.linear(x, router)
        num_experts = logits.shape[1]
        if not 1 <= top_k <= num_experts:
            raise BadInputError(f"moe: top_k {top_k} not in [1, {num_experts}]")
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
        parts = LinearParts(tuple(ws))
        if all(self._checked.get(id(w)) is w for w in ws):
            self._checked[id(parts)] = parts
        return parts, list(ws)

    def rms_norm_for(self, x: np.ndarray, w: np.ndarray, eps: float,
                     linear: FusedLinear | Sequence[FusedLinear]) -> np.ndarray:
        return self.rms_norm(x, w, eps)

    def attn_inputs(self, qkv: np.ndarray, q_norm: np.ndarray | None, k_norm: np.ndarray | None,
                    eps: float, positions: np.ndarray, inv_freq: np.ndarray, mscale: float,
                    kv: np.ndarray, layer: int, slots: np.ndarray, kv_scales: np.ndarray | None,
                    num_heads: int) -> np.ndarray:
        """The basic ops' bits (split, q/k norms, ropes, kv_write) in one kernel call."""
        check_kv(kv, layer)
        nkv, hd = kv.shape[3], kv.shape[4]
        rows, q_width, k_width = qkv.shape[0], num_heads * hd, nkv * hd
        check_array(qkv, "attn_inputs qkv", np.float32, 2)
        check_shape(qkv, "attn_inputs qkv", (rows, q_width + 2 * k_width))
        if (q_norm is None) != (k_norm is None):
            raise BadInputError("attn_inputs: q_norm and k_norm go together")
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            if norm is not None:
                check_array(norm, f"attn_inputs {name}", np.float32, 1)
                check_shape(norm, f"attn_inputs {name}", (hd,))
        _check_rope(positions, inv_freq, rows, hd)
        _check_slots(slots, rows, kv, self.index_checks)
        k_scale, v_scale = _layer_scales(kv_scales, kv, layer)
        q = np.empty((rows, num_heads, hd), np.float32)
        kernels.attn_inputs(qkv, q_norm, k_norm, float(eps), positions, inv_freq, float(mscale),
                            kv[layer], slots, k_scale, v_scale, q)
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
            raise BadInputError("swiglu_linear: expected concat_linears([gate, up])")
        width = gate_up.parts[0].out_features
        if gate_up.parts[1].out_features != width:
            raise BadInputError("swiglu_linear: gate and up must have the same out_features")
        gate_up_out = self.linear(x, gate_up).reshape(-1, gate_up.out_features)
        out = np.empty((gate_up_out.shape[0], width), np.float32)
        kernels.silu_mul_halves(gate_up_out, out)
        return out.reshape(*x.shape[:-1], width)

    # ------------------------------------------------------------------ Gated DeltaNet
    def causal_conv1d(self, x: np.ndarray, conv_states: np.ndarray, weight: np.ndarray,
                      row_lanes: np.ndarray, frozen: np.ndarray) -> np.ndarray:
        _check_frozen(row_lanes, frozen, conv_states.shape[0])
        out = np.empty(x.shape, np.float32)
        gdn.causal_conv1d_batch(x, conv_states, weight, row_lanes, frozen, out)
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
                         beta: np.ndarray, states: np.ndarray, row_lanes: np.ndarray,
                         frozen: np.ndarray) -> np.ndarray:
        _check_frozen(row_lanes, frozen, states.shape[0])
        out = np.empty(v.shape, np.float32)
        gdn.gated_delta_rule_batch(q, k, v, g, beta, states, row_lanes, frozen, out)
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

    def shared_expert_add(self, h: np.ndarray, routed: np.ndarray, shared: np.ndarray,
                          gate: np.ndarray) -> None:
        check_shared_expert_add(h, routed, shared, gate)
        gdn.shared_expert_add(h, routed, shared, gate)


class _MatmulPlan:
    """A weight's matmul, its checks done: `run(rows [n, in] f32, out [n, out_f] f32)`."""

    __slots__ = ("weight", "in_features", "out_features", "run")

    def __init__(self, w: FusedLinear, int8_x: bool, checked: dict[int, FusedLinear],
                 kept: bool) -> None:
        """`kept`: the plan serves every call of `w` (its scales may be compacted once)."""
        self.weight, self.in_features, self.out_features = w, w.in_features, w.out_features
        parts = w.parts if isinstance(w, LinearParts) else (w,)
        for part in parts:
            if checked.get(id(part)) is not part:
                _check_weight(part)
        if isinstance(w, LinearParts):
            self.run = _parts_matmul(w, int8_x, kept)
        elif int8_x and _int8_x_fits(w):
            self.run = _int8_x_matmul((w,), kept)  # type: ignore[arg-type]
        elif isinstance(w, AffineWeight):
            codes, scales, biases, bits, gs = w.codes, w.scales, w.biases, w.bits, w.group_size
            self.run = lambda rows, out: kernels.matmul_affine(rows, codes, scales, biases, bits, gs, out)
        else:
            dense = w.w
            self.run = lambda rows, out: kernels.matmul_dense(rows, dense, out)


def _int8_x_matmul(parts: tuple[AffineWeight, ...],
                   compact: bool) -> Callable[[np.ndarray, np.ndarray], None]:
    """Affine parts of one kind side by side on int8 x: x quantized once, one kernel call
    (int8_matmul; with `compact`, a kept plan's, float16 copies of the scales where they are
    exact); groups that are not 32 * 2**k: kernels' reference twin, part by part."""
    first = parts[0]
    codes, scales = tuple(p.codes for p in parts), tuple(p.scales for p in parts)
    biases, bits, group_size = tuple(p.biases for p in parts), first.bits, first.group_size
    if int8_matmul.fits(bits, first.in_features, group_size):
        kernel_scales, kernel_biases = (int8_matmul.compact_scales(scales, biases) if compact
                                        else (scales, biases))
        return lambda rows, out: int8_matmul.matmul(rows, codes, kernel_scales, kernel_biases, bits,
                                                    group_size, out)
    bounds = np.cumsum([0] + [p.out_features for p in parts]).tolist()

    def run(rows: np.ndarray, out: np.ndarray) -> None:
        xq = np.empty(rows.shape, np.int8)
        xs = np.empty((rows.shape[0], 2 * rows.shape[1] // 32), np.float32)
        kernels.quantize_rows_int8(rows, bits == 4, xq, xs)
        for p, lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True):
            part_out = np.empty((rows.shape[0], hi - lo), np.float32)
            kernels.matmul_affine_int8x(xq, xs, p.codes, p.scales, p.biases, bits, group_size, part_out)
            out[:, lo:hi] = part_out

    return run


def _same_kind(parts: tuple[Linear, ...]) -> bool:
    first = parts[0]
    return isinstance(first, AffineWeight) and all(
        isinstance(p, AffineWeight)
        and (p.bits, p.group_size, p.in_features) == (first.bits, first.group_size, first.in_features)
        for p in parts)


def _parts_matmul(w: LinearParts, int8_x: bool,
                  compact: bool) -> Callable[[np.ndarray, np.ndarray], None]:
    """The parts side by side: one kernel call for affine parts of one kind (one parallel
    region over all their features), else part by part; the same bits either way."""
    first = w.parts[0]
    if int8_x and _same_kind(w.parts) and _int8_x_fits(first):
        return _int8_x_matmul(w.parts, compact)  # type: ignore[arg-type]
    if (isinstance(first, AffineWeight) and _same_kind(w.parts)
            and kernels.affine_parts_fit(first.bits, first.group_size)):
        parts: list[AffineWeight] = list(w.parts)  # type: ignore[arg-type]
        codes, scales = tuple(p.codes for p in parts), tuple(p.scales for p in parts)
        biases, bits, gs = tuple(p.biases for p in parts), first.bits, first.group_size
        return lambda rows, out: kernels.matmul_affine_parts(rows, codes, scales, biases, bits, gs, out)
    plans = [_MatmulPlan(part, int8_x, {id(part): part}, compact) for part in w.parts]
    bounds = np.cumsum([0] + [p.out_features for p in plans]).tolist()

    def run(rows: np.ndarray, out: np.ndarray) -> None:
        for plan, lo, hi in zip(plans, bounds[:-1], bounds[1:], strict=True):
            part_out = np.empty((rows.shape[0], hi - lo), np.float32)
            plan.run(rows, part_out)
            out[:, lo:hi] = part_out

    return run


def _check_rope(positions: np.ndarray, inv_freq: np.ndarray, rows: int, head_dim: int) -> None:
    check_array(positions, "rope positions", np.int64, 1)
    check_array(inv_freq, "rope inv_freq", np.float32, 1)
    check_shape(positions, "rope positions", (rows,))
    if 2 * inv_freq.shape[0] > head_dim:
        raise BadInputError(f"rope: rotary dims {2 * inv_freq.shape[0]} exceed head_dim {head_dim}")


def _check_slots(slots: np.ndarray, rows: int, kv: np.ndarray, in_range: bool) -> None:
    """slots [rows] int64, each (when `in_range`: outside unchecked()) a slot of the arena kv."""
    check_array(slots, "kv_write slots", np.int64, 1)
    check_shape(slots, "kv_write slots", (rows,))
    if in_range:
        _check_range(slots, "kv_write slots", 0, kv.shape[2])


def _check_frozen(row_lanes: np.ndarray, frozen: np.ndarray, num_lanes: int) -> None:
    """frozen: [lanes] uint8; the rows of each frozen lane one contiguous run (the kernels
    carry a frozen lane's state in a copy from its first row to its last)."""
    check_array(frozen, "gdn frozen", np.uint8, 1)
    check_shape(frozen, "gdn frozen", (num_lanes,))
    if not frozen.any() or row_lanes.size == 0:
        return
    starts = np.flatnonzero(np.r_[True, row_lanes[1:] != row_lanes[:-1]])
    runs = row_lanes[starts]
    held = runs[frozen[runs] != 0]
    if held.size != np.unique(held).size:
        raise BadInputError("gdn: a frozen lane's rows must be contiguous in the round")
