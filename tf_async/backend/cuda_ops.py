"""CudaOps: the Ops of docs/KERNELS.md on CuPy arrays, backed by the Numba CUDA kernels of
cuda_kernels/. Same methods and semantics as CpuOps.

Streams: every kernel launches on CuPy's current stream (wrapped for Numba with
`numba.cuda.external_stream`), so Numba launches and CuPy operations of a round are ordered
on one stream and can be captured together in a CUDA graph; `synchronize()` drains it.

Each launcher checks dtype, layout and bounds before launching, so a bad call raises
BadInputError instead of reading or writing out of bounds on the device. Bounds of index
arrays that live on the device are checked with one reduction (a host sync) only where a
wrong value would address memory: embed ids, KV slots, page ids, block tables. Inside
`unchecked()` those device checks are skipped (no host sync, so a round can be captured as a
CUDA graph); the caller must have checked the indices itself (tf_async/models/graph_decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BadInputError
from .base import Capabilities
from .checks import (
    check_affine,
    check_array,
    check_kv,
    check_kv_dtype,
    check_shape,
    check_shared_expert_add,
    kv_shape,
    num_pages_of,
)
from .weights import AffineWeight, DenseWeight, FusedLinear, Linear, LinearParts


def check_range(values: Any, name: str, low: int, high: int) -> None:
    """Every value in [low, high) (one device reduction and a host sync)."""
    if values.size:
        lo, hi = int(values.min()), int(values.max())
        if lo < low or hi >= high:
            raise BadInputError(f"{name}: values must lie in [{low}, {high}), got [{lo}, {hi}]")


def layer_scales(kv_scales: Any, kv: Any, layer: int) -> tuple[np.float32, np.float32]:
    """(k_scale, v_scale) of `layer`; kv_scales [layers, 2] float32, NumPy (no sync) or CuPy."""
    if kv_scales is None:
        return np.float32(1.0), np.float32(1.0)
    if tuple(kv_scales.shape) != (kv.shape[0], 2) or kv_scales.dtype != np.float32:
        raise BadInputError(f"kv_scales: expected [{kv.shape[0]}, 2] float32, got "
                            f"{kv_scales.dtype} {tuple(kv_scales.shape)}")
    pair = kv_scales[layer]
    pair = pair.get() if hasattr(pair, "get") else pair
    return np.float32(pair[0]), np.float32(pair[1])


def _module_of(array: Any) -> Any:
    """numpy for host arrays, else the array's own module (cupy)."""
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy


def _load_cuda() -> tuple[Any, Any, Any, Any]:
    """(cupy, numba.cuda, cuda_kernels.launch, cuda_kernels.gdn), or BadInputError naming what
    is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise BadInputError(f"--device cuda needs CuPy ({exc}); pip install 'tf-async[cuda]'",
                            param="device") from exc
    try:
        from cuda_kernels import gdn, launch
        from cuda_kernels.env import cuda
    except Exception as exc:  # CudaUnavailableError, or numba-cuda failing to import
        raise BadInputError(f"--device cuda: {exc}", param="device") from exc
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - driver missing or broken
        raise BadInputError(f"--device cuda: no usable CUDA driver ({exc})", param="device") from exc
    if gpus < 1 or not cuda.is_available():
        raise BadInputError("--device cuda: no CUDA GPU found", param="device")
    return cupy, cuda, launch, gdn


# MoE rounds with at least this many routed slots (rows x top_k: prompt steps) run sorted by
# expert on the tensor cores, one launch a weight; fewer (decode, draft verification) run one
# slot a row on qdot. Either way a slot gets the same bits (cuda_kernels/qmma.py). Sorted
# rounds are not captured in CUDA graphs (graph_decoder._captured_rows), so the bar sits
# above the verify rounds of 8 drafting streams (8 x 4 rows x top-k 8 = 256 slots: 467 ms a
# round eagerly on the H200 at 35B-A3B shapes, session 14).
MOE_SORTED_MIN_SLOTS = 512


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """Rows already in the form the int8-activation matmul multiplies (CudaOps.rms_norm_for):
    int8 x [rows, K] in the byte order of `kind` ('q4' or 'q8') and its chunk scales
    [rows, 2K/32] (cuda_kernels/qdot.py)."""

    xq: Any
    xs: Any
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.xq.shape)  # type: ignore[return-value]


class CudaOps:
    """Ops on one GPU: CuPy arrays in and out, Numba CUDA kernels inside."""

    name = "cuda"
    capabilities = Capabilities(device_sampling=True, device_checks=True, round_checks=True,
                                cuda_graphs=True, kernels_by_rows=True)

    def __init__(self) -> None:
        self.xp, self._cuda, self._launch, self._gdn = _load_cuda()
        self._streams: dict[int, Any] = {}
        self._no_experts = self.xp.zeros(1, dtype=self.xp.int32)
        self._no_scales = self.xp.zeros((1, 1, 1), dtype=self.xp.float32)
        self._no_norm = self.xp.ones(1, dtype=self.xp.float32)
        self.device_checks = True  # False inside unchecked(): no host syncs on index bounds
        self._host_scales: tuple[Any, np.ndarray] | None = None  # (kv_scales, host copy)

    @contextmanager
    def unchecked(self) -> Iterator[None]:
        """Skip the bounds checks of device-resident indices (each one a host sync), e.g.
        while capturing a CUDA graph. Dtype, layout and shape checks still run."""
        before, self.device_checks = self.device_checks, False
        try:
            yield
        finally:
            self.device_checks = before

    def capture_programmatic(self, stream: Any, record: Callable[[], None]) -> Any | None:
        """cuda_kernels/graphs.py: the graph of record()'s launches with programmatic edges,
        or None where the device or driver cannot."""
        from cuda_kernels.graphs import capture_programmatic  # only graph captures need it

        return capture_programmatic(stream, record)

    def _range(self, values: Any, name: str, low: int, high: int) -> None:
        if self.device_checks:
            check_range(values, name, low, high)

    def _scales(self, kv_scales: Any, kv: Any, layer: int) -> tuple[np.float32, np.float32]:
        # The arena's scales never change after it is built: read them to the host once,
        # not once per layer (each read is a sync, and a capture cannot contain one).
        if kv_scales is None or isinstance(kv_scales, np.ndarray):
            return layer_scales(kv_scales, kv, layer)
        if self._host_scales is None or self._host_scales[0] is not kv_scales:
            layer_scales(kv_scales, kv, 0)  # shape and dtype check
            self._host_scales = (kv_scales, self.xp.asnumpy(kv_scales))
        return layer_scales(self._host_scales[1], kv, layer)

    # ------------------------------------------------------------------ plumbing
    def _stream(self) -> Any:
        ptr = self.xp.cuda.get_current_stream().ptr
        if ptr not in self._streams:
            self._streams[ptr] = self._cuda.external_stream(ptr) if ptr else self._cuda.default_stream()
        return self._streams[ptr]

    def _dev(self, array: Any) -> Any:
        # Numba view of a CuPy array; sync=False: the kernels run on CuPy's own stream.
        return self._cuda.as_cuda_array(array, sync=False)

    def asarray(self, array: np.ndarray) -> Any:
        return self.xp.asarray(array)

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array)

    def synchronize(self) -> None:
        """Drain the engine's stream (CuPy's current stream, where every kernel runs)."""
        self.xp.cuda.get_current_stream().synchronize()

    def upload_linear(self, w: Linear) -> Linear:
        """Copy a weight to the device, same kind and fields (arrays already on the device
        are kept, not copied). DenseWeight.w may be float32 or uint16 (bf16 bits)."""
        xp = self.xp
        if isinstance(w, AffineWeight):
            check_affine(w, xp=_module_of(w.codes), whole_words=True)
            return AffineWeight(xp.asarray(w.codes), xp.asarray(w.scales), xp.asarray(w.biases),
                                w.bits, w.group_size)
        if isinstance(w, DenseWeight):
            if w.w.dtype not in (np.float32, np.uint16):
                raise BadInputError(f"DenseWeight.w: expected float32 or uint16 (bf16), got {w.w.dtype}")
            return DenseWeight(xp.ascontiguousarray(xp.asarray(w.w)))
        raise BadInputError(f"unknown weight kind {type(w).__name__}")

    # ------------------------------------------------------------------ matmuls
    def linear(self, x: Any, w: FusedLinear, bias: Any | None = None) -> Any:
        """x [..., in] @ w.T (+ bias) -> [..., out_f]; x may be Int8Rows [rows, in]."""
        w = _one_weight(w)
        if isinstance(x, Int8Rows):
            self._check_int8_rows(x, "linear x", x.shape[0], w)
            rows: Any = x
        else:
            check_array(x, "linear x", np.float32, xp=self.xp)
            if x.ndim == 0 or x.shape[-1] != w.in_features:
                raise BadInputError(f"linear: x has shape {x.shape}, weight expects in_features {w.in_features}")
            rows = x.reshape(-1, w.in_features)
        out = self.xp.empty((rows.shape[0], w.out_features), self.xp.float32)
        if rows.shape[0]:  # a round may want no logits (a prompt step): launch nothing
            self._matmul(rows, w, out, None)
        if bias is not None:
            check_array(bias, "linear bias", np.float32, 1, xp=self.xp)
            check_shape(bias, "linear bias", (w.out_features,))
            out += bias
        return out.reshape(*x.shape[:-1], w.out_features)

    def _check_int8_rows(self, x: Int8Rows, name: str, rows: int, w: Linear) -> None:
        check_array(x.xq, f"{name} (int8)", np.int8, 2, xp=self.xp)
        check_array(x.xs, f"{name} (scales)", np.float32, 2, xp=self.xp)
        check_shape(x.xq, f"{name} (int8)", (rows, w.in_features))
        check_shape(x.xs, f"{name} (scales)", (rows, 2 * w.in_features // 32))
        kind, words, _, _, group_size = self._weight_parts(w)
        if kind != x.kind or not self._launch.uses_int8_x(kind, words.reshape(-1, *words.shape[-2:]), group_size):
            raise BadInputError(f"{name}: int8 rows for {x.kind} weights, the weight is {kind} (or takes float32 x)")

    def rms_norm_for(self, x: Any, w: Any, eps: float,
                     linear: FusedLinear | Sequence[FusedLinear]) -> Any:
        """rms_norm(x, w, eps) in the form `linear` multiplies: Int8Rows when it takes int8 x
        (the norm and the quantization in one launch, the bits of rms_norm then quantize_rows),
        else rms_norm's float32 rows. x [rows, dim]. Several linears (stacked experts too):
        Int8Rows only when every one takes the same int8 form."""
        given: Sequence[FusedLinear] = linear if isinstance(linear, list | tuple) else [linear]  # type: ignore[list-item]
        linears = [_one_weight(one) for one in given]
        kinds = {self._int8_form(one) for one in linears}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None:
            return self.rms_norm(x, w, eps)
        xp = self.xp
        check_array(x, "rms_norm x", np.float32, 2, xp=xp)
        check_array(w, "rms_norm weight", np.float32, 1, xp=xp)
        if x.shape[1] != w.shape[0] or any(w.shape[0] != one.in_features for one in linears):
            raise BadInputError(f"rms_norm_for: x {x.shape}, weight {w.shape}, linear in_features "
                                f"{[one.in_features for one in linears]}")
        out = self._new_int8_rows(x.shape[0], x.shape[1], kind)
        if x.shape[0]:
            self._launch.rms_norm_quantize(self._dev(x), self._dev(w), np.float32(eps), kind == "q4",
                                           self._dev(out.xq), self._dev(out.xs), self._stream())
        return out

    def _int8_form(self, w: Linear) -> str | None:
        """The kind ('q4' or 'q8') of the int8 x a weight (2-D, or stacked experts)
        multiplies; None: float32 x."""
        kind, words, _, _, group_size = self._weight_parts(w)
        if words.ndim not in (2, 3) or not self._launch.uses_int8_x(
                kind, words if words.ndim == 3 else words[None], group_size):
            return None
        return kind

    def _new_int8_rows(self, rows: int, width: int, kind: str) -> Int8Rows:
        q_shape, s_shape = self._launch.quantize_scratch_shapes(rows, width)
        return Int8Rows(self.xp.empty(q_shape, self.xp.int8), self.xp.empty(s_shape, self.xp.float32), kind)

    def _matmul(self, rows: Any, w: Linear, out: Any, expert_ids: Any | None, path: str | None = None,
                epilogue: str = "store", x_repeat: int = 1) -> None:
        # rows [n, in] f32; w 2-D, or 3-D stacked experts when expert_ids [n] int32 is given.
        kind, words, scales, biases, group_size = self._weight_parts(w)
        if words.ndim != (3 if expert_ids is not None else 2):
            raise BadInputError(f"linear: weight of shape {words.shape} (stacked experts need moe())")
        if words.ndim == 2:
            words = words[None]
        if scales.ndim == 2:
            scales, biases = scales[None], biases[None]
        grouped = expert_ids is not None
        ids = expert_ids if grouped else self._no_experts
        if isinstance(rows, Int8Rows):  # checked by the caller (_check_int8_rows)
            args = [None, *(self._dev(a) for a in (words, scales, biases))]
            scratch: dict[str, Any] = {"xq": self._dev(rows.xq), "xs": self._dev(rows.xs), "x_ready": True}
        elif self._launch.uses_int8_x(kind, words, group_size):  # x quantized to int8 first
            args = [self._dev(a) for a in (rows, words, scales, biases)]
            q_shape, s_shape = self._launch.quantize_scratch_shapes(*rows.shape)
            scratch = {"xq": self._dev(self.xp.empty(q_shape, self.xp.int8)),
                       "xs": self._dev(self.xp.empty(s_shape, self.xp.float32))}
        else:
            args, scratch = [self._dev(a) for a in (rows, words, scales, biases)], {}
        self._launch.matmul(kind, *args, group_size, self._dev(ids), self._dev(out), self._stream(),
                            path=path, grouped=grouped, epilogue=epilogue, x_repeat=x_repeat, **scratch)

    # ------------------------------------------------------------------ fused layer ops
    # The decoder's layer ops (Ops protocol) as fused launches: one matmul for q|k|v and one
    # for gate|up, the residual added by the matmul that produces it, and the attention inputs
    # prepared in one launch. Each gives the bits of the ops it replaces.

    def concat_linears(self, ws: list[Linear]) -> tuple[Linear, list[Linear]] | None:
        """One weight whose rows are those of ws one after another, and views of it equal to
        each of ws (so the originals can go); None when ws are not all of one kind."""
        xp = self.xp
        first = ws[0]
        ndim = (first.codes if isinstance(first, AffineWeight) else first.w).ndim
        axis = ndim - 2  # the rows (out features) axis; 3-D: stacked experts, each concatenated
        if isinstance(first, AffineWeight) and all(
                isinstance(w, AffineWeight) and (w.bits, w.group_size, w.in_features, w.codes.ndim,
                                                 w.codes.shape[:axis])
                == (first.bits, first.group_size, first.in_features, ndim, first.codes.shape[:axis])
                for w in ws):
            codes, scales, biases = (xp.concatenate([getattr(w, f) for w in ws], axis=axis)
                                     for f in ("codes", "scales", "biases"))
            whole: Linear = AffineWeight(codes, scales, biases, first.bits, first.group_size)
        elif isinstance(first, DenseWeight) and all(
                isinstance(w, DenseWeight) and w.w.dtype == first.w.dtype
                and (w.w.ndim, w.w.shape[:axis], w.in_features)
                == (ndim, first.w.shape[:axis], first.in_features) for w in ws):
            whole = DenseWeight(xp.concatenate([w.w for w in ws if isinstance(w, DenseWeight)],
                                               axis=axis))
        else:
            return None
        views, start = [], 0
        for w in ws:
            stop = start + w.out_features
            views.append(_rows_of(whole, start, stop))
            start = stop
        return whole, views

    def linear_into(self, x: Any, w: Linear, out: Any) -> Any:
        """out += x @ w.T in place (out [rows, out_f]: a residual); the bits of out + linear(x, w)."""
        check_array(out, "linear_into out", np.float32, 2, xp=self.xp)
        if isinstance(x, Int8Rows):
            self._check_int8_rows(x, "linear_into x", out.shape[0], w)
        else:
            check_array(x, "linear_into x", np.float32, 2, xp=self.xp)
            check_shape(x, "linear_into x", (out.shape[0], w.in_features))
        check_shape(out, "linear_into out", (x.shape[0], w.out_features))
        if x.shape[0]:
            self._matmul(x, w, out, None, epilogue="add")
        return out

    def swiglu_linear(self, x: Any, gate_up: FusedLinear) -> Any:
        """silu(x @ gate.T) * (x @ up.T) for gate_up = [gate; up] (concat_linears); the bits of
        silu_mul(linear(x, gate), linear(x, up))."""
        gate_up = _one_weight(gate_up)
        if isinstance(x, Int8Rows):
            self._check_int8_rows(x, "swiglu_linear x", x.shape[0], gate_up)
        else:
            check_array(x, "swiglu_linear x", np.float32, 2, xp=self.xp)
        if x.shape[1] != gate_up.in_features or gate_up.out_features % 2:
            raise BadInputError(f"swiglu_linear: x {x.shape}, weight {gate_up.out_features}x{gate_up.in_features}")
        out = self.xp.empty((x.shape[0], gate_up.out_features // 2), self.xp.float32)
        if x.shape[0]:
            self._matmul(x, gate_up, out, None, epilogue="swiglu")
        return out

    def attn_inputs(self, qkv: Any, q_norm: Any | None, k_norm: Any | None, eps: float, positions: Any,
                    inv_freq: Any, mscale: float, kv: Any, layer: int, slots: Any, kv_scales: Any | None,
                    num_heads: int) -> Any:
        """From q|k|v rows [rows, (nh + 2 nkv) hd]: q [rows, nh, hd] normed (q_norm) and roped;
        k normed (k_norm), roped and v, both stored at `slots` of `layer`. The bits of rms_norm,
        rope and kv_write one after another."""
        xp = self.xp
        check_kv(kv, layer, xp=xp)
        nkv, hd = kv.shape[3], kv.shape[4]
        check_array(qkv, "attn_inputs qkv", np.float32, 2, xp=xp)
        check_shape(qkv, "attn_inputs qkv", (slots.shape[0], (num_heads + 2 * nkv) * hd))
        check_array(positions, "attn_inputs positions", np.int64, 1, xp=xp)
        check_array(slots, "attn_inputs slots", np.int64, 1, xp=xp)
        check_shape(positions, "attn_inputs positions", slots.shape)
        check_array(inv_freq, "attn_inputs inv_freq", np.float32, 1, xp=xp)
        if 2 * inv_freq.shape[0] > hd or hd > self._launch.MAX_HEAD_DIM:
            raise BadInputError(f"attn_inputs: head_dim {hd} (at most {self._launch.MAX_HEAD_DIM}), "
                                f"rotary dims {2 * inv_freq.shape[0]}")
        use_norm = q_norm is not None
        norms = (q_norm, k_norm) if use_norm else (self._no_norm, self._no_norm)
        for arr, name in zip(norms, ("q_norm", "k_norm"), strict=True):
            check_array(arr, f"attn_inputs {name}", np.float32, 1, xp=xp)
            if use_norm:
                check_shape(arr, f"attn_inputs {name}", (hd,))
        self._range(slots, "attn_inputs slots", 0, kv.shape[2])
        k_scale, v_scale = self._scales(kv_scales, kv, layer)
        q = xp.empty((slots.shape[0], num_heads, hd), xp.float32)
        if slots.shape[0]:
            args = [self._dev(a) for a in (qkv, *norms)]
            self._launch.attn_inputs(*args, use_norm, np.float32(eps), self._dev(positions), self._dev(inv_freq),
                                     float(mscale), self._dev(kv[layer]), self._dev(slots), k_scale, v_scale,
                                     self._dev(q), self._stream())
        return q

    def _weight_parts(self, w: Linear) -> tuple[str, Any, Any, Any, int]:
        if isinstance(w, AffineWeight):
            check_affine(w, xp=self.xp, whole_words=True)
            return ("q4" if w.bits == 4 else "q8"), w.codes, w.scales, w.biases, w.group_size
        if isinstance(w, DenseWeight):
            check_array(w.w, "DenseWeight.w", None, xp=self.xp)
            if w.w.dtype == np.uint16:
                if w.w.shape[-1] % 2:
                    raise BadInputError("bf16 DenseWeight: in_features must be even")
                return "bf16", w.w.view(self.xp.uint32), self._no_scales, self._no_scales, 1 << 30
            check_array(w.w, "DenseWeight.w", np.float32, xp=self.xp)
            return "f32", w.w, self._no_scales, self._no_scales, 1 << 30
        raise BadInputError(f"linear: unknown weight kind {type(w).__name__}")

    def embed(self, w: Linear, ids: Any) -> Any:
        """Rows `ids` [rows] int64 of the table w [V, H] -> [rows, H] float32."""
        check_array(ids, "embed ids", np.int64, 1, xp=self.xp)
        self._range(ids, "embed ids", 0, w.out_features)
        if isinstance(w, DenseWeight):
            table = w.w if w.w.dtype == np.float32 else None
            if table is None:
                rows = (w.w[ids].astype(self.xp.uint32) << 16).view(self.xp.float32)
                return self.xp.ascontiguousarray(rows)
            return self.xp.ascontiguousarray(table[ids])
        if not isinstance(w, AffineWeight):
            raise BadInputError(f"embed: unknown weight kind {type(w).__name__}")
        check_affine(w, xp=self.xp, whole_words=True)
        out = self.xp.empty((ids.shape[0], w.in_features), self.xp.float32)
        if not ids.shape[0]:
            return out
        parts = [self._dev(a) for a in (w.codes, w.scales, w.biases)]
        self._launch.embed_affine(*parts, w.bits, w.group_size, self._dev(ids), self._dev(out), self._stream())
        return out

    # ------------------------------------------------------------------ row-wise ops
    def rms_norm(self, x: Any, w: Any, eps: float) -> Any:
        """RMS-normalise the last axis of x (any leading dims) and scale by w [dim]."""
        check_array(x, "rms_norm x", np.float32, xp=self.xp)
        check_array(w, "rms_norm weight", np.float32, 1, xp=self.xp)
        if x.ndim == 0 or x.shape[-1] != w.shape[0]:
            raise BadInputError(f"rms_norm: x shape {x.shape} does not end in weight dim {w.shape[0]}")
        out = self.xp.empty_like(x)
        if not x.size:
            return out
        rows = x.reshape(-1, w.shape[0])
        self._launch.rms_norm(self._dev(rows), self._dev(w), np.float32(eps),
                              self._dev(out.reshape(rows.shape)), self._stream())
        return out

    def rope(self, x: Any, positions: Any, inv_freq: Any, mscale: float) -> None:
        """RoPE in place. x [rows, heads, hd], positions [rows] int64, inv_freq [rot/2]."""
        check_array(x, "rope x", np.float32, 3, xp=self.xp)
        check_array(positions, "rope positions", np.int64, 1, xp=self.xp)
        check_array(inv_freq, "rope inv_freq", np.float32, 1, xp=self.xp)
        check_shape(positions, "rope positions", (x.shape[0],))
        if 2 * inv_freq.shape[0] > x.shape[2]:
            raise BadInputError(f"rope: rotary dims {2 * inv_freq.shape[0]} exceed head_dim {x.shape[2]}")
        if not x.size:
            return
        self._launch.rope(self._dev(x), self._dev(positions), self._dev(inv_freq), float(mscale), self._stream())

    def silu_mul(self, gate: Any, up: Any) -> Any:
        """silu(gate) * up, both [..., I]."""
        check_array(gate, "silu_mul gate", np.float32, xp=self.xp)
        check_array(up, "silu_mul up", np.float32, xp=self.xp)
        check_shape(up, "silu_mul up", gate.shape)
        out = self.xp.empty_like(gate)
        if not gate.size:
            return out
        width = gate.shape[-1] if gate.ndim else 1
        parts = [self._dev(a.reshape(-1, width)) for a in (gate, up, out)]
        self._launch.silu_mul(*parts, self._stream())
        return out

    # ------------------------------------------------------------------ KV cache
    def alloc_kv(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str) -> Any:
        """Zeroed arena [num_layers, 2, num_slots, num_kv_heads, head_dim] of the KV dtype."""
        dtype = check_kv_dtype(kv_dtype)
        return self.xp.zeros(kv_shape(num_layers, num_slots, num_kv_heads, head_dim), dtype)

    def kv_write(self, kv: Any, layer: int, k: Any, v: Any, slots: Any, kv_scales: Any | None) -> None:
        """Store k, v [rows, nkv, hd] float32 at `slots` [rows] int64 of `layer`."""
        check_kv(kv, layer, xp=self.xp)
        check_array(k, "kv_write k", np.float32, 3, xp=self.xp)
        check_array(v, "kv_write v", np.float32, 3, xp=self.xp)
        check_array(slots, "kv_write slots", np.int64, 1, xp=self.xp)
        check_shape(k, "kv_write k", (slots.shape[0], *kv.shape[3:]))
        check_shape(v, "kv_write v", k.shape)
        self._range(slots, "kv_write slots", 0, kv.shape[2])
        k_scale, v_scale = self._scales(kv_scales, kv, layer)
        if not slots.shape[0]:
            return
        self._launch.kv_write(self._dev(k), self._dev(v), self._dev(kv[layer]), self._dev(slots),
                              k_scale, v_scale, self._stream())

    def attention_for(self, q: Any, kv: Any, layer: int, kv_scales: Any | None, block_table: Any,
                      row_seq: Any, row_pos: Any, page_size: int, sm_scale: float, linear: Linear) -> Any:
        """attention(...) as the rows [rows, nh * hd] `linear` multiplies: Int8Rows when it takes
        int8 x (the combine launch writes them: the bits of attention then quantize_rows), else
        attention's float32 rows reshaped."""
        kind = self._int8_form(linear)
        rows, width = q.shape[0], q.shape[1] * q.shape[2]
        if kind is None or q.shape[2] % 32 or linear.in_features != width:
            out = self.attention(q, kv, layer, kv_scales, block_table, row_seq, row_pos, page_size, sm_scale)
            return out.reshape(rows, width)
        int8 = self._new_int8_rows(rows, width, kind)
        self.attention(q, kv, layer, kv_scales, block_table, row_seq, row_pos, page_size, sm_scale, int8)
        return int8

    def attention(self, q: Any, kv: Any, layer: int, kv_scales: Any | None, block_table: Any,
                  row_seq: Any, row_pos: Any, page_size: int, sm_scale: float,
                  out_int8: Int8Rows | None = None) -> Any:
        """Causal paged GQA attention of q [rows, nh, hd] over `layer` -> [rows, nh, hd];
        out_int8 (attention_for): the rows as int8 x too."""
        check_kv(kv, layer, xp=self.xp)
        check_array(q, "attention q", np.float32, 3, xp=self.xp)
        if q.shape[2] != kv.shape[4] or q.shape[1] % kv.shape[3] != 0 or q.shape[2] > 256:
            raise BadInputError(f"attention: q shape {q.shape} does not fit kv heads/dim {kv.shape[3:]} "
                                "(head_dim <= 256)")
        self._check_pages(kv, block_table, row_seq, row_pos, q.shape[0], page_size)
        k_scale, v_scale = self._scales(kv_scales, kv, layer)
        out = self.xp.empty_like(q)
        if q.shape[0]:
            # Per-chunk partials of the split over keys; every launch writes what it reads.
            shape = self._launch.attention_scratch_shape(q.shape[0], q.shape[1], q.shape[2],
                                                         block_table.shape[1], int(page_size))
            scratch = self.xp.empty(shape, np.float32)
            parts = [self._dev(a) for a in (q, kv[layer])]
            tables = [self._dev(a) for a in (block_table, row_seq, row_pos)]
            int8_out = None if out_int8 is None else (out_int8.kind == "q4", self._dev(out_int8.xq),
                                                      self._dev(out_int8.xs))
            self._launch.attention(*parts, k_scale, v_scale, *tables, int(page_size),
                                   np.float32(sm_scale), self._dev(out), self._stream(),
                                   scratch=self._dev(scratch), int8_out=int8_out)
        return out

    def zero_pages(self, kv: Any, page_ids: Any, page_size: int) -> None:
        """Zero the K and V slots of `page_ids` [n] int32 in every layer."""
        check_kv(kv, 0, xp=self.xp)
        check_array(page_ids, "zero_pages page_ids", np.int32, 1, xp=self.xp)
        self._range(page_ids, "zero_pages page_ids", 0, num_pages_of(kv, page_size))
        if page_ids.shape[0]:
            flat = kv.reshape(kv.shape[0] * 2, kv.shape[2], kv.shape[3] * kv.shape[4])
            self._launch.zero_pages(self._dev(flat), self._dev(page_ids), int(page_size), self._stream())

    def _check_pages(self, kv: Any, block_table: Any, row_seq: Any, row_pos: Any, rows: int,
                     page_size: int) -> None:
        xp = self.xp
        check_array(block_table, "attention block_table", np.int32, 2, xp=xp)
        check_array(row_seq, "attention row_seq", np.int32, 1, xp=xp)
        check_array(row_pos, "attention row_pos", np.int64, 1, xp=xp)
        check_shape(row_seq, "attention row_seq", (rows,))
        check_shape(row_pos, "attention row_pos", (rows,))
        num_pages = num_pages_of(kv, page_size)
        if rows == 0 or not self.device_checks:
            return
        self._range(row_seq, "attention row_seq", 0, block_table.shape[0])
        self._range(row_pos, "attention row_pos", 0, block_table.shape[1] * page_size)
        entries = block_table[row_seq.astype(xp.int64)]  # [rows, max_pages]
        used = xp.arange(block_table.shape[1])[None, :] <= (row_pos // page_size)[:, None]
        if bool(xp.any(used & ((entries < 0) | (entries >= num_pages)))):
            raise BadInputError(f"attention: a row needs a block_table entry outside [0, {num_pages})")

    # ------------------------------------------------------------------ MoE
    def moe(self, x: Any, router: Linear, gate: Linear, up: Linear, down: Linear,
            top_k: int, norm_topk_prob: bool, *, gate_up: FusedLinear | None = None) -> Any:
        """Top-k mixture of SwiGLU experts, x [rows, H]. Row-slot (r, j) runs through expert
        ids[r, j] with the grouped matmul (one row a block, no host round trip); the outputs
        are summed per row in slot order j = 0..k-1. gate_up (concat_linears([gate, up])):
        gate and up in one launch (the swiglu epilogue; the bits of the two). x may be Int8Rows
        (rms_norm_for of the router and the experts): the router, gate and up read it as it is;
        the grouped launches read each token's row once for its top_k slots (x_repeat)."""
        xp = self.xp
        if not isinstance(x, Int8Rows):  # int8 rows: linear() checks them against the router
            check_array(x, "moe x", np.float32, 2, xp=xp)
        logits = self.linear(x, router)
        rows, num_experts = logits.shape
        if not 1 <= top_k <= num_experts:
            raise BadInputError(f"moe: top_k {top_k} not in [1, {num_experts}]")
        ids = xp.empty((rows, top_k), xp.int32)
        weights = xp.empty((rows, top_k), xp.float32)
        if rows == 0:
            return xp.zeros((0, down.out_features), xp.float32)
        self._launch.moe_route(self._dev(logits), int(top_k), bool(norm_topk_prob), self._dev(ids),
                               self._dev(weights), self._stream())
        flat_ids = ids.reshape(-1)
        fused = None if gate_up is None else _one_weight(gate_up)
        # with gate_up, gate and up are views of it (not contiguous a stack): only it is read
        pair = (gate, up) if fused is None else (fused,)
        if rows * top_k >= MOE_SORTED_MIN_SLOTS and self._takes_int8_x(*pair, down):
            expert_out = self._sorted_experts(x, flat_ids, top_k, (gate, up, down), num_experts, fused)
        else:
            h = self._expert_swiglu(x, gate, up, fused, flat_ids, top_k)
            expert_out = self._expert_linear(h, down, flat_ids)
        out = xp.empty((rows, down.out_features), xp.float32)
        self._launch.moe_combine(self._dev(expert_out), self._dev(weights), self._dev(out), self._stream())
        return out

    def _expert_swiglu(self, x: Any, gate: Linear, up: Linear, gate_up: Linear | None,
                       flat_ids: Any, top_k: int) -> Any:
        """silu(slot @ gate_e.T) * (slot @ up_e.T) of every slot [rows * top_k, I]: int8-x
        experts read token r's row for slots r*k .. r*k + k-1; others multiply top_k copies."""
        rows, repeat = x, top_k
        if not self._takes_int8_x(*((gate, up) if gate_up is None else (gate_up,))):
            if isinstance(x, Int8Rows):
                raise BadInputError("moe: int8 rows for experts that take float32 x")
            rows, repeat = self.xp.repeat(x, top_k, axis=0), 1
        if gate_up is not None:
            return self._expert_linear(rows, gate_up, flat_ids, epilogue="swiglu", x_repeat=repeat)
        return self.silu_mul(self._expert_linear(rows, gate, flat_ids, x_repeat=repeat),
                             self._expert_linear(rows, up, flat_ids, x_repeat=repeat))

    def _takes_int8_x(self, *ws: Linear) -> bool:
        return all(self._launch.uses_int8_x(kind, words, gs)
                   for kind, words, _, _, gs in map(self._weight_parts, ws))

    def _sorted_experts(self, x: Any, flat_ids: Any, top_k: int, ws: tuple[Linear, Linear, Linear],
                        num_experts: int, gate_up: Linear | None = None) -> Any:
        """The routed slots sorted by expert, each expert's run on the tensor cores (one
        launch a weight, qdot's bits a row): [rows * top_k, H] in slot order. gate_up: the
        experts' [gate; up] in one launch (gate and up are then views of it, not used)."""
        from cuda_kernels.expert_tiles import expert_tiles

        xp, gate, up, down = self.xp, *ws
        order, tiles = expert_tiles(xp, flat_ids, num_experts, self._launch.SORTED_EXPERT_ROWS)
        tokens = order // top_k  # the x row of each sorted slot
        quantized: dict[str, tuple[Any, Any]] = {}  # x once a byte order, gate and up share it
        if isinstance(x, Int8Rows):
            quantized[x.kind] = x.xq, x.xs
        if gate_up is not None:
            both = self._sorted_linear(x, tokens, gate_up, tiles, quantized)
            width = gate_up.out_features // 2
            h = self.silu_mul(xp.ascontiguousarray(both[:, :width]),
                              xp.ascontiguousarray(both[:, width:]))
        else:
            h = self.silu_mul(self._sorted_linear(x, tokens, gate, tiles, quantized),
                              self._sorted_linear(x, tokens, up, tiles, quantized))
        out_sorted = self._sorted_linear(h, None, down, tiles, {})
        expert_out = xp.empty_like(out_sorted)
        expert_out[order] = out_sorted
        return expert_out

    def _sorted_linear(self, rows: Any, take: Any | None, w: Linear, tiles: Any,
                       quantized: dict[str, tuple[Any, Any]]) -> Any:
        """(rows[take] or rows) [n, K], sorted by expert, times each one's expert of w."""
        xp, dev = self.xp, self._dev
        kind, words, scales, biases, group_size = self._weight_parts(w)
        if kind not in quantized and isinstance(rows, Int8Rows):
            raise BadInputError(f"moe: int8 rows for {rows.kind} weights, the experts are {kind}")
        if kind not in quantized:
            q_shape, s_shape = self._launch.quantize_scratch_shapes(*rows.shape)
            xq, xs = xp.empty(q_shape, xp.int8), xp.empty(s_shape, xp.float32)
            self._launch.quantize(kind, dev(rows), dev(xq), dev(xs), self._stream())
            quantized[kind] = xq, xs
        xq, xs = quantized[kind]
        if take is not None:
            xq, xs = xq[take], xs[take]
        out = xp.empty((xq.shape[0], w.out_features), xp.float32)
        self._launch.sorted_expert_matmul(kind, dev(xq), dev(xs), dev(words), dev(scales),
                                          dev(biases), group_size, dev(tiles), dev(out),
                                          self._stream())
        return out

    def _expert_linear(self, rows: Any, w: Linear, expert_ids: Any, epilogue: str = "store",
                       x_repeat: int = 1) -> Any:
        """Row-slot s of the output through expert expert_ids[s] of w, from rows[s // x_repeat]."""
        if isinstance(rows, Int8Rows):
            self._check_int8_rows(rows, "moe rows", rows.shape[0], w)
        width = w.out_features // 2 if epilogue == "swiglu" else w.out_features
        out = self.xp.empty((rows.shape[0] * x_repeat, width), self.xp.float32)
        self._matmul(rows, w, out, expert_ids, path="few", epilogue=epilogue, x_repeat=x_repeat)
        return out

    # ------------------------------------------------------------------ token choice
    def argmax(self, logits: Any) -> Any:
        """Greedy token of each row of logits [rows, V] -> [rows] int64 (ties: lowest id)."""
        check_array(logits, "argmax logits", np.float32, 2, xp=self.xp)
        out = self.xp.empty(logits.shape[0], self.xp.int64)
        if logits.shape[0]:
            # The split's per-part bests (CuPy scratch: a captured graph's pool keeps it)
            shape = self._launch.argmax_scratch_shape(*logits.shape)
            part_values = self.xp.empty(shape, self.xp.float32)
            part_ids = self.xp.empty(shape, self.xp.int64)
            self._launch.argmax(self._dev(logits), self._dev(out), self._stream(),
                                part_values=self._dev(part_values), part_ids=self._dev(part_ids))
        return out

    def sample(self, logits: Any, temperatures: Any, top_ks: Any, top_ps: Any, seeds: Any,
               positions: Any) -> Any:
        """Seeded top-k/top-p token per row (temperature <= 0: greedy); randomness from
        (seed, position), see cuda_kernels/sampling.py. -> [rows] int64."""
        xp = self.xp
        check_array(logits, "sample logits", np.float32, 2, xp=xp)
        rows = logits.shape[0]
        for arr, name, dtype in ((temperatures, "temperatures", np.float32), (top_ks, "top_ks", np.int32),
                                 (top_ps, "top_ps", np.float32), (seeds, "seeds", np.uint64),
                                 (positions, "positions", np.int64)):
            check_array(arr, f"sample {name}", dtype, 1, xp=xp)
            check_shape(arr, f"sample {name}", (rows,))
        out = xp.empty(rows, xp.int64)
        if rows:
            parts = [self._dev(a) for a in (logits, temperatures, top_ks, top_ps, seeds, positions, out)]
            self._launch.sample(*parts, self._stream())
        return out

    # ------------------------------------------------------------------ Gated DeltaNet
    # The launchers of cuda_kernels/gdn.py on Numba views (no sync) and the current stream.
    def _empty(self, shape: tuple[int, ...]) -> Any:
        return self.xp.empty(shape, dtype=np.float32)

    def causal_conv1d(self, x: Any, conv_states: Any, weight: Any, row_lanes: Any,
                      frozen: Any) -> Any:
        out = self._empty(x.shape)
        dev = self._dev
        self._gdn.causal_conv1d_batch(dev(x), dev(conv_states), dev(weight), dev(row_lanes),
                                      dev(frozen), dev(out), stream=self._stream())
        return out

    def gdn_qk_l2norm(self, mixed: Any, num_k_heads: int, head_k_dim: int, eps: float,
                      q_scale: float) -> tuple[Any, Any]:
        shape = (mixed.shape[0], num_k_heads, head_k_dim)
        q, k = self._empty(shape), self._empty(shape)
        self._gdn.gdn_qk_l2norm(self._dev(mixed), num_k_heads, head_k_dim, eps, q_scale,
                                self._dev(q), self._dev(k), stream=self._stream())
        return q, k

    def gdn_gates(self, a: Any, b: Any, a_log: Any, dt_bias: Any) -> tuple[Any, Any]:
        g, beta = self._empty(a.shape), self._empty(a.shape)
        parts = [self._dev(x) for x in (a, b, a_log, dt_bias, g, beta)]
        self._gdn.gdn_gates(*parts, stream=self._stream())
        return g, beta

    def gated_delta_rule(self, q: Any, k: Any, v: Any, g: Any, beta: Any, states: Any,
                         row_lanes: Any, frozen: Any) -> Any:
        out = self._empty(v.shape)
        parts = [self._dev(x) for x in (q, k, v, g, beta, states, row_lanes, frozen, out)]
        self._gdn.gated_delta_rule_batch(*parts, stream=self._stream())
        return out

    def gated_rms_norm(self, x: Any, z: Any, weight: Any, eps: float) -> Any:
        out = self._empty(x.shape)
        dev = self._dev
        self._gdn.gated_rms_norm(dev(x), dev(z), dev(weight), eps, dev(out), stream=self._stream())
        return out

    def split_query_gate(self, qg: Any, num_heads: int, head_dim: int) -> tuple[Any, Any]:
        rows = qg.shape[0]
        q = self._empty((rows, num_heads, head_dim))
        gate = self._empty((rows, num_heads * head_dim))
        self._gdn.split_query_gate(self._dev(qg), num_heads, head_dim, self._dev(q),
                                   self._dev(gate), stream=self._stream())
        return q, gate

    def sigmoid_gate_mul(self, x: Any, gate: Any) -> None:
        self._gdn.sigmoid_gate_mul(self._dev(x), self._dev(gate), self._dev(x),
                                   stream=self._stream())

    def shared_expert_add(self, h: Any, routed: Any, shared: Any, gate: Any) -> None:
        check_shared_expert_add(h, routed, shared, gate, xp=self.xp)
        if h.size:
            dev = self._dev
            self._gdn.shared_expert_add(dev(h), dev(routed), dev(shared), dev(gate),
                                        stream=self._stream())


def _one_weight(w: FusedLinear) -> Linear:
    """CudaOps' fused weights are concatenations (concat_linears), never LinearParts."""
    if isinstance(w, LinearParts):
        raise BadInputError("CudaOps multiplies one concatenated weight, not LinearParts")
    return w


def _rows_of(w: Linear, start: int, stop: int) -> Linear:
    """Rows (out features) [start, stop) of a 2-D weight or of each expert of a stacked one,
    as a view."""
    rows = (Ellipsis, slice(start, stop), slice(None))
    if isinstance(w, AffineWeight):
        return AffineWeight(w.codes[rows], w.scales[rows], w.biases[rows], w.bits, w.group_size)
    assert isinstance(w, DenseWeight)
    return DenseWeight(w.w[rows])
