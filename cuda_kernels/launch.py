"""Launch geometry of every kernel: the one place that picks grids and blocks. Callers pass
arrays that are already checked (dtype, layout, bounds) and device-resident (or NumPy
arrays under the simulator), plus a Numba stream (None = the default stream).

matmul.FEW_ROWS_MAX decides between the matmul's few-rows and many-rows paths; the two give
bit-identical rows (same reduction order), so the choice never changes a token.
"""

from __future__ import annotations

import numpy as _np

from cuda_kernels import attention as _attn
from cuda_kernels import attention_tiled as _tiled
from cuda_kernels import heads as _heads
from cuda_kernels import kv as _kv
from cuda_kernels import matmul as _mm
from cuda_kernels import moe as _moe
from cuda_kernels import norm as _norm
from cuda_kernels import qdot as _qd
from cuda_kernels import qmma as _qm
from cuda_kernels import qmma_few as _qf
from cuda_kernels import sampling as _smp
from cuda_kernels.env import SIMULATOR as _SIMULATOR
from cuda_kernels.env import cuda as _cuda

_MAX_GRID_1D = 65535 * 64
MAX_HEAD_DIM = _heads.MAX_HEAD_DIM
KV_KINDS = {"float32": "f32", "uint16": "bf16", "uint8": "fp8"}


def _go(kernel, grid, block, stream, *args) -> None:
    if stream is None:
        kernel[grid, block](*args)
    else:
        kernel[grid, block, stream](*args)


def _grid_1d(total: int, threads: int) -> int:
    return max(1, min((total + threads - 1) // threads, _MAX_GRID_1D))


def matmul(kind, x, w, scales, biases, group_size, expert_ids, out, stream=None, *, path=None, grouped=False,  # noqa: E501
           epilogue="store", xq=None, xs=None, x_ready=False, x_repeat=1) -> None:
    """out [rows, out_f] = x @ W.T. w/scales/biases carry the expert axis [E, ...];
    grouped: expert_ids[r] picks row r's expert (else expert 0 and expert_ids is a
    placeholder int32 array). path: 'few', 'many', 'mma' (the tensor cores: int8-x weights,
    cuda_kernels/qmma.py; 'many' takes it where it is faster), 'mma_few' (1..16 rows of q4
    int8-x weights on the tensor cores, cuda_kernels/qmma_few.py) or None (by row count, and
    'mma_few' where qmma_few.takes()); every path gives a row the same bits. epilogue: 'store',
    'add' (out += x @ W.T) or 'swiglu' (W = [gate; up], out [rows, I]).
    Affine weights that uses_int8_x() accepts multiply x quantized to int8 per chunk of 32
    (cuda_kernels/qdot.py): quantize_rows into xq [rows, K] int8 and xs [rows, 2K/32] f32
    (scratch; None: allocated here), then the qdot kernel. x_ready: xq and xs already hold x
    (rms_norm_quantize wrote them; x is not read and may be None). x_repeat (grouped int8-x
    weights only): out row r multiplies x row r // x_repeat (x holds each MoE token once)."""
    rows, out_features = out.shape
    auto = path is None
    if path is None:
        path = "few" if rows <= _mm.FEW_ROWS_MAX or grouped else "many"
    for name, array in (("x", x), ("w", w), ("scales", scales), ("biases", biases)):
        if array is not None and array.strides[-1] != 4:  # rows addressed as base + 4 * index
            raise ValueError(f"matmul {name}: the last axis must be contiguous 4-byte elements")
    int8_x = uses_int8_x(kind, w, group_size)
    if x_ready and not (int8_x and xq is not None and xs is not None):
        raise ValueError("matmul: x_ready needs xq and xs, and a weight that takes int8 x")
    if x_repeat != 1 and not (int8_x and grouped and path == "few"):
        raise ValueError("matmul: x_repeat takes grouped rows of int8-x weights on the few-rows path")
    if (xq if x_ready else x).shape[0] * x_repeat != rows:
        raise ValueError(f"matmul: {rows} out rows from x rows times x_repeat {x_repeat}")
    if path in ("mma", "mma_few") and not int8_x:
        raise ValueError(f"matmul: the tensor-core path takes int8-x affine weights, not {kind}")
    if int8_x:
        if not x_ready:
            xq, xs = _quantize(kind, x, xq, xs, stream)
        in_features = w.shape[2] * _mm.PER_WORD[kind]
        if path == "mma_few":
            _check_few_mma(kind, xq, xs, w, scales, biases, group_size, grouped)
        if path == "mma_few" or (auto and not grouped and _qf.takes(kind, rows, in_features, group_size)
                                 and _few_mma_aligned(xq, xs, scales, biases, group_size)):
            _matmul_few_mma(xq, xs, w, scales, biases, group_size, out, stream, epilogue)
            return
        if path == "mma" or (path == "many" and not grouped and _qm.takes(rows, in_features, out_features)):
            if grouped:  # the tensor cores, qdot's bits (cuda_kernels/qmma.py)
                raise ValueError("matmul: the tensor-core path does not take expert-grouped rows")
            mma = _qm.plan(rows)
            grid, block = _qm.launch_shape(rows, out_features, mma, epilogue)
            kernel = _qm.qmma_kernel(kind, mma, group_size // _qd.CHUNK, epilogue)
            _go(kernel, grid, block, stream, xq.view(_np.uint32), xs, w, scales, biases, out)
            return
        variant = _qd.plan(rows, w.shape[1], path, grouped)
        kernel = _qd.qdot_kernel(kind, variant, group_size // _qd.CHUNK, grouped, epilogue, x_repeat)
        grid, block = _mm.launch_shape(rows, out_features, variant, epilogue)
        _go(kernel, grid, block, stream, xq.view(_np.uint32), xs, w, scales, biases, expert_ids, out)
        return
    align = 4 * _mm.X_BATCH[kind]  # vector loads of x need every row start aligned
    vec_x = _address(x) % align == 0 and x.strides[0] % align == 0
    variant = _mm.plan(rows, w.shape[1], path, vec_x, grouped)
    group_words = group_size // _mm.PER_WORD[kind] if kind in ("q4", "q8") else 0
    kernel = _mm.matmul_kernel(kind, variant, group_words, grouped, epilogue)
    grid, block = _mm.launch_shape(rows, out_features, variant, epilogue)
    _go(kernel, grid, block, stream, x, w, scales, biases, expert_ids, out)


def _few_mma_aligned(xq, xs, scales, biases, group_size) -> bool:
    # Its 16-byte loads of x and x scales, and the ring's copies of scale pieces
    piece = _qf.piece_bytes(group_size)
    return (_address(xq) % 16 == 0 and _address(xs) % 16 == 0 and xq.strides[0] % 16 == 0
            and xs.strides[0] % 16 == 0 and all(_address(a) % piece == 0 and a.strides[1] % piece == 0
                                                 for a in (scales, biases)))


def _check_few_mma(kind, xq, xs, w, scales, biases, group_size, grouped) -> None:
    # What an explicit path='mma_few' needs (the automatic route asks takes() and alignment)
    rows, in_features = xq.shape
    if grouped or not _qf.supports(kind, rows, in_features, group_size) or w.shape[0] != 1:
        raise ValueError(f"matmul: the few-rows tensor-core path takes 1..{_qf.MAX_ROWS} ungrouped rows of "
                         f"q4 weights with in_features a multiple of 128 (got {kind}, {rows} rows, K {in_features})")
    if not _few_mma_aligned(xq, xs, scales, biases, group_size):
        raise ValueError("matmul: the few-rows tensor-core path needs 16-byte aligned int8 x and x scales, "
                         "and scale rows aligned to its copies")


def _matmul_few_mma(xq, xs, w, scales, biases, group_size, out, stream, epilogue) -> None:
    # A few rows on the tensor cores (cuda_kernels/qmma_few.py), qdot's bits.
    rows = xq.shape[0]
    variant = _qf.plan(rows, group_size // _qd.CHUNK)
    grid, block = _qf.launch_shape(rows, out.shape[1], variant, epilogue)
    kernel = _qf.qmma_few_kernel(variant, group_size // _qd.CHUNK, epilogue)
    _go(kernel, grid, block, stream, xq.view(_np.uint32), xs, w, scales, biases, out)


SORTED_EXPERT_ROWS = _qm.TILE_ROWS * _qm.GROUPED_VARIANT.rtiles  # rows a block of sorted_expert_matmul


def quantize(kind, x, xq, xs, stream=None) -> None:
    """x [rows, K] f32 -> xq [rows, K] int8, xs [rows, 2K/32] f32 (quantize_rows, in the byte
    order of `kind`: what an int8-x matmul of that kind multiplies)."""
    _quantize(kind, x, xq, xs, stream)


def sorted_expert_matmul(kind, xq, xs, w, scales, biases, group_size, tiles, out, stream=None) -> None:
    """out [n, out_f] = the rows of int8 x (xq [n, K] int8, xs [n, 2K/32] f32: quantize_rows'
    output), sorted by expert, each times its expert's weight [E, out_f, words], on the tensor
    cores: tiles [blocks, 3] int32 from expert_tiles(.., rows_per_block=16). Every row gets
    the bits of matmul(.., grouped=True) on the same row (cuda_kernels/qmma.py)."""
    if not uses_int8_x(kind, w, group_size):
        raise ValueError(f"sorted_expert_matmul: {kind} weights that take int8 x only")
    variant = _qm.GROUPED_VARIANT
    rows_block = _qm.TILE_ROWS * variant.rtiles
    (_, feat_blocks), block = _qm.launch_shape(rows_block, out.shape[1], variant)
    if tiles.shape[0]:
        kernel = _qm.qmma_kernel(kind, variant, group_size // _qd.CHUNK, "store", grouped=True)
        _go(kernel, (tiles.shape[0], feat_blocks), block, stream, xq.view(_np.uint32), xs, w, scales,
            biases, tiles, out)


def uses_int8_x(kind, w, group_size) -> bool:
    """Whether an affine weight [E, out_f, words] takes the int8-activation kernel: whole
    chunks of 32 inside each scale group, and 16-byte aligned rows (its 16-byte loads). A
    weight's answer never changes, so every row it multiplies gets the same numerics."""
    if kind not in _qd.WORDS_PER_CHUNK:
        return False
    in_features = w.shape[2] * _mm.PER_WORD[kind]
    aligned = _address(w) % 16 == 0 and all(s % 16 == 0 for s in w.strides[:2])
    return aligned and _qd.supports(in_features, group_size)


def quantize_scratch_shapes(rows: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the int8 x (int8) and its chunk scales (float32) that matmul needs."""
    return (rows, in_features), (rows, 2 * in_features // _qd.CHUNK)


def _scratch(shape, dtype, stream):
    """Scratch a launcher allocates when its caller passes none: NumPy under the simulator, else
    a Numba device array (freed when the launch returns: a graph capture must pass scratch that
    outlives its replays)."""
    return _np.empty(shape, dtype) if _SIMULATOR else _cuda.device_array(shape, dtype, stream=stream or 0)


def _quantize(kind, x, xq, xs, stream):
    q_shape, s_shape = quantize_scratch_shapes(*x.shape)
    if (xq is None) != (xs is None):
        raise ValueError("matmul int8 x scratch: pass both xq and xs, or neither")
    if xq is None:
        xq, xs = _scratch(q_shape, _np.int8, stream), _scratch(s_shape, _np.float32, stream)
    if tuple(xq.shape) != q_shape or tuple(xs.shape) != s_shape:
        raise ValueError(f"matmul int8 x scratch: expected {q_shape} and {s_shape}, got {xq.shape} and {xs.shape}")
    if x.shape[0]:
        grid, block = _qd.quantize_shape(*x.shape)
        _go(_qd.quantize_rows, grid, block, stream, x, kind == "q4", xq, xs)
    return xq, xs


def _address(array) -> int:
    """Address of the first element (device arrays, or NumPy arrays under the simulator)."""
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    return int(array.ctypes.data)


def embed_affine(codes, scales, biases, bits, group_size, ids, out, stream=None) -> None:
    _go(_mm.embed_affine, (out.shape[0],), 128, stream, codes, scales, biases, bits, group_size, ids, out)


def attention_scratch_shape(rows: int, num_heads: int, head_dim: int, table_width: int, page_size: int
                            ) -> tuple[int, ...]:
    """The float32 scratch `attention` needs for these shapes (cuda_kernels.attention)."""
    return _attn.scratch_shape(rows, num_heads, head_dim, table_width, page_size)


TILED_ATTENTION_MIN_ROWS = 16  # launches of at least this many rows may take the tiled kernel
TILED_ATTENTION = False  # off until measured on a GPU (cuda_kernels/attention_tiled.py: same bits)


def attention(q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size, sm_scale, out, stream=None,  # noqa: E501
              *, scratch=None, int8_out=None, tiled=None) -> None:
    """Paged causal GQA attention; the KV dtype picks the kernel. Split over keys: a partial
    kernel per (row, head group, chunk) into `scratch`, then a combine kernel per (row, head)
    (cuda_kernels/attention.py). scratch: float32 of attention.scratch_shape(rows, num_heads,
    head_dim, block_table.shape[1], page_size) or wider in rows (None: allocated here).
    int8_out = (q4_order, xq, xs): the combine also writes out's rows [rows, nh * hd] as int8 x
    (qdot.quantize_rows' bits; xq int8 [rows, nh * hd], xs f32 [rows, 2 * nh * hd / 32]; head_dim
    a multiple of 32). Rows run in slices of scratch.shape[0]; the grid depends only on shapes,
    never on row_pos. tiled: the partials from cuda_kernels/attention_tiled.py (a block of rows
    shares each key tile; the same partials, so the same bits) where head_dim <= 128; None:
    TILED_ATTENTION for launches of at least TILED_ATTENTION_MIN_ROWS rows."""
    rows, num_heads, head_dim = q.shape
    heads_blk = _attn.heads_per_block(num_heads, kv_layer.shape[2])
    kernel = _attn.attention_kernel(KV_KINDS[str(kv_layer.dtype)], head_dim, heads_blk)
    head_blocks = num_heads // heads_blk
    shape = _attn.scratch_shape(rows, num_heads, head_dim, block_table.shape[1], page_size)
    if scratch is None:
        scratch = _scratch(shape, _np.float32, stream)
    if tuple(scratch.shape[1:]) != shape[1:] or scratch.shape[0] < 1 or scratch.dtype != _np.float32:
        raise ValueError(f"attention scratch: expected float32 [n, {', '.join(map(str, shape[1:]))}], "
                         f"got {scratch.dtype} {tuple(scratch.shape)}")
    if int8_out is not None:
        q_shape, s_shape = quantize_scratch_shapes(rows, num_heads * head_dim)
        if head_dim % _qd.CHUNK or tuple(int8_out[1].shape) != q_shape or tuple(int8_out[2].shape) != s_shape:
            raise ValueError(f"attention int8 output: head_dim {head_dim} (a multiple of {_qd.CHUNK}), expected "
                             f"{q_shape} and {s_shape}, got {int8_out[1].shape} and {int8_out[2].shape}")
    wanted = TILED_ATTENTION and rows >= TILED_ATTENTION_MIN_ROWS if tiled is None else tiled
    use_tiled = wanted and _attn.tile_for_head_dim(head_dim)[1] <= 128
    if use_tiled:
        kernel = _tiled.tiled_kernel(KV_KINDS[str(kv_layer.dtype)], head_dim, heads_blk)
        rows_blk = _tiled.rows_per_block(heads_blk, _attn.tile_for_head_dim(head_dim)[1])
    step = scratch.shape[0]
    for r0 in range(0, rows, step):
        n = min(rows, r0 + step) - r0
        pos = row_pos[r0 : r0 + n]
        if use_tiled:
            grid = ((n + rows_blk - 1) // rows_blk, head_blocks, 1)
        else:
            grid = (n, head_blocks, _attn.chunk_blocks(n, head_blocks, shape[2]))
        args = (q[r0 : r0 + n], kv_layer, k_scale, v_scale, block_table, row_seq[r0 : r0 + n], pos, page_size)
        _go(kernel, grid, _attn.ATTN_THREADS, stream, *args, sm_scale, scratch)
        combine = (pos, scratch, out[r0 : r0 + n])
        if int8_out is None:
            _go(_attn.combine_kernel, (n, num_heads), _attn.COMBINE_THREADS, stream, *combine)
        else:
            q4_order, xq, xs = int8_out
            _go(_attn.combine_quantize_kernel, (n, num_heads), _attn.COMBINE_THREADS, stream, *combine,
                bool(q4_order), xq[r0 : r0 + n], xs[r0 : r0 + n])


def kv_write(k, v, kv_layer, slots, k_scale, v_scale, stream=None) -> None:
    kernel = {"f32": _kv.kv_write_f32, "bf16": _kv.kv_write_bf16, "fp8": _kv.kv_write_fp8}[
        KV_KINDS[str(kv_layer.dtype)]
    ]
    _go(kernel, (k.shape[0], 2), _kv.KV_THREADS, stream, k, v, kv_layer, slots, k_scale, v_scale)


def attn_inputs(qkv, q_norm, k_norm, use_norm, eps, positions, inv_freq, mscale, kv_layer, slots,
                k_scale, v_scale, q_out, stream=None) -> None:
    """q|k|v rows -> normed, roped q_out [rows, nh, hd]; K and V into kv_layer at slots."""
    kernel = _heads.KERNELS[KV_KINDS[str(kv_layer.dtype)]]
    grid = (qkv.shape[0], q_out.shape[1] + 2 * kv_layer.shape[2])
    _go(kernel, grid, _heads.HEAD_THREADS, stream, qkv, q_norm, k_norm, use_norm, eps, positions,
        inv_freq, mscale, kv_layer, slots, k_scale, v_scale, q_out)


def zero_pages(kv_flat, page_ids, page_size, stream=None) -> None:
    """kv_flat: the arena viewed as [num_layers * 2, num_slots, nkv * hd]."""
    grid = (page_ids.shape[0], kv_flat.shape[0])
    _go(_kv.zero_pages, grid, _kv.KV_THREADS, stream, kv_flat, page_ids, page_size)


def rms_norm(x, w, eps, out, stream=None) -> None:
    kernel = _norm.rms_norm_kernel(x.shape[1])
    _go(kernel, (x.shape[0],), _norm.NORM_THREADS, stream, x, w, eps, out)


def rms_norm_quantize(x, w, eps, q4_order, xq, xs, stream=None) -> None:
    """xq, xs = the int8 x (qdot.quantize_rows) of rms_norm(x, w, eps), in one launch."""
    grid, block = _qd.quantize_shape(x.shape[0], x.shape[1], norm=True)
    _go(_qd.rms_norm_quantize, grid, block, stream, x, w, eps, q4_order, xq, xs)


def rope(x, positions, inv_freq, mscale, stream=None) -> None:
    total = x.shape[0] * x.shape[1] * inv_freq.shape[0]
    threads = _norm.ELEMWISE_THREADS
    _go(_norm.rope, _grid_1d(total, threads), threads, stream, x, positions, inv_freq, mscale)


def silu_mul(gate, up, out, stream=None) -> None:
    threads = _norm.ELEMWISE_THREADS
    _go(_norm.silu_mul, _grid_1d(gate.size, threads), threads, stream, gate, up, out)


def moe_route(logits, top_k, norm_topk_prob, out_ids, out_weights, stream=None) -> None:
    """out_ids, out_weights [rows, top_k]: each row's top_k experts (cuda_kernels/moe.py); top_k
    at most moe.ROUTE_MAX_TOP_K (a lane of the row's warp holds each pick)."""
    if top_k > _moe.ROUTE_MAX_TOP_K:
        raise ValueError(f"moe_route: top_k {top_k} is more than the kernel's {_moe.ROUTE_MAX_TOP_K}")
    threads = 32 * _moe.ROUTE_WARPS
    grid = _grid_1d(logits.shape[0], _moe.ROUTE_WARPS)
    _go(_moe.moe_route, grid, threads, stream, logits, top_k, norm_topk_prob, out_ids, out_weights)


def moe_combine(expert_out, weights, out, stream=None) -> None:
    threads = _moe.COMBINE_THREADS
    grid = (out.shape[0], (out.shape[1] + threads - 1) // threads)
    _go(_moe.moe_combine, grid, threads, stream, expert_out, weights, out)


def argmax_scratch_shape(rows: int, vocab: int) -> tuple[int, int]:
    """Shape (rows, parts) of argmax's scratch: part_values float32, part_ids int64."""
    return rows, _smp.argmax_parts_for(vocab)


def argmax(logits, out, stream=None, part_values=None, part_ids=None) -> None:
    """out [rows] int64 = each row's largest logit's id (ties: the lowest; NaN never wins; a
    row of NaN / -inf: 0), split: argmax_parts writes each part's best into part_values /
    part_ids [rows, parts] (scratch; None: allocated here; any parts >= 1 gives the same
    token, argmax_scratch_shape's is the one meant), then argmax_reduce picks the row's."""
    rows, vocab = logits.shape
    if (part_values is None) != (part_ids is None):
        raise ValueError("argmax scratch: pass both part_values and part_ids, or neither")
    if part_values is None:
        shape = argmax_scratch_shape(rows, vocab)
        part_values, part_ids = _scratch(shape, _np.float32, stream), _scratch(shape, _np.int64, stream)
    if (len(part_values.shape) != 2 or part_values.shape[0] != rows or part_values.shape[1] < 1
            or tuple(part_ids.shape) != tuple(part_values.shape) or part_values.dtype != _np.float32
            or part_ids.dtype != _np.int64):
        raise ValueError(f"argmax scratch: expected float32 and int64 [{rows}, parts >= 1], got "
                         f"{part_values.dtype} {tuple(part_values.shape)} and {part_ids.dtype} "
                         f"{tuple(part_ids.shape)}")
    if rows:
        _go(_smp.argmax_parts, (rows, part_values.shape[1]), _smp.SAMPLE_THREADS, stream, logits,
            part_values, part_ids)
        _go(_smp.argmax_reduce, (rows,), _smp.ARGMAX_REDUCE_THREADS, stream, part_values, part_ids,
            _np.int64(vocab), out)


def sample(logits, temperatures, top_ks, top_ps, seeds, positions, out, stream=None) -> None:
    args = (logits, temperatures, top_ks, top_ps, seeds, positions, out)
    _go(_smp.sample, (logits.shape[0],), _smp.SAMPLE_THREADS, stream, *args)
