"""Numba CPU kernels (docs/KERNELS.md). Outputs are passed in; kernels return nothing.

Every kernel is batch-invariant: each output row (or (row, head)) is computed by the same
sequential code with the same reduction order, whatever the other rows of the call are.
Parallel kernels split work over output features or (row block, head) items, never inside a
reduction, and small calls run on the calling thread with the same per-row code.
The quantized matmul is a hand-written LLVM vector loop (see "intrinsics") whose order is
fixed by construction; the other reductions live in small `fastmath` helpers that LLVM
vectorises with a lane/unroll order that depends only on the length.

Kernels trust their arguments (no bounds checks inside); `CpuOps` validates them first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .int8_matmul import quantize_rows_int8  # noqa: F401  (the twin's x; called from Python)

_F32 = np.float32
# IEEE division (no ZeroDivisionError branch, which would stop loops from vectorising)
_JIT: dict[str, Any] = {"nogil": True, "cache": True, "error_model": "numpy"}
_FEATURE_BLOCK_FLOATS = 6144  # dequantized weights per block (24 KiB: stays in L1)
_MAX_CHUNKS = 32
_PARALLEL_MIN_WORK = 1 << 17  # multiply-adds below which a kernel runs on the calling thread
_LAYOUT_GENERIC, _LAYOUT_U4, _LAYOUT_U8 = 0, 1, 2
_ROW_BLOCK = 32  # attention: query rows of one stream that share converted K/V tiles
_KEY_TILE = 128  # attention: keys converted to float32 at once (K^T tile: 32 KiB at hd 64)
_VALUE_TILE = 64  # attention: values converted at once (16 KiB at hd 64)
_VALUE_STRETCH = 64  # attention: V rows read in place per stretch (one prefetched 2 ahead)
_PREFETCH_KEYS = 256  # attention: K and V rows asked for before a block (128 KiB: f32, hd 64)


# ----------------------------------------------------------------------------- intrinsics
# Explicit LLVM IR. The fused dequantize-and-dot is written by hand because the
# auto-vectoriser leaves the nibble unpacking scalar and may choose its own reduction order:
# here each output row accumulates 16-byte code blocks in order into its own 16-lane
# vector(s) with llvm.fma and ends with a fixed halving sum. No fast-math flags are set, so
# LLVM keeps exactly this arithmetic whether 1 or 4 rows share the weights (and splits the
# vectors, with the same results, on machines without AVX-512). They live in this file
# because Numba's cache only notices edits to the file of the cached function.
_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_V16_I8 = ir.VectorType(_I8, 16)
_V16_I32 = ir.VectorType(_I32, 16)
_V16_F32 = ir.VectorType(ir.FloatType(), 16)


@intrinsic
def f32_as_u32(typingctx, x):  # noqa: ARG001
    """float32 -> its IEEE bits as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


@intrinsic
def u32_as_f32(typingctx, u):  # noqa: ARG001
    """uint32 bits -> float32."""
    if u != types.uint32:
        return None

    def codegen(context, builder, signature, args):  # noqa: ARG001
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def prefetch_row(typingctx, row):  # noqa: ARG001
    """Ask for the cache lines of a contiguous 1-D array's bytes (llvm.prefetch: a hint, the
    values and so every result are unchanged)."""
    if not (isinstance(row, types.Array) and row.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        base = builder.bitcast(array.data, i8p)
        nbytes = builder.mul(cgutils.unpack_tuple(builder, array.shape)[0], array.itemsize)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0")
        hint = [ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)]
        lines = builder.udiv(builder.add(nbytes, ir.Constant(i64, 63)), ir.Constant(i64, 64))
        with cgutils.for_range(builder, lines) as loop:
            builder.call(fn, [builder.gep(base, [builder.shl(loop.index, ir.Constant(i64, 6))])] + hint)
        last = builder.gep(base, [builder.sub(nbytes, ir.Constant(i64, 1))])  # an unaligned row's end
        builder.call(fn, [last] + hint)
        return context.get_dummy_value()

    return types.void(row), codegen


@intrinsic
def fma32(typingctx, a, b, c):  # noqa: ARG001
    """a * b + c in float32 with one rounding (llvm.fma.f32)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):  # noqa: ARG001
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")
        return builder.call(fn, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


def _splat(builder, value, vector_type):
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(one, undef, mask)


def _fma16(builder, codes_i32, scale, bias):
    fnty = ir.FunctionType(_V16_F32, [_V16_F32] * 3)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32")
    q = builder.sitofp(codes_i32, _V16_F32)
    return builder.call(fn, [q, _splat(builder, scale, _V16_F32), _splat(builder, bias, _V16_F32)])


# ----------------------------------------------------------------------------- fused dot
def _hsum16(builder, v):
    """Sum of 16 lanes by a fixed halving tree (no fast-math: the order is exactly this)."""
    width = 16
    while width > 1:
        width //= 2
        low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
        high = builder.shuffle_vector(
            v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
        v = builder.fadd(low, high)
    return builder.extract_element(v, ir.Constant(_I32, 0))


class _Operands:
    """Pointers and sizes that the fused dot reads, unpacked from the Numba array structs."""

    def __init__(self, context, builder, sig, args):
        codes, scales, biases, group_shift, xp, row0, out, first, last, out_offset = args
        c = context.make_array(sig.args[0])(context, builder, codes)
        self.codes = builder.bitcast(c.data, _I8.as_pointer())
        self.code_bytes = builder.mul(cgutils.unpack_tuple(builder, c.shape)[1],
                                      ir.Constant(_I64, 4))
        sc = context.make_array(sig.args[1])(context, builder, scales)
        self.scales, self.num_groups = sc.data, cgutils.unpack_tuple(builder, sc.shape)[1]
        self.biases = context.make_array(sig.args[2])(context, builder, biases).data
        self.group_shift = context.cast(builder, group_shift, sig.args[3], types.intp)
        x = context.make_array(sig.args[4])(context, builder, xp)
        self.x, self.in_features = x.data, cgutils.unpack_tuple(builder, x.shape)[1]
        o = context.make_array(sig.args[6])(context, builder, out)
        self.out, self.out_features = o.data, cgutils.unpack_tuple(builder, o.shape)[1]
        self.row0 = context.cast(builder, row0, sig.args[5], types.intp)
        self.first = context.cast(builder, first, sig.args[7], types.intp)
        self.last = context.cast(builder, last, sig.args[8], types.intp)
        self.out_offset = context.cast(builder, out_offset, sig.args[9], types.intp)

    def feature(self, builder, o):
        """(codes, scales, biases) pointers of weight row o."""
        group0 = builder.mul(o, self.num_groups)
        return (builder.gep(self.codes, [builder.mul(o, self.code_bytes)]),
                builder.gep(self.scales, [group0]), builder.gep(self.biases, [group0]))

    def x_row(self, builder, k):
        row = builder.add(self.row0, ir.Constant(_I64, k))
        return builder.gep(self.x, [builder.mul(row, self.in_features)])

    def store_out(self, builder, k, o, value):
        row = builder.add(self.row0, ir.Constant(_I64, k))
        index = builder.add(builder.mul(row, self.out_features), builder.add(o, self.out_offset))
        builder.store(value, builder.gep(self.out, [index]))


def _load_x16(builder, row_ptr, offset):
    return builder.load(builder.bitcast(builder.gep(row_ptr, [offset]), _V16_F32.as_pointer()),
                        align=4)


def _block_weights(builder, codes, block, scale, bias, bits):
    """Dequantized weights of one 16-byte block: [low, high] nibbles (4-bit) or [bytes]."""
    src = builder.gep(codes, [builder.mul(block, ir.Constant(_I64, 16))])
    q = builder.zext(builder.load(builder.bitcast(src, _V16_I8.as_pointer()), align=1), _V16_I32)
    if bits == 8:
        return [_fma16(builder, q, scale, bias)]
    low = builder.and_(q, ir.Constant(_V16_I32, [15] * 16))
    high = builder.lshr(q, ir.Constant(_V16_I32, [4] * 16))
    return [_fma16(builder, low, scale, bias), _fma16(builder, high, scale, bias)]


def _emit_block(builder, weight_row, group_shift, accs, rows, block, bits):
    """Accumulate one 16-byte code block into every row's accumulator(s)."""
    codes, scales, biases = weight_row
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16_F32, [_V16_F32] * 3), "llvm.fma.v16f32")
    g = builder.lshr(block, group_shift)
    scale = builder.load(builder.gep(scales, [g]))
    bias = builder.load(builder.gep(biases, [g]))
    weights = _block_weights(builder, codes, block, scale, bias, bits)
    base = builder.mul(block, ir.Constant(_I64, 16 * len(weights)))
    for k, row in enumerate(rows):
        for c, w in enumerate(weights):
            x16 = _load_x16(builder, row, builder.add(base, ir.Constant(_I64, 16 * c)))
            builder.store(builder.call(fma, [w, x16, builder.load(accs[k][c])]), accs[k][c])


def _emit_feature(builder, ops, o, accs, rows, bits):
    """out[row0 + k, o] for every row k: all code blocks in order, then a fixed lane sum."""
    zero = ir.Constant(_V16_F32, [0.0] * 16)
    for row_accs in accs:
        for acc in row_accs:
            builder.store(zero, acc)
    weight_row = ops.feature(builder, o)
    num_blocks = builder.shl(ops.num_groups, ops.group_shift)
    one = ir.Constant(_I64, 1)
    with cgutils.for_range(builder, builder.lshr(num_blocks, one)) as loop:  # 2 per trip
        first = builder.shl(loop.index, one)
        _emit_block(builder, weight_row, ops.group_shift, accs, rows, first, bits)
        _emit_block(builder, weight_row, ops.group_shift, accs, rows, builder.add(first, one),
                    bits)
    with builder.if_then(builder.trunc(num_blocks, ir.IntType(1))):  # odd count: last one
        _emit_block(builder, weight_row, ops.group_shift, accs, rows,
                    builder.sub(num_blocks, one), bits)
    for k, row_accs in enumerate(accs):
        total = builder.load(row_accs[0])
        for acc in row_accs[1:]:
            total = builder.fadd(total, builder.load(acc))
        ops.store_out(builder, k, o, _hsum16(builder, total))


def _fused_dot_codegen(bits, num_rows):
    def codegen(context, builder, sig, args):
        ops = _Operands(context, builder, sig, args)
        chains = 2 if bits == 4 else 1  # 4-bit: one accumulator per nibble half
        accs = [[cgutils.alloca_once(builder, _V16_F32) for _ in range(chains)]
                for _ in range(num_rows)]
        rows = [ops.x_row(builder, k) for k in range(num_rows)]
        count = builder.sub(ops.last, ops.first)
        with cgutils.for_range(builder, count) as feature_loop:
            o = builder.add(ops.first, feature_loop.index)
            _emit_feature(builder, ops, o, accs, rows, bits)
        return context.get_dummy_value()

    return codegen


_DOT_DOC = """dot_u{bits}_rows{R}(codes, scales, biases, group_shift, xp, row0, out, first, last,
out_offset): out[row0 + k, out_offset + o] = xp[row0 + k] . dequant(weight row o) for k < R and
first <= o < last;
codes [out_f, in*bits/32] u32, scales/biases [out_f, groups] f32 with 2**group_shift 16-byte
code blocks per group. 4-bit expects xp permuted per 32 elements (even, then odd elements). Each row
accumulates block by block into its own 16-lane vector(s) and ends with a fixed halving sum,
so its result does not depend on R or on the other rows."""


def _fused_dot(bits, num_rows):
    @intrinsic
    def fused(typingctx, codes, scales, biases, group_shift, xp, row0, out, first, last,  # noqa: ARG001
              out_offset):
        sig = types.void(codes, scales, biases, group_shift, xp, row0, out, first, last, out_offset)
        return sig, _fused_dot_codegen(bits, num_rows)

    fused.__doc__ = _DOT_DOC
    return fused


dot_u4_rows1 = _fused_dot(4, 1)
dot_u4_rows4 = _fused_dot(4, 4)
dot_u8_rows1 = _fused_dot(8, 1)
dot_u8_rows4 = _fused_dot(8, 4)


# ----------------------------------------------------------------------------- 8x8 transpose
_V8_F32 = ir.VectorType(ir.FloatType(), 8)
# (a, b) lane picks of the three stages of an 8x8 float transpose (unpack, pairs, halves)
_UNPACK = ([0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])
_PAIRS = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def _shuffle_pairs(builder, rows, masks):
    out = []
    for k in range(0, len(rows), 2):
        for mask in masks:
            out.append(builder.shuffle_vector(rows[k], rows[k + 1],
                                              ir.Constant(ir.VectorType(_I32, 8), mask)))
    return out


def _transpose8_ir(builder, rows):
    """Columns of the 8x8 block whose rows are `rows` (8 x <8 x float>): exact lane moves."""
    t = _shuffle_pairs(builder, rows, _UNPACK)  # t0..t7 from (r0 r1) (r2 r3) (r4 r5) (r6 r7)
    u = _shuffle_pairs(builder, [t[0], t[2], t[1], t[3], t[4], t[6], t[5], t[7]], _PAIRS)
    o = _shuffle_pairs(builder, [u[0], u[4], u[1], u[5], u[2], u[6], u[3], u[7]], _HALVES)
    return [o[0], o[2], o[4], o[6], o[1], o[3], o[5], o[7]]


@intrinsic
def transpose8(typingctx, src, src_start, dst, dst_start):  # noqa: ARG001
    """dst[dst_start + k*dst_row + j] = src[src_start + j*src_row + k] for j, k < 8: an 8x8
    block of 2D C float32 arrays transposed (rows of 8 floats moved by shuffles, no rounding)."""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array)
            and src.dtype == dst.dtype == types.float32 and src.ndim == dst.ndim == 2
            and src.layout == dst.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        s = context.make_array(signature.args[0])(context, builder, args[0])
        d = context.make_array(signature.args[2])(context, builder, args[2])
        s_row = cgutils.unpack_tuple(builder, s.shape)[1]
        d_row = cgutils.unpack_tuple(builder, d.shape)[1]
        s_at = context.cast(builder, args[1], signature.args[1], types.intp)
        d_at = context.cast(builder, args[3], signature.args[3], types.intp)
        rows = []
        for k in range(8):
            at = builder.add(s_at, builder.mul(s_row, ir.Constant(_I64, k)))
            ptr = builder.bitcast(builder.gep(s.data, [at]), _V8_F32.as_pointer())
            rows.append(builder.load(ptr, align=4))
        for k, column in enumerate(_transpose8_ir(builder, rows)):
            at = builder.add(d_at, builder.mul(d_row, ir.Constant(_I64, k)))
            builder.store(column, builder.bitcast(builder.gep(d.data, [at]), _V8_F32.as_pointer()),
                          align=4)
        return context.get_dummy_value()

    return types.void(src, src_start, dst, dst_start), codegen


# ----------------------------------------------------------------------------- attention tiles
# Two query vectors' scores over a K^T tile, and two probability rows' weighted values over a
# V tile, with each output element's chain exactly as the scalar loops had it (scores: fma
# over d ascending from 0, then * sm_scale; values: fma over keys ascending into acc), but
# with the chains of 32 keys (scores) or 32 dims (values) held in registers across the loop
# instead of stored and reloaded at every step.
def _ptr(context, builder, ty, value):
    return context.make_array(ty)(context, builder, value)


def _vec_at(builder, base, index, count=8):
    return builder.bitcast(builder.gep(base, [index]), ir.VectorType(ir.FloatType(), count).as_pointer())


def _fma8(builder):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8_F32, [_V8_F32] * 3), "llvm.fma.v8f32")


def _fma1(builder):
    f = ir.FloatType()
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f] * 3), "llvm.fma.f32")


def _splat8(builder, value):
    return _splat(builder, value, _V8_F32)


def _is_c(ty, ndim):
    return (isinstance(ty, types.Array) and ty.dtype == types.float32 and ty.ndim == ndim
            and ty.layout == "C")


def _for_blocks(builder, n, emit, big=4):
    """emit(start, width) over [0, n - n % 8): blocks of 8 * big (width big: that many 8-lane
    vectors), then of 8 (width 1); returns n - n % 8, where the one-by-one tail starts."""
    whole_big = builder.and_(n, ir.Constant(_I64, -8 * big))
    whole8 = builder.and_(n, ir.Constant(_I64, -8))
    for width, start, done in ((big, ir.Constant(_I64, 0), whole_big), (1, whole_big, whole8)):
        step = ir.Constant(_I64, 8 * width)
        with cgutils.for_range(builder, builder.udiv(builder.sub(done, start), step)) as block:
            emit(builder.add(start, builder.mul(block.index, step)), width)
    return whole8


MAX_GROUP = 4  # query vectors that share each key / value load in scores_group, values_group


def _for_counts(builder, count, emit):
    """emit(c) under `count == c` for c = 1 .. MAX_GROUP: code specialised to each count (its
    chains in registers); other counts do nothing."""
    for c in range(1, MAX_GROUP + 1):
        with builder.if_then(builder.icmp_signed("==", count, ir.Constant(_I64, c))):
            emit(c)


def _rows_of(builder, data, ids, row, c):
    """Pointers to rows ids[0 .. c) of a 2-D C array (row = its row length)."""
    return [builder.gep(data, [builder.mul(builder.load(builder.gep(ids, [ir.Constant(_I64, i)])), row)])
            for i in range(c)]


def _scores_block(builder, q_ptrs, keys, row, j0, width, head_dim, scale, outs):
    """outs[v][j0 .. j0 + 8 * width) for `width` vectors of 8 keys: chains over d in registers."""
    fma = _fma8(builder)
    zero = ir.Constant(_V8_F32, [0.0] * 8)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(width)] for _ in q_ptrs]
    with cgutils.for_range(builder, head_dim) as loop:
        d = loop.index
        ks = [builder.load(_vec_at(builder, keys, builder.add(builder.mul(d, row),
                                                              builder.add(j0, ir.Constant(_I64, 8 * w)))),
                           align=4) for w in range(width)]
        for q, acc_row in zip(q_ptrs, accs, strict=True):
            qd = _splat8(builder, builder.load(builder.gep(q, [d])))
            for k, acc in zip(ks, acc_row, strict=True):
                builder.store(builder.call(fma, [qd, k, builder.load(acc)]), acc)
    for out, acc_row in zip(outs, accs, strict=True):
        for w, acc in enumerate(acc_row):
            at = builder.add(j0, ir.Constant(_I64, 8 * w))
            builder.store(builder.fmul(builder.load(acc), _splat8(builder, scale)),
                          _vec_at(builder, out, at), align=4)


def _scores_count(builder, qs, outs, kt, row, head_dim, n, scale):
    """The scores of len(qs) query vectors over keys 0 .. n of the K^T tile."""
    big = 4 if len(qs) <= 2 else 2  # accumulators a block: len(qs) * big vectors in registers
    first_tail = _for_blocks(builder, n, lambda j0, width: _scores_block(
        builder, qs, kt, row, j0, width, head_dim, scale, outs), big)
    fma = _fma1(builder)
    with cgutils.for_range(builder, builder.sub(n, first_tail)) as tail:
        j = builder.add(first_tail, tail.index)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(ir.FloatType(), 0.0)) for _ in qs]
        with cgutils.for_range(builder, head_dim) as loop:
            k = builder.load(builder.gep(kt, [builder.add(builder.mul(loop.index, row), j)]))
            for q, acc in zip(qs, accs, strict=True):
                qd = builder.load(builder.gep(q, [loop.index]))
                builder.store(builder.call(fma, [qd, k, builder.load(acc)]), acc)
        for out, acc in zip(outs, accs, strict=True):
            builder.store(builder.fmul(builder.load(acc), scale), builder.gep(out, [j]))


def _is_ids(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.int64 and ty.ndim == 1 and ty.layout == "C"


@intrinsic
def scores_group(typingctx, qs, ids, count, keys_t, num_keys, sm_scale, scores, first):  # noqa: ARG001
    """scores[v, first + j] = (fma chain of qs[v, d] * keys_t[d, j], d ascending from 0) *
    sm_scale for v in ids[:count] (count 1 .. MAX_GROUP) and j < num_keys: the vectors share
    each key load. qs [vectors, hd], keys_t [hd, tile], scores [vectors, keys]: 2-D C float32."""
    if not (_is_c(qs, 2) and _is_ids(ids) and _is_c(keys_t, 2) and _is_c(scores, 2)
            and sm_scale == types.float32):
        return None
    sig = types.void(qs, ids, count, keys_t, num_keys, sm_scale, scores, first)

    def codegen(context, builder, sg, args):
        q = _ptr(context, builder, sg.args[0], args[0])
        ids_data = _ptr(context, builder, sg.args[1], args[1]).data
        count_, n, first_ = (context.cast(builder, args[i], sg.args[i], types.intp) for i in (2, 4, 7))
        kt = _ptr(context, builder, sg.args[3], args[3])
        head_dim, row = cgutils.unpack_tuple(builder, kt.shape)
        out = _ptr(context, builder, sg.args[6], args[6])
        out_row = cgutils.unpack_tuple(builder, out.shape)[1]
        q_row = cgutils.unpack_tuple(builder, q.shape)[1]

        def emit(c):
            qs_ = _rows_of(builder, q.data, ids_data, q_row, c)
            outs = [builder.gep(p, [first_]) for p in _rows_of(builder, out.data, ids_data, out_row, c)]
            _scores_count(builder, qs_, outs, kt.data, row, head_dim, n, args[5])

        _for_counts(builder, count_, emit)
        return context.get_dummy_value()

    return sig, codegen


class _ValueRows:
    """Key j's stored value row: src[kind, slots[j - slot_base], kv_head, :] of a 4-D C array
    of float32 or bf16 bits (uint16), loaded as float32 (bf16: the bits moved up 16, exact)."""

    def __init__(self, context, builder, sg, args):
        src = _ptr(context, builder, sg.args[3], args[3])
        _, num_slots, nkv, self.head_dim = cgutils.unpack_tuple(builder, src.shape)
        kind, base, head = (context.cast(builder, args[i], sg.args[i], types.intp) for i in (4, 6, 7))
        self.bf16 = sg.args[3].dtype == types.uint16
        self.data, self.nkv, self.head = src.data, nkv, head
        self.slots = builder.gep(_ptr(context, builder, sg.args[5], args[5]).data,
                                 [builder.neg(base)])
        self.kind_slots = builder.mul(kind, num_slots)

    def row(self, builder, j):
        slot = builder.load(builder.gep(self.slots, [j]))
        at = builder.mul(builder.add(builder.mul(builder.add(self.kind_slots, slot), self.nkv),
                                     self.head), self.head_dim)
        return builder.gep(self.data, [at])

    def load8(self, builder, row, d):
        if not self.bf16:
            return builder.load(_vec_at(builder, row, d), align=4)
        v8i16, v8i32 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(_I32, 8)
        h = builder.load(builder.bitcast(builder.gep(row, [d]), v8i16.as_pointer()), align=2)
        return builder.bitcast(builder.shl(builder.zext(h, v8i32), ir.Constant(v8i32, [16] * 8)), _V8_F32)

    def load1(self, builder, row, d):
        x = builder.load(builder.gep(row, [d]))
        if not self.bf16:
            return x
        return builder.bitcast(builder.shl(builder.zext(x, _I32), ir.Constant(_I32, 16)), ir.FloatType())


_VALUE_CHUNK = 16  # values_group: keys a pass over the head dims (their rows stay in L1)


def _values_block(builder, src, p_ptrs, acc_ptrs, d0, width, j0, j1):
    """accs[v][d0 .. d0 + 8 * width) += probs[v][j] * V[j, ...] for j in [j0, j1), ascending."""
    fma = _fma8(builder)
    accs = [[cgutils.alloca_once_value(builder, builder.load(
        _vec_at(builder, acc, builder.add(d0, ir.Constant(_I64, 8 * w))), align=4))
        for w in range(width)] for acc in acc_ptrs]
    with cgutils.for_range(builder, builder.sub(j1, j0)) as loop:
        j = builder.add(j0, loop.index)
        row = src.row(builder, j)
        vs = [src.load8(builder, row, builder.add(d0, ir.Constant(_I64, 8 * w))) for w in range(width)]
        for p, acc_row in zip(p_ptrs, accs, strict=True):
            pj = _splat8(builder, builder.load(builder.gep(p, [j])))
            for v, acc in zip(vs, acc_row, strict=True):
                builder.store(builder.call(fma, [pj, v, builder.load(acc)]), acc)
    for acc_ptr, acc_row in zip(acc_ptrs, accs, strict=True):
        for w, acc in enumerate(acc_row):
            at = builder.add(d0, ir.Constant(_I64, 8 * w))
            builder.store(builder.load(acc), _vec_at(builder, acc_ptr, at), align=4)


def _values_count(builder, src, ps, accs, j0, j1):
    """len(ps) vectors' values over keys [j0, j1): chunks of _VALUE_CHUNK keys, each chunk
    over all head dims (8 * big at a time, then 8, then one by one)."""
    big = 4 if len(ps) <= 2 else 2
    chunk = ir.Constant(_I64, _VALUE_CHUNK)
    count = builder.udiv(builder.add(builder.sub(j1, j0), ir.Constant(_I64, _VALUE_CHUNK - 1)), chunk)
    fma = _fma1(builder)
    with cgutils.for_range(builder, count) as outer:
        c0 = builder.add(j0, builder.mul(outer.index, chunk))
        c1 = builder.select(builder.icmp_signed("<", builder.add(c0, chunk), j1), builder.add(c0, chunk), j1)
        first_tail = _for_blocks(builder, src.head_dim, lambda d0, width: _values_block(
            builder, src, ps, accs, d0, width, c0, c1), big)
        with cgutils.for_range(builder, builder.sub(src.head_dim, first_tail)) as tail:
            d = builder.add(first_tail, tail.index)
            with cgutils.for_range(builder, builder.sub(c1, c0)) as loop:
                j = builder.add(c0, loop.index)
                v = src.load1(builder, src.row(builder, j), d)
                for p, acc in zip(ps, accs, strict=True):
                    slot = builder.gep(acc, [d])
                    pj = builder.load(builder.gep(p, [j]))
                    builder.store(builder.call(fma, [pj, v, builder.load(slot)]), slot)


@intrinsic
def values_group(typingctx, probs, ids, count, src, kind, slots, slot_base, kv_head, j0, j1, acc):  # noqa: ARG001
    """acc[v, d] = fma(probs[v, j], V[j, d], acc[v, d]) for j ascending in [j0, j1), v in
    ids[:count] (count 1 .. MAX_GROUP): the vectors share each value load. V[j] is read in place:
    src[kind, slots[j - slot_base], kv_head, :] (src 4-D C float32 or bf16 bits uint16: a KV
    layer, or a converted tile). probs [vectors, keys], acc [vectors, hd]: 2-D C float32."""
    if not (_is_c(probs, 2) and _is_ids(ids) and _is_c(acc, 2) and _is_ids(slots)
            and isinstance(src, types.Array) and src.ndim == 4 and src.layout == "C"
            and src.dtype in (types.float32, types.uint16)):
        return None
    sig = types.void(probs, ids, count, src, kind, slots, slot_base, kv_head, j0, j1, acc)

    def codegen(context, builder, sg, args):
        rows = _ValueRows(context, builder, sg, args)
        p = _ptr(context, builder, sg.args[0], args[0])
        ids_data = _ptr(context, builder, sg.args[1], args[1]).data
        count_, j0_, j1_ = (context.cast(builder, args[i], sg.args[i], types.intp) for i in (2, 8, 9))
        a = _ptr(context, builder, sg.args[10], args[10])
        p_row = cgutils.unpack_tuple(builder, p.shape)[1]
        a_row = cgutils.unpack_tuple(builder, a.shape)[1]

        def emit(c):
            _values_count(builder, rows, _rows_of(builder, p.data, ids_data, p_row, c),
                          _rows_of(builder, a.data, ids_data, a_row, c), j0_, j1_)

        _for_counts(builder, count_, emit)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def bf16_row_to_f32(typingctx, kv_layer, kind, slot, kv_head, tile, i):  # noqa: ARG001
    """tile[i, :] = float32 of the bf16 bits kv_layer[kind, slot, kv_head, :] (exact: the bits
    moved up 16), 8 at a time. kv_layer 4-D C uint16, tile 2-D C float32 of width head_dim."""
    if not (isinstance(kv_layer, types.Array) and kv_layer.dtype == types.uint16
            and kv_layer.ndim == 4 and kv_layer.layout == "C" and _is_c(tile, 2)):
        return None
    sig = types.void(kv_layer, kind, slot, kv_head, tile, i)

    def codegen(context, builder, sg, args):
        kv = _ptr(context, builder, sg.args[0], args[0])
        _, num_slots, nkv, head_dim = cgutils.unpack_tuple(builder, kv.shape)
        kind_, slot_, head_, row = (context.cast(builder, args[k], sg.args[k], types.intp)
                                    for k in (1, 2, 3, 5))
        t = _ptr(context, builder, sg.args[4], args[4])
        src = builder.gep(kv.data, [builder.mul(builder.add(builder.mul(builder.add(
            builder.mul(kind_, num_slots), slot_), nkv), head_), head_dim)])
        dst = builder.gep(t.data, [builder.mul(row, head_dim)])
        v8i16, v8i32 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(_I32, 8)
        whole = builder.and_(head_dim, ir.Constant(_I64, -8))
        with cgutils.for_range(builder, builder.lshr(whole, ir.Constant(_I64, 3))) as loop:
            d = builder.shl(loop.index, ir.Constant(_I64, 3))
            h = builder.load(builder.bitcast(builder.gep(src, [d]), v8i16.as_pointer()), align=2)
            bits = builder.shl(builder.zext(h, v8i32), ir.Constant(v8i32, [16] * 8))
            builder.store(builder.bitcast(bits, _V8_F32), _vec_at(builder, dst, d), align=4)
        with cgutils.for_range(builder, builder.sub(head_dim, whole)) as loop:
            d = builder.add(whole, loop.index)
            bits = builder.shl(builder.zext(builder.load(builder.gep(src, [d])), _I32),
                               ir.Constant(_I32, 16))
            builder.store(builder.bitcast(bits, ir.FloatType()), builder.gep(dst, [d]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def keys_t8(typingctx, kv_layer, kind, slots, kv_head, keys_t, j0):  # noqa: ARG001
    """keys_t[d, j0 + k] = float32 of kv_layer[kind, slots[k], kv_head, d] for k < 8 and every
    d (head_dim % 8 == 0): 8 stored rows (f32, or bf16 bits moved up 16: exact) transposed by
    8x8 shuffle blocks, without a row-major float copy in between."""
    if not (isinstance(kv_layer, types.Array) and kv_layer.dtype in (types.uint16, types.float32)
            and kv_layer.ndim == 4 and kv_layer.layout == "C" and _is_c(keys_t, 2)
            and isinstance(slots, types.Array) and slots.dtype == types.int64):
        return None
    sig = types.void(kv_layer, kind, slots, kv_head, keys_t, j0)

    def codegen(context, builder, sg, args):
        kv = _ptr(context, builder, sg.args[0], args[0])
        _, num_slots, nkv, head_dim = cgutils.unpack_tuple(builder, kv.shape)
        kind_, head_, col = (context.cast(builder, args[k], sg.args[k], types.intp) for k in (1, 3, 5))
        slot_data = _ptr(context, builder, sg.args[2], args[2]).data
        kt = _ptr(context, builder, sg.args[4], args[4])
        row = cgutils.unpack_tuple(builder, kt.shape)[1]
        v8i16, v8i32 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(_I32, 8)
        bf16 = sg.args[0].dtype == types.uint16
        starts = []
        for k in range(8):
            slot = builder.load(builder.gep(slot_data, [ir.Constant(_I64, k)]))
            at = builder.mul(builder.add(builder.mul(builder.add(builder.mul(kind_, num_slots), slot),
                                                     nkv), head_), head_dim)
            starts.append(builder.gep(kv.data, [at]))
        with cgutils.for_range(builder, builder.lshr(head_dim, ir.Constant(_I64, 3))) as loop:
            d0 = builder.shl(loop.index, ir.Constant(_I64, 3))
            rows = []
            for start in starts:
                if not bf16:
                    rows.append(builder.load(_vec_at(builder, start, d0), align=4))
                    continue
                h = builder.load(builder.bitcast(builder.gep(start, [d0]), v8i16.as_pointer()), align=2)
                bits = builder.shl(builder.zext(h, v8i32), ir.Constant(v8i32, [16] * 8))
                rows.append(builder.bitcast(bits, _V8_F32))
            for k, column in enumerate(_transpose8_ir(builder, rows)):
                at = builder.add(builder.mul(builder.add(d0, ir.Constant(_I64, k)), row), col)
                builder.store(column, _vec_at(builder, kt.data, at), align=4)
        return context.get_dummy_value()

    return sig, codegen


# ----------------------------------------------------------------------------- conversions
def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    mant = codes & 7
    mag = np.where(exp == 0, mant / 8.0 * 2.0**-6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (mant == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


E4M3_TABLE = _e4m3_table()  # decode LUT, 256 float32


@njit(**_JIT)
def to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    x = _F32(x)
    bits = np.int64(f32_as_u32(x))
    if x != x:
        return np.uint16((bits >> 16) | 0x40)
    return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


@njit(**_JIT)
def from_bf16_bits(h):
    """bfloat16 bits -> float32 (exact)."""
    return u32_as_f32(np.uint32(np.uint32(h) << np.uint32(16)))


@njit(**_JIT)
def bf16_round(x):
    """float32 rounded to the nearest bfloat16, as float32."""
    return from_bf16_bits(to_bf16_bits(x))


@njit(**_JIT)
def to_e4m3(x):
    """float32 -> OCP E4M3FN byte: saturate to +-448, round to nearest even, NaN -> 0x7F."""
    x = _F32(x)
    if x != x:
        return np.uint8(0x7F)
    sign = np.int64(f32_as_u32(x) >> np.uint32(24)) & 0x80
    mag = abs(x)
    if mag >= _F32(448.0):
        code = np.int64(0x7E)
    elif mag < _F32(0.015625):  # subnormal: steps of 2**-9 (8 steps = 2**-6 = code 0x08)
        code = np.int64(np.rint(np.float64(mag) * 512.0))
    else:  # round the 23-bit mantissa to 3 bits; a carry bumps the exponent correctly
        bits = np.int64(f32_as_u32(mag))
        code = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    return np.uint8(sign | code)


@njit(**_JIT)
def from_e4m3(q):
    """OCP E4M3FN byte -> float32."""
    return E4M3_TABLE[np.int64(q)]


def _kv_load(value, scale):
    """Stored KV element -> float32 (dispatch on the KV dtype)."""


def _kv_store(like, x, scale):
    """float32 -> stored KV element of `like`'s dtype."""


@overload(_kv_load, jit_options={"nogil": True, "error_model": "numpy"})
def _kv_load_impl(value, scale):
    if value == types.float32:
        return lambda value, scale: value
    if value == types.uint16:
        return lambda value, scale: from_bf16_bits(value)
    if value == types.uint8:
        return lambda value, scale: from_e4m3(value) * scale
    return None


@overload(_kv_store, jit_options={"nogil": True, "error_model": "numpy"})
def _kv_store_impl(like, x, scale):
    if like.dtype == types.float32:
        return lambda like, x, scale: x
    if like.dtype == types.uint16:
        return lambda like, x, scale: to_bf16_bits(x)
    if like.dtype == types.uint8:
        return lambda like, x, scale: to_e4m3(x / scale)
    return None


# ----------------------------------------------------------------------------- helpers
@njit(**_JIT, fastmath=True)
def _dot(a, b):
    # a, b: [n] float32; vectorised reduction, order fixed by n alone
    acc = _F32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(**_JIT, fastmath=True)
def _sum(a):
    acc = _F32(0.0)
    for i in range(a.shape[0]):
        acc += a[i]
    return acc


@njit(**_JIT)
def _exp32(x):
    """float32 e**x in plain arithmetic, so loops calling it vectorise (Cephes expf scheme:
    2**n * poly(r), about 1 ulp). Inputs are clamped to [-87.3, 88]: tiny results become
    ~1.2e-38 instead of 0 and results beyond e**88 stay e**88 (never inf)."""
    x = min(max(x, _F32(-87.33)), _F32(88.0))
    n = np.floor(x * _F32(1.44269504) + _F32(0.5))
    r = x - n * _F32(0.693359375) - n * _F32(-2.12194440e-4)
    p = _F32(1.9875691500e-4)
    p = p * r + _F32(1.3981999507e-3)
    p = p * r + _F32(8.3334519073e-3)
    p = p * r + _F32(4.1665795894e-2)
    p = p * r + _F32(1.6666665459e-1)
    p = p * r + _F32(5.0000001201e-1)
    p = p * (r * r) + r + _F32(1.0)
    return p * u32_as_f32(np.uint32((np.int32(n) + 127) << 23))


@njit(**_JIT, fastmath=True)
def _sum_squares(a):
    acc = _F32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * a[i]
    return acc


@njit(**_JIT)
def _chunk(index, num_chunks, num_items):
    """[start, end) of chunk `index` when `num_items` are split into `num_chunks`."""
    return index * num_items // num_chunks, (index + 1) * num_items // num_chunks


@njit(**_JIT)
def _num_chunks(num_items):
    # A fixed count (not the thread count: querying it defeats caching); prange deals the
    # chunks out to the threads and each chunk allocates its scratch once.
    return max(1, min(_MAX_CHUNKS, num_items))


# ----------------------------------------------------------------------------- matmuls
@njit(**_JIT)
def _group_shift(group_size, block_elements):
    """log2(group_size / block_elements), or -1 unless that is a whole power of two."""
    if group_size % block_elements != 0:
        return -1
    blocks = group_size // block_elements
    shift = 0
    while (1 << shift) < blocks:
        shift += 1
    return shift if (1 << shift) == blocks else -1


@njit(**_JIT)
def _affine_layout(bits, group_size):
    # Fast paths need each scale group to be 2**k whole 16-byte code blocks.
    if bits == 4 and _group_shift(group_size, 32) >= 0:
        return _LAYOUT_U4
    if bits == 8 and _group_shift(group_size, 16) >= 0:
        return _LAYOUT_U8
    return _LAYOUT_GENERIC


@njit(**_JIT)
def _dequant_generic(codes, scales, biases, bits, group_size, dst):
    # codes [words] u32 -> dst [in] float32 in natural element order
    per_word = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    for i in range(dst.shape[0]):
        shift = np.uint32((i % per_word) * bits)
        q = (codes[i // per_word] >> shift) & mask
        g = i // group_size
        dst[i] = fma32(_F32(q), scales[g], biases[g])


@njit(**_JIT)
def _permute_u4(x):
    # x [rows, in] -> per 32-element block: the 16 even elements, then the 16 odd ones
    xp = np.empty_like(x)
    for r in range(x.shape[0]):
        for base in range(0, x.shape[1], 32):
            for j in range(16):
                xp[r, base + j] = x[r, base + 2 * j]
                xp[r, base + 16 + j] = x[r, base + 2 * j + 1]
    return xp


@njit(**_JIT)
def _dot_block(x, w_block, first_feature, num_features, out):
    # out[r, first_feature + j] = x[r] . w_block[j] for every row
    for r in range(x.shape[0]):
        x_row = x[r]
        for j in range(num_features):
            out[r, first_feature + j] = _dot(w_block[j], x_row)


@njit(**_JIT)
def _features_per_block(in_features):
    return max(1, min(16, _FEATURE_BLOCK_FLOATS // max(1, in_features)))


@njit(**_JIT)
def _fused_tile(codes, scales, biases, layout, group_shift, xp, row0, num_rows, first, last, out,
                out_offset):
    # out[row0:row0 + num_rows, out_offset + first:out_offset + last] (num_rows 4 or 1: the
    # same per-row arithmetic)
    if num_rows == 4:
        if layout == _LAYOUT_U4:
            dot_u4_rows4(codes, scales, biases, group_shift, xp, row0, out, first, last, out_offset)
        else:
            dot_u8_rows4(codes, scales, biases, group_shift, xp, row0, out, first, last, out_offset)
    elif layout == _LAYOUT_U4:
        dot_u4_rows1(codes, scales, biases, group_shift, xp, row0, out, first, last, out_offset)
    else:
        dot_u8_rows1(codes, scales, biases, group_shift, xp, row0, out, first, last, out_offset)


@njit(**_JIT)
def _matmul_fused_chunk(xp, codes, scales, biases, layout, group_size, first, last, out,
                        out_offset):
    # Output features [first, last) (columns out_offset + o of out) in tiles of 16 features
    # x 4 rows, so that both the tile's codes and the 4 rows of x stay in L1 while reused.
    group_shift = _group_shift(group_size, 32 if layout == _LAYOUT_U4 else 16)
    rows = xp.shape[0]
    for o0 in range(first, last, 16):
        o1 = min(o0 + 16, last)
        for r in range(0, rows - rows % 4, 4):
            _fused_tile(codes, scales, biases, layout, group_shift, xp, r, 4, o0, o1, out, out_offset)
        for r in range(rows - rows % 4, rows):
            _fused_tile(codes, scales, biases, layout, group_shift, xp, r, 1, o0, o1, out, out_offset)


@njit(**_JIT)
def _matmul_generic_chunk(x, codes, scales, biases, bits, group_size, first, last, out):
    # Dequantize a few weight rows into an L1-sized buffer, then dot them with every row.
    per_block = _features_per_block(x.shape[1])
    w_block = np.empty((per_block, x.shape[1]), _F32)
    for o0 in range(first, last, per_block):
        count = min(per_block, last - o0)
        for j in range(count):
            o = o0 + j
            _dequant_generic(codes[o], scales[o], biases[o], bits, group_size, w_block[j])
        _dot_block(x, w_block, o0, count, out)


@njit(**_JIT)
def _affine_chunk(chunk, num_chunks, x, xp, codes, scales, biases, bits, group_size, layout, out):
    first, last = _chunk(chunk, num_chunks, codes.shape[0])
    if layout == _LAYOUT_GENERIC:
        _matmul_generic_chunk(x, codes, scales, biases, bits, group_size, first, last, out)
    else:
        _matmul_fused_chunk(xp, codes, scales, biases, layout, group_size, first, last, out, 0)


@njit(**_JIT, parallel=True)
def _affine_parallel(x, xp, codes, scales, biases, bits, group_size, layout, out):
    num_chunks = _num_chunks(codes.shape[0])
    for chunk in prange(num_chunks):
        _affine_chunk(chunk, num_chunks, x, xp, codes, scales, biases, bits, group_size, layout,
                      out)


@njit(**_JIT)
def matmul_affine(x, codes, scales, biases, bits, group_size, out):
    """out = x @ dequant(codes, scales, biases).T. x [rows, in], codes [out_f, in*bits/32] u32,
    scales/biases [out_f, in/group_size]. Each weight row is dequantized in registers once
    per group of 4 rows; features are split across threads when the call is big enough
    (the per-row arithmetic is the same either way)."""
    rows, in_features = x.shape
    out_features = codes.shape[0]
    if rows == 0 or out_features == 0:
        return
    layout = _affine_layout(bits, group_size)
    xp = _permute_u4(x) if layout == _LAYOUT_U4 else x
    if rows * out_features * in_features >= _PARALLEL_MIN_WORK:
        _affine_parallel(x, xp, codes, scales, biases, bits, group_size, layout, out)
    else:
        _affine_chunk(0, 1, x, xp, codes, scales, biases, bits, group_size, layout, out)


@njit(**_JIT)
def _parts_chunk(chunk, num_chunks, xp, codes, scales, biases, layout, group_size, offsets, out):
    # Columns [first, last) of the parts side by side: each part's share of them.
    first, last = _chunk(chunk, num_chunks, offsets[-1])
    for p in range(len(codes)):
        lo, hi = max(first, offsets[p]), min(last, offsets[p + 1])
        if lo < hi:
            _matmul_fused_chunk(xp, codes[p], scales[p], biases[p], layout, group_size,
                                lo - offsets[p], hi - offsets[p], out, offsets[p])


@njit(**_JIT, parallel=True)
def _parts_parallel(xp, codes, scales, biases, layout, group_size, offsets, out):
    num_chunks = _num_chunks(offsets[-1])
    for chunk in prange(num_chunks):
        _parts_chunk(chunk, num_chunks, xp, codes, scales, biases, layout, group_size, offsets,
                     out)


@njit(**_JIT)
def matmul_affine_parts(x, codes, scales, biases, bits, group_size, out):
    """out = x @ [w_0 | w_1 | ...].T for affine parts of one kind (q|k|v, gate|up): tuples of
    each part's codes, scales and biases; out [rows, sum of out_f]. One parallel region over
    the parts' features together, each feature with matmul_affine's arithmetic (the same
    bits as the parts one by one). Fast layouts only (`affine_parts_fit`)."""
    rows, in_features = x.shape
    offsets = np.zeros(len(codes) + 1, np.int64)
    for p in range(len(codes)):
        offsets[p + 1] = offsets[p] + codes[p].shape[0]
    if rows == 0 or offsets[-1] == 0:
        return
    layout = _affine_layout(bits, group_size)
    xp = _permute_u4(x) if layout == _LAYOUT_U4 else x
    if rows * offsets[-1] * in_features >= _PARALLEL_MIN_WORK:
        _parts_parallel(xp, codes, scales, biases, layout, group_size, offsets, out)
    else:
        _parts_chunk(0, 1, xp, codes, scales, biases, layout, group_size, offsets, out)


@njit(**_JIT)
def affine_parts_fit(bits, group_size):
    """Whether matmul_affine_parts takes weights of these bits and group size."""
    return _affine_layout(bits, group_size) != _LAYOUT_GENERIC


# ------------------------------------------------------- matmul on int8 activations
# The CPU twin of cuda_kernels/qdot.py (its docstring defines the numerics), in the GPU's
# exact order: same bits. A reference for the GPU kernel's checks, not a fast path.
_INT8_CHUNK = 32


@njit(**_JIT)
def int8_x_position(q4_order, j):
    """Byte of element j of a chunk in a quantized row (cuda_kernels.qdot.x_position)."""
    if q4_order:
        return (j // 8) * 8 + (j % 2) * 4 + (j % 8) // 2
    return j


@njit(**_JIT)
def _int8_chunk_sum(xq_row, codes_row, bits, q4_order, c):
    # sum over chunk c of code(k) * xi(k): exact
    per_word = 32 // bits
    mask = (1 << bits) - 1
    isum = 0
    for j in range(_INT8_CHUNK):
        k = c * _INT8_CHUNK + j
        q = (np.int64(codes_row[k // per_word]) >> (bits * (k % per_word))) & mask
        isum += q * np.int64(xq_row[c * _INT8_CHUNK + int8_x_position(q4_order, j)])
    return isum


@njit(**_JIT)
def matmul_affine_int8x(xq, xs, codes, scales, biases, bits, group_size, out):
    """out [rows, out_f] = (x as quantize_rows_int8 left it) @ dequant(codes).T, with the GPU's
    reduction order: lane l of 32 takes chunks l, l + 32, ... (acc = fma(s * d, isum, acc);
    acc = fma(b, d * sum(xi), acc)), then the butterfly over lanes (16, 8, 4, 2, 1)."""
    chunks = xq.shape[1] // _INT8_CHUNK
    group_chunks = group_size // _INT8_CHUNK
    lanes = np.empty(32, _F32)
    for r in range(xq.shape[0]):
        for o in range(codes.shape[0]):
            for lane in range(32):
                acc = _F32(0.0)
                for c in range(lane, chunks, 32):
                    isum = _int8_chunk_sum(xq[r], codes[o], bits, bits == 4, c)
                    g = c // group_chunks
                    acc = fma32(scales[o, g] * xs[r, 2 * c], _F32(isum), acc)
                    acc = fma32(biases[o, g], xs[r, 2 * c + 1], acc)
                lanes[lane] = acc
            offset = 16
            while offset > 0:
                lanes = lanes + lanes[np.arange(32) ^ offset]
                offset //= 2
            out[r, o] = lanes[0]


@njit(**_JIT)
def _dense_chunk(chunk, num_chunks, x, w, out):
    per_block = _features_per_block(w.shape[1])
    first, last = _chunk(chunk, num_chunks, w.shape[0])
    for o0 in range(first, last, per_block):
        count = min(per_block, last - o0)
        _dot_block(x, w[o0:o0 + count], o0, count, out)


@njit(**_JIT, parallel=True)
def _dense_parallel(x, w, out):
    num_chunks = _num_chunks(w.shape[0])
    for chunk in prange(num_chunks):
        _dense_chunk(chunk, num_chunks, x, w, out)


@njit(**_JIT)
def matmul_dense(x, w, out):
    """out = x @ w.T. x [rows, in], w [out_f, in] float32."""
    if x.shape[0] == 0 or w.shape[0] == 0:
        return
    if x.shape[0] * w.shape[0] * w.shape[1] >= _PARALLEL_MIN_WORK:
        _dense_parallel(x, w, out)
    else:
        _dense_chunk(0, 1, x, w, out)


@njit(**_JIT)
def embed_dense(w, ids, out):
    """out[r] = w[ids[r]]. w [V, H], ids [rows] int64."""
    for r in range(ids.shape[0]):
        out[r, :] = w[ids[r], :]


@njit(**_JIT)
def embed_affine(codes, scales, biases, bits, group_size, ids, out):
    """out[r] = dequantized row ids[r] (natural element order)."""
    for r in range(ids.shape[0]):
        v = ids[r]
        _dequant_generic(codes[v], scales[v], biases[v], bits, group_size, out[r])


# ----------------------------------------------------------------------------- row-wise ops
@njit(**_JIT)
def rms_norm(x, w, eps, out):
    """out = x * rsqrt(mean(x^2) + eps) * w over the last axis. x [rows, dim], w [dim]."""
    dim = x.shape[1]
    eps32 = _F32(eps)
    for r in range(x.shape[0]):
        mean_square = _sum_squares(x[r]) / _F32(dim)
        inv = _F32(1.0) / np.sqrt(mean_square + eps32)
        for i in range(dim):
            out[r, i] = (x[r, i] * inv) * w[i]


@njit(**_JIT)
def rope(x, positions, inv_freq, mscale):
    """Rotate-half RoPE in place on the first 2*len(inv_freq) dims of each head.
    x [rows, heads, hd], positions [rows] int64, inv_freq [rot/2] float32. The angle
    pos * inv_freq is formed in float64; cos and sin are rounded to float32, times mscale."""
    half = inv_freq.shape[0]
    cos = np.empty(half, _F32)
    sin = np.empty(half, _F32)
    m = _F32(mscale)
    for r in range(x.shape[0]):
        pos = np.float64(positions[r])
        for i in range(half):
            angle = pos * np.float64(inv_freq[i])
            cos[i] = _F32(np.cos(angle)) * m
            sin[i] = _F32(np.sin(angle)) * m
        for h in range(x.shape[1]):
            for i in range(half):
                a = x[r, h, i]
                b = x[r, h, i + half]
                x[r, h, i] = a * cos[i] - b * sin[i]
                x[r, h, i + half] = b * cos[i] + a * sin[i]


@njit(**_JIT)
def silu_mul(gate, up, out):
    """out = silu(gate) * up. All [rows, I] float32."""
    for r in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[r, i]
            out[r, i] = g / (_F32(1.0) + _exp32(-g)) * up[r, i]


@njit(**_JIT)
def silu_mul_halves(gate_up, out):
    """out = silu(gate) * up with gate|up side by side: gate_up [rows, 2 I] (C order), out
    [rows, I]; silu_mul's bits. Slices of gate_up handed to silu_mul are typed with any
    strides, which keeps its loop from vectorising (14x slower on a 128-row prompt)."""
    width = out.shape[1]
    for r in range(gate_up.shape[0]):
        for i in range(width):
            g = gate_up[r, i]
            out[r, i] = g / (_F32(1.0) + _exp32(-g)) * gate_up[r, width + i]


@njit(**_JIT)
def attn_inputs(qkv, q_norm, k_norm, eps, positions, inv_freq, mscale, kv_layer, slots,
                k_scale, v_scale, q):
    """A fused layer's attention inputs in one call, with the bits of the basic ops: q|k|v
    rows [rows, (nh + 2 nkv) hd] split, q and k RMS-normed per head when q_norm/k_norm are
    given, RoPE on both (`rope`), k and v stored at `slots` (`kv_write`); q [rows, nh, hd] is
    the output."""
    rows, num_heads, head_dim = q.shape
    nkv = kv_layer.shape[2]
    k = np.empty((rows, nkv, head_dim), _F32)
    v = np.empty((rows, nkv, head_dim), _F32)
    q_width, k_width = num_heads * head_dim, nkv * head_dim
    for r in range(rows):
        for i in range(q_width):
            q[r, i // head_dim, i % head_dim] = qkv[r, i]
        for i in range(k_width):
            k[r, i // head_dim, i % head_dim] = qkv[r, q_width + i]
            v[r, i // head_dim, i % head_dim] = qkv[r, q_width + k_width + i]
    if q_norm is not None and k_norm is not None:
        q_rows, k_rows = q.reshape(rows * num_heads, head_dim), k.reshape(rows * nkv, head_dim)
        rms_norm(q_rows, q_norm, eps, q_rows)
        rms_norm(k_rows, k_norm, eps, k_rows)
    rope(q, positions, inv_freq, mscale)
    rope(k, positions, inv_freq, mscale)
    kv_write(k, v, kv_layer, slots, k_scale, v_scale)


# ----------------------------------------------------------------------------- KV cache
@njit(**_JIT)
def kv_write(k, v, kv_layer, slots, k_scale, v_scale):
    """Convert and store rows: kv_layer [2, num_slots, nkv, hd] (f32 / bf16 bits / e4m3),
    k, v [rows, nkv, hd] float32, slots [rows] int64. fp8 stores e4m3(x / scale)."""
    scales = (_F32(k_scale), _F32(v_scale))
    for r in range(k.shape[0]):
        slot = slots[r]
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                kv_layer[0, slot, h, d] = _kv_store(kv_layer, k[r, h, d], scales[0])
                kv_layer[1, slot, h, d] = _kv_store(kv_layer, v[r, h, d], scales[1])


@njit(**_JIT)
def zero_pages(kv, page_ids, page_size):
    """Zero the K and V slots of `page_ids` in every layer. kv: the whole arena."""
    for layer in range(kv.shape[0]):
        for kind in range(2):
            for p in range(page_ids.shape[0]):
                first = np.int64(page_ids[p]) * page_size
                kv[layer, kind, first:first + page_size] = 0


@njit(**_JIT, fastmath=True)
def _key_scores(q_row, kv_layer, k_scale, pages, num_keys, page_size, kv_head, sm_scale,
                scores):
    # scores[j] = q . K[j] * sm_scale for positions j < num_keys; pages: the stream's table row.
    # fastmath lets the dot vectorise; its lane order depends on head_dim alone.
    for first in range(0, num_keys, page_size):
        base = np.int64(pages[first // page_size]) * page_size
        for i in range(min(page_size, num_keys - first)):
            acc = _F32(0.0)
            for d in range(q_row.shape[0]):
                acc += q_row[d] * _kv_load(kv_layer[0, base + i, kv_head, d], k_scale)
            scores[first + i] = acc * sm_scale


@njit(**_JIT)
def _weighted_values(probs, kv_layer, v_scale, pages, num_keys, page_size, kv_head, acc):
    # acc [hd] = sum_j probs[j] * V[j], adding one key at a time in ascending position
    acc[:] = 0
    for first in range(0, num_keys, page_size):
        base = np.int64(pages[first // page_size]) * page_size
        for i in range(min(page_size, num_keys - first)):
            p = probs[first + i]
            for d in range(acc.shape[0]):
                acc[d] += p * _kv_load(kv_layer[1, base + i, kv_head, d], v_scale)


@njit(**_JIT)
def _softmax_in_place(scores, num_keys):
    # scores[:num_keys] -> exp(s - max); returns their sum
    peak = scores[0]
    for j in range(1, num_keys):
        peak = max(peak, scores[j])
    for j in range(num_keys):
        scores[j] = _exp32(scores[j] - peak)
    return _sum(scores[:num_keys])


@njit(**_JIT)
def _attend_one(q_row, kv_layer, scales, pages, pos, page_size, sm_scale, kv_head, scores,
                acc, out_row):
    # One (row, head): causal attention over positions 0..pos of the stream owning `pages`.
    num_keys = pos + 1
    _key_scores(q_row, kv_layer, scales[0], pages, num_keys, page_size, kv_head, sm_scale, scores)
    total = _softmax_in_place(scores, num_keys)
    _weighted_values(scores, kv_layer, scales[1], pages, num_keys, page_size, kv_head, acc)
    for d in range(acc.shape[0]):
        out_row[d] = acc[d] / total


@njit(**_JIT)
def _rows_chunk(chunk, num_chunks, q, kv_layer, scales, block_table, row_seq, row_pos,
                     page_size, sm_scale, out):
    rows, num_heads, head_dim = q.shape
    group = num_heads // kv_layer.shape[2]
    scores = np.empty(np.int64(row_pos.max()) + 1, _F32)
    acc = np.empty(head_dim, _F32)
    first, last = _chunk(chunk, num_chunks, rows * num_heads)
    for item in range(first, last):
        r, h = item // num_heads, item % num_heads
        _attend_one(q[r, h], kv_layer, scales, block_table[row_seq[r]], row_pos[r], page_size,
                    sm_scale, h // group, scores, acc, out[r, h])


@njit(**_JIT, parallel=True)
def _rows_parallel(q, kv_layer, scales, block_table, row_seq, row_pos, page_size, sm_scale,
                        out):
    num_chunks = _num_chunks(q.shape[0] * q.shape[1])
    for chunk in prange(num_chunks):
        _rows_chunk(chunk, num_chunks, q, kv_layer, scales, block_table, row_seq, row_pos,
                         page_size, sm_scale, out)


@njit(**_JIT)
def paged_attention_rows(q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos,
                         page_size, sm_scale, out):
    """The session-11 kernel, kept for benchmarks/bench_cpu_attention.py: paged_attention's
    arguments, each (row, head) alone (a fastmath dot over head_dim per key, K and V converted
    per (row, head)). Batch-invariant too, with other bits than paged_attention."""
    rows, num_heads, head_dim = q.shape
    if rows == 0:
        return
    scales = (_F32(k_scale), _F32(v_scale))
    work = rows * num_heads * head_dim * (np.int64(row_pos.max()) + 1)
    if work >= _PARALLEL_MIN_WORK:
        _rows_parallel(q, kv_layer, scales, block_table, row_seq, row_pos, page_size,
                            _F32(sm_scale), out)
    else:
        _rows_chunk(0, 1, q, kv_layer, scales, block_table, row_seq, row_pos, page_size,
                         _F32(sm_scale), out)


@njit(**_JIT)
def _row_blocks(row_seq):
    # [blocks + 1] starts: runs of consecutive rows of one stream, at most _ROW_BLOCK rows each
    starts = np.empty(row_seq.shape[0] + 1, np.int64)
    count = 0
    for r in range(row_seq.shape[0]):
        if r == 0 or row_seq[r] != row_seq[r - 1] or r - starts[count - 1] == _ROW_BLOCK:
            starts[count] = r
            count += 1
    starts[count] = row_seq.shape[0]
    return starts[:count + 1]


@njit(**_JIT)
def _load_tile(kv_layer, kind, scale, pages, first, num_keys, page_size, kv_head, tile):
    # tile[i] = float32 K (kind 0) or V (kind 1) of position first + i, i < num_keys: each
    # stored element is converted once per (row block, kv head).
    page, offset = first // page_size, first % page_size  # of the next key (no division a key)
    for i in range(num_keys):
        _load_row(kv_layer, kind, np.int64(pages[page]) * page_size + offset, kv_head, scale, tile, i)
        offset += 1
        if offset == page_size:
            page, offset = page + 1, 0


def _load_row(kv_layer, kind, slot, kv_head, scale, tile, i):
    """tile[i] = float32 of the stored row kv_layer[kind, slot, kv_head] (dispatch on dtype)."""


@overload(_load_row, jit_options={"nogil": True, "error_model": "numpy"})
def _load_row_impl(kv_layer, kind, slot, kv_head, scale, tile, i):
    if kv_layer.dtype == types.uint16 and kv_layer.layout == "C":
        return lambda kv_layer, kind, slot, kv_head, scale, tile, i: bf16_row_to_f32(
            kv_layer, kind, slot, kv_head, tile, i)

    def convert(kv_layer, kind, slot, kv_head, scale, tile, i):
        src = kv_layer[kind, slot, kv_head]
        for d in range(tile.shape[1]):
            tile[i, d] = _kv_load(src[d], scale)

    return convert


@njit(**_JIT)
def _load_keys_t(kv_layer, k_scale, pages, first, num_keys, page_size, kv_head, rows, keys_t):
    # keys_t [hd, keys] = K of positions first.. : f32 / bf16 8 keys at a time straight into
    # place (keys_t8); else converted row-major into rows [keys, hd], then moved by 8x8 shuffle
    # blocks (scalar copies for the tails)
    head_dim = keys_t.shape[0]
    done = 0
    if _direct_keys_t(kv_layer) and head_dim % 8 == 0:
        slots = np.empty(8, np.int64)
        done = num_keys - num_keys % 8
        page, offset = first // page_size, first % page_size  # of the next key (no division a key)
        for j0 in range(0, done, 8):
            for k in range(8):
                slots[k] = np.int64(pages[page]) * page_size + offset
                offset += 1
                if offset == page_size:
                    page, offset = page + 1, 0
            _keys_t8(kv_layer, slots, kv_head, keys_t, j0)
        if done == num_keys:
            return
    _load_tile(kv_layer, 0, k_scale, pages, first + done, num_keys - done, page_size, kv_head, rows)
    rest = num_keys - done
    full_keys, full_dims = rest - rest % 8, head_dim - head_dim % 8
    for i in range(0, full_keys, 8):
        for d in range(0, full_dims, 8):
            transpose8(rows, i * head_dim + d, keys_t, d * keys_t.shape[1] + done + i)
    for i in range(full_keys, rest):
        for d in range(head_dim):
            keys_t[d, done + i] = rows[i, d]
    for d in range(full_dims, head_dim):
        for i in range(full_keys):
            keys_t[d, done + i] = rows[i, d]


def _direct_keys_t(kv_layer):
    """Whether keys_t8 takes this KV layer (f32 or bf16 bits, C layout)."""


def _keys_t8(kv_layer, slots, kv_head, keys_t, j0):
    """keys_t8 of K where _direct_keys_t, else nothing (a branch never taken)."""


def _takes_keys_t8(kv_layer):
    return (kv_layer.dtype in (types.uint16, types.float32) and kv_layer.layout == "C"
            and kv_layer.ndim == 4)


@overload(_keys_t8, jit_options={"nogil": True, "error_model": "numpy"})
def _keys_t8_impl(kv_layer, slots, kv_head, keys_t, j0):
    if _takes_keys_t8(kv_layer):
        return lambda kv_layer, slots, kv_head, keys_t, j0: keys_t8(kv_layer, 0, slots, kv_head,
                                                                    keys_t, j0)
    return lambda kv_layer, slots, kv_head, keys_t, j0: None


@overload(_direct_keys_t, jit_options={"nogil": True, "error_model": "numpy"})
def _direct_keys_t_impl(kv_layer):
    takes = _takes_keys_t8(kv_layer)
    return lambda kv_layer: takes


@njit(**_JIT)
def _block_scores(q, kv_layer, k_scale, pages, rows, heads, max_keys, page_size, sm_scale,
                  scratch):
    # scores[v, :max_keys] for v = (row - rows[0]) * group + (head - heads[0]): the block's
    # query vectors gathered in qs, up to MAX_GROUP of them sharing each key load
    keys_t, rows_tile, scores, qs, ids = scratch[0], scratch[1], scratch[2], scratch[5], scratch[8]
    group = heads[1] - heads[0]
    num_vectors = (rows[1] - rows[0]) * group
    for v in range(num_vectors):
        qs[v] = q[rows[0] + v // group, heads[0] + v % group]
    for first in range(0, max_keys, _KEY_TILE):
        num_keys = min(_KEY_TILE, max_keys - first)
        ahead = max(first + _KEY_TILE, _PREFETCH_KEYS)  # _attend_block asked for the first
        _prefetch_span(kv_layer, 0, pages, min(ahead, max_keys),
                       min(ahead + _KEY_TILE, max_keys), page_size, heads[0] // group)
        _load_keys_t(kv_layer, k_scale, pages, first, num_keys, page_size, heads[0] // group,
                     rows_tile, keys_t)
        for v0 in range(0, num_vectors, MAX_GROUP):
            count = min(MAX_GROUP, num_vectors - v0)
            for i in range(count):
                ids[i] = v0 + i
            scores_group(qs, ids, count, keys_t, num_keys, sm_scale, scores, first)


@njit(**_JIT)
def _values_span(src, kind, slots, slot_base, kv_head, lo, hi, row_pos, rows, group, scratch):
    # acc[v] += probs[v, j] * V[j] for the keys j in [lo, hi) of vector v's causal range, j
    # ascending; up to MAX_GROUP vectors share each value load, over the keys they have in common
    probs, acc, ids, limits = scratch[2], scratch[3], scratch[8], scratch[9]
    num_vectors = (rows[1] - rows[0]) * group
    for v0 in range(0, num_vectors, MAX_GROUP):
        count = min(MAX_GROUP, num_vectors - v0)
        for i in range(count):
            limits[i] = min(hi, max(lo, row_pos[rows[0] + (v0 + i) // group] + 1))
        start = lo
        while True:
            active, end = 0, hi
            for i in range(count):
                if limits[i] > start:
                    ids[active] = v0 + i
                    active += 1
                    end = min(end, limits[i])
            if active == 0:
                break
            values_group(probs, ids, active, src, kind, slots, slot_base, kv_head, start, end, acc)
            start = end


def _values_in_place(kv_layer, slots, kv_head, max_keys, row_pos, rows, group, scratch):
    """_values_span over every key, V read in place, where _direct_keys_t (else nothing: a
    branch never taken, and never typed with a KV dtype values_group does not read)."""


@overload(_values_in_place, jit_options={"nogil": True, "error_model": "numpy"})
def _values_in_place_impl(kv_layer, slots, kv_head, max_keys, row_pos, rows, group, scratch):
    if _takes_keys_t8(kv_layer):
        def impl(kv_layer, slots, kv_head, max_keys, row_pos, rows, group, scratch):
            # stretches of keys, each asking for the V rows of the one after next; a vector's
            # keys still go in ascending order through its one acc (the same bits)
            for lo in range(0, max_keys, _VALUE_STRETCH):
                ahead = max(lo + 2 * _VALUE_STRETCH, _PREFETCH_KEYS)
                for j in range(min(ahead, max_keys), min(ahead + _VALUE_STRETCH, max_keys)):
                    prefetch_row(kv_layer[1, slots[j], kv_head])
                _values_span(kv_layer, 1, slots, 0, kv_head, lo, min(lo + _VALUE_STRETCH, max_keys),
                             row_pos, rows, group, scratch)
        return impl
    return lambda kv_layer, slots, kv_head, max_keys, row_pos, rows, group, scratch: None


@njit(**_JIT)
def _block_values(kv_layer, v_scale, pages, row_pos, rows, group, kv_head, max_keys, page_size,
                  scratch):
    # acc[v] = sum_j probs[v, j] * V[j] over the causal keys of vector v's row, j ascending:
    # f32 / bf16 values read in place from the KV pages; other dtypes converted a tile at a time
    values, acc, slots, tile_slots = scratch[1], scratch[3], scratch[6], scratch[7]
    acc[:] = 0
    if _direct_keys_t(kv_layer):
        page, offset = 0, 0
        for j in range(max_keys):
            slots[j] = np.int64(pages[page]) * page_size + offset
            offset += 1
            if offset == page_size:
                page, offset = page + 1, 0
        _values_in_place(kv_layer, slots, kv_head, max_keys, row_pos, rows, group, scratch)
        return
    tile = values.reshape((1, values.shape[0], 1, values.shape[1]))
    for first in range(0, max_keys, _VALUE_TILE):
        num_keys = min(_VALUE_TILE, max_keys - first)
        _load_tile(kv_layer, 1, v_scale, pages, first, num_keys, page_size, kv_head, values)
        _values_span(tile, 0, tile_slots, first, 0, first, first + num_keys, row_pos, rows,
                     group, scratch)


@njit(**_JIT)
def _prefetch_span(kv_layer, kind, pages, lo, hi, page_size, kv_head):
    # the K (kind 0) or V (1) rows of positions [lo, hi) asked for: the next stretch of keys
    # streams in while this one is computed on (a layer's KV comes from memory: the hardware
    # prefetcher alone kept one thread's attention at ~5 GB/s on a head's rows, 768 B apart)
    page, offset = lo // page_size, lo % page_size
    for _ in range(lo, hi):
        prefetch_row(kv_layer[kind, np.int64(pages[page]) * page_size + offset, kv_head])
        offset += 1
        if offset == page_size:
            page, offset = page + 1, 0


@njit(**_JIT)
def _attend_block(q, kv_layer, scales, pages, row_pos, rows, heads, page_size, sm_scale,
                  scratch, out):
    # Rows rows[0]..rows[1]-1 of one stream x the query heads heads[0]..heads[1]-1 of one kv
    # head: whole-row scores, softmax over 0..pos, weighted values; K (and fp8 V) converted
    # per tile.
    scores, acc, totals = scratch[2], scratch[3], scratch[4]
    group = heads[1] - heads[0]
    max_keys = np.int64(row_pos[rows[0]:rows[1]].max()) + 1
    # the K and V rows of the first _PREFETCH_KEYS keys asked for at once: they come from
    # memory (a layer's weights went through the caches since) in parallel, not one dependent
    # miss after another; the tiles and stretches ask for the rest ahead of use
    for kind in range(2):
        _prefetch_span(kv_layer, kind, pages, 0, min(max_keys, _PREFETCH_KEYS), page_size,
                       heads[0] // group)
    _block_scores(q, kv_layer, scales[0], pages, rows, heads, max_keys, page_size, sm_scale,
                  scratch)
    for vector in range((rows[1] - rows[0]) * group):
        totals[vector] = _softmax_in_place(scores[vector], row_pos[rows[0] + vector // group] + 1)
    _block_values(kv_layer, scales[1], pages, row_pos, rows, group, heads[0] // group, max_keys,
                  page_size, scratch)
    for vector in range((rows[1] - rows[0]) * group):
        r, h = rows[0] + vector // group, heads[0] + vector % group
        for d in range(acc.shape[1]):
            out[r, h, d] = acc[vector, d] / totals[vector]


@njit(**_JIT)
def _blocks_chunk(chunk, num_chunks, q, kv_layer, scales, block_table, row_seq, row_pos,
                  starts, page_size, sm_scale, out):
    # items: (row block, kv head), block-major; the chunk's scratch is allocated once
    head_dim, num_kv_heads = q.shape[2], kv_layer.shape[2]
    group = q.shape[1] // num_kv_heads
    vectors = np.int64((starts[1:] - starts[:-1]).max()) * group
    max_keys = np.int64(row_pos.max()) + 1
    # keys_t, a row-major tile [_KEY_TILE, hd] (K before its transpose; fp8 V), scores, acc,
    # totals, the block's query vectors, the keys' slots, a tile's row numbers, a group's
    # vector ids and their key limits (_values_span)
    scratch = (np.empty((head_dim, _KEY_TILE), _F32), np.empty((_KEY_TILE, head_dim), _F32),
               np.empty((vectors, max_keys), _F32), np.empty((vectors, head_dim), _F32),
               np.empty(vectors, _F32), np.empty((vectors, head_dim), _F32),
               np.empty(max_keys, np.int64), np.arange(_KEY_TILE), np.empty(MAX_GROUP, np.int64),
               np.empty(MAX_GROUP, np.int64))
    # strided items: later (longer) blocks of a causal prompt spread over every chunk
    for item in range(chunk, (starts.shape[0] - 1) * num_kv_heads, num_chunks):
        block, kv_head = item // num_kv_heads, item % num_kv_heads
        rows = (starts[block], starts[block + 1])
        _attend_block(q, kv_layer, scales, block_table[row_seq[rows[0]]], row_pos, rows,
                      (kv_head * group, (kv_head + 1) * group), page_size, sm_scale, scratch,
                      out)


@njit(**_JIT, parallel=True)
def _blocks_parallel(q, kv_layer, scales, block_table, row_seq, row_pos, starts, page_size,
                     sm_scale, out):
    num_chunks = _num_chunks((starts.shape[0] - 1) * kv_layer.shape[2])
    for chunk in prange(num_chunks):
        _blocks_chunk(chunk, num_chunks, q, kv_layer, scales, block_table, row_seq, row_pos,
                      starts, page_size, sm_scale, out)


@njit(**_JIT)
def paged_attention(q, kv_layer, k_scale, v_scale, block_table, row_seq, row_pos, page_size,
                    sm_scale, out):
    """Causal GQA over paged KV. q/out [rows, nh, hd] float32; kv_layer [2, num_slots, nkv, hd];
    block_table [seqs, max_pages] int32; row_seq [rows] int32; row_pos [rows] int64.
    Row r attends positions 0..row_pos[r] of stream row_seq[r]; kv head = h // (nh // nkv).
    Work items are (block of up to _ROW_BLOCK consecutive rows of one stream, kv head): K and
    V tiles are converted to float32 once per item and shared by its rows and query heads; a
    decode row is a block of one. A (row, head)'s arithmetic is fixed by its q, keys and pos
    alone, whatever the blocks, chunks and threads (batch-invariant):

        score_j = fma(q[hd-1], K[j,hd-1], ... fma(q[0], K[j,0], 0)) * sm_scale
        p_j = exp(score_j - max), total = _sum(p), acc = fma(p_j, V[j], acc) for j ascending,
        out = acc / total
    """
    rows = q.shape[0]
    if rows == 0:
        return
    scales = (_F32(k_scale), _F32(v_scale))
    starts = _row_blocks(row_seq)
    work = rows * q.shape[1] * q.shape[2] * (np.int64(row_pos.max()) + 1)
    if work >= _PARALLEL_MIN_WORK:
        _blocks_parallel(q, kv_layer, scales, block_table, row_seq, row_pos, starts, page_size,
                         _F32(sm_scale), out)
    else:
        _blocks_chunk(0, 1, q, kv_layer, scales, block_table, row_seq, row_pos, starts,
                      page_size, _F32(sm_scale), out)


# ----------------------------------------------------------------------------- MoE routing
@njit(**_JIT)
def _softmax_row(logits, probs):
    peak = logits[0]
    for e in range(1, logits.shape[0]):
        peak = max(peak, logits[e])
    total = _F32(0.0)
    for e in range(logits.shape[0]):
        probs[e] = np.exp(logits[e] - peak)
        total += probs[e]
    for e in range(logits.shape[0]):
        probs[e] = probs[e] / total


@njit(**_JIT)
def _take_best(probs, taken):
    # highest untaken probability; ties go to the lower expert id
    best = -1
    for e in range(probs.shape[0]):
        if not taken[e] and (best < 0 or probs[e] > probs[best]):
            best = e
    taken[best] = True
    return best


@njit(**_JIT)
def moe_route(logits, top_k, norm_topk_prob, out_ids, out_weights):
    """Softmax over all experts (float32), then top-k (descending weight, ties: lower id
    first), optionally renormalised to sum 1. logits [rows, E]; out_ids/out_weights [rows, k]."""
    num_experts = logits.shape[1]
    probs = np.empty(num_experts, _F32)
    taken = np.empty(num_experts, np.bool_)
    for r in range(logits.shape[0]):
        _softmax_row(logits[r], probs)
        taken[:] = False
        total = _F32(0.0)
        for j in range(top_k):
            best = _take_best(probs, taken)
            out_ids[r, j] = best
            out_weights[r, j] = probs[best]
            total += probs[best]
        if norm_topk_prob:
            for j in range(top_k):
                out_weights[r, j] = out_weights[r, j] / total


# ----------------------------------------------------------------------------- validation
@njit(**_JIT)
def any_out_of_range(values, low, high):
    """True when some value lies outside [low, high) (CpuOps' check of index arrays)."""
    for i in range(values.shape[0]):
        if values[i] < low or values[i] >= high:
            return True
    return False


@njit(**_JIT)
def first_bad_page_row(block_table, row_seq, row_pos, page_size, num_pages):
    """First row whose stream or pages (positions 0..row_pos) fall outside the block table or
    the arena; -1 when every row is valid. Used by CpuOps before paged_attention."""
    for r in range(row_seq.shape[0]):
        seq = np.int64(row_seq[r])
        pos = row_pos[r]
        if seq < 0 or seq >= block_table.shape[0] or pos < 0:
            return r
        if pos // page_size >= block_table.shape[1]:
            return r
        for p in range(pos // page_size + 1):
            page = block_table[seq, p]
            if page < 0 or page >= num_pages:
                return r
    return -1
