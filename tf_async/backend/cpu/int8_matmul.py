"""Affine matmuls on int8 x, fast (docs/KERNELS.md "CPU matmul on int8 x").

The numerics and order are kernels.matmul_affine_int8x's (the twin of cuda_kernels/qdot.py),
bit for bit: x is quantized per chunk of 32 to int8 with (d, d * sum(xi)); a chunk's integer
dot with the codes is exact; lane l of 32 takes chunks l, l + 32, ... with
acc = fma(s * d, isum, acc) then acc = fma(b, d * sum(xi), acc); a halving sum over the 32
lanes ends the feature. The speed comes from where the bits cannot move: the exact integer
dots run on byte SIMD (AVX2's maddubs / madd where the host has them, for 8-bit codes VNNI's
vpdpbusd where it has that too, plain LLVM vectors elsewhere: the same integers), and eight
chunks' float steps go as one 8-lane vector.

The x layout here is this file's own (the integers do not depend on which byte pairs with
which): per chunk of a 4-bit weight the even elements then the odd ones (a 16-byte code block
unpacks to its low nibbles then its high nibbles; two chunks' codes, 32 bytes, at once),
natural order for 8-bit (`_x_position`); xs [rows, 3C] holds the chunks' d, then their
d * sum(xi), then sum(xi).

Kept apart from kernels.py, with every jitted function that uses these intrinsics, because
Numba's cache notices edits only in the file of the cached function.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

_F32 = np.float32
_JIT: dict[str, Any] = {"nogil": True, "cache": True, "error_model": "numpy"}
CHUNK = 32  # elements of x that share one int8 scale
_FEATURE_TILE = 16  # features whose codes stay in L1 while 4-row tiles of x pass over them
_MAX_CHUNKS = 32  # parallel work items of a call (a fixed count: see kernels._num_chunks)
_PARALLEL_MIN_WORK = 1 << 17  # multiply-adds below which a call runs on the calling thread
# Weight rows a feature asks for ahead (software prefetch): a decode step streams ~115 MB of
# weights that no cache holds, and the hardware prefetcher alone kept a core at about half
# the bandwidth a plain read reaches (docs/PERFORMANCE.md, session 27). Only a hint: the
# arithmetic and its bits do not change.
PREFETCH_FEATURES = 8


def _host_has_avx2() -> bool:
    """Whether the byte-SIMD intrinsics may be emitted: an AVX2 host, compiled for the host,
    and TF_ASYNC_CPU_AVX2 not "0" (the tests' switch to the plain-LLVM twin; with its own
    NUMBA_CACHE_DIR, since the cache does not know this switch)."""
    if (
        getattr(config, "CPU_NAME", None) not in (None, "host")
        or os.environ.get("TF_ASYNC_CPU_AVX2") == "0"
    ):
        return False
    features = llvm_binding.get_host_cpu_features()
    return bool(features.get("avx2", False))


def _host_has_vnni() -> bool:
    """Whether `vpdpbusd` on 256-bit vectors may be emitted (8-bit codes' chunk dots in one
    instruction): AVX2 in use, an AVX-VNNI or AVX512-VNNI (with VL) host, and
    TF_ASYNC_CPU_VNNI not "0" (the tests' switch to AVX2's sign trick; own NUMBA_CACHE_DIR)."""
    if not AVX2 or os.environ.get("TF_ASYNC_CPU_VNNI") == "0":
        return False
    features = llvm_binding.get_host_cpu_features()
    return bool(features.get("avxvnni", False)
                or (features.get("avx512vnni", False) and features.get("avx512vl", False)))


AVX2 = _host_has_avx2()
VNNI = _host_has_vnni()

_I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (8, 16, 32, 64))
_F = ir.FloatType()
_V8I32, _V8F32 = ir.VectorType(_I32, 8), ir.VectorType(_F, 8)
_V8F16 = ir.VectorType(ir.HalfType(), 8)
_V16I8, _V32I8, _V16I16 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
_ACC = ir.ArrayType(_V8F32, 4)  # a row's 32 float lanes


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _fn(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _shuffle(b: ir.IRBuilder, x: ir.Value, y: ir.Value, picks: list[int]) -> ir.Value:
    return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(picks)), picks))


# ----------------------------------------------------------------------------- integer part
# Each helper has x86 semantics (AVX2 intrinsic) and a plain-LLVM twin; every use stays in
# the range where neither saturates nor wraps, so both give the same exact integers.
def _maddubs(b: ir.IRBuilder, codes: ir.Value, x: ir.Value) -> ir.Value:
    """v32 u8 codes . v32 i8 x -> v16 i16 sums of adjacent products (callers: |sum| < 2**15)."""
    if AVX2:
        return b.call(_fn(b, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8, _V32I8]), [codes, x])
    v32i16 = ir.VectorType(_I16, 32)
    products = b.mul(b.zext(codes, v32i16), b.sext(x, v32i16))
    return b.add(
        _shuffle(b, products, products, list(range(0, 32, 2))),
        _shuffle(b, products, products, list(range(1, 32, 2))),
    )


def _hadd16(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """phaddw: per 128-bit half, x's adjacent sums then y's (callers: no int16 wrap)."""
    if AVX2:
        return b.call(_fn(b, "llvm.x86.avx2.phadd.w", _V16I16, [_V16I16, _V16I16]), [x, y])
    even = [0, 2, 4, 6, 16, 18, 20, 22, 8, 10, 12, 14, 24, 26, 28, 30]
    return b.add(_shuffle(b, x, y, even), _shuffle(b, x, y, [i + 1 for i in even]))


def _madd_ones(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """v16 i16 -> v8 i32 sums of adjacent lanes (pmaddwd by ones)."""
    if AVX2:
        madd = _fn(b, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16])
        return b.call(madd, [v, ir.Constant(_V16I16, [1] * 16)])
    wide = b.sext(v, ir.VectorType(_I32, 16))
    return b.add(
        _shuffle(b, wide, wide, list(range(0, 16, 2))),
        _shuffle(b, wide, wide, list(range(1, 16, 2))),
    )


def _load(b: ir.IRBuilder, ptr: ir.Value, offset: ir.Value, vector: ir.VectorType) -> ir.Value:
    return b.load(b.bitcast(b.gep(ptr, [offset]), vector.as_pointer()), align=1)


def _lone_chunk_dot(b: ir.IRBuilder, codes: ir.Value, x: ir.Value, bits: int) -> ir.Value:
    """Eight int32 partial sums of one chunk: codes at `codes` (16 bytes of nibbles or 32
    bytes), x at `x` (4-bit: its 16 even elements then its 16 odd ones). 8-bit codes on AVX2
    without VNNI: the sums of (code - 128) * x, which _x_total completes."""
    xv = _load(b, x, _const(0), _V32I8)
    if bits == 4:
        q = _load(b, codes, _const(0), _V16I8)
        low = b.and_(q, ir.Constant(_V16I8, [15] * 16))
        high = b.lshr(q, ir.Constant(_V16I8, [4] * 16))
        return _madd_ones(b, _maddubs(b, _shuffle(b, low, high, list(range(32))), xv))
    q = _load(b, codes, _const(0), _V32I8)
    if VNNI:  # u8 codes . s8 x, 4 products a lane, summed in int32: exact, no saturation
        dpbusd = _fn(b, "llvm.x86.avx512.vpdpbusd.256", _V8I32, [_V8I32] * 3)
        zero = ir.Constant(_V8I32, [0] * 8)
        return b.call(dpbusd, [zero, b.bitcast(q, _V8I32), b.bitcast(xv, _V8I32)])
    if AVX2:  # codes - 128 as i8 w: maddubs(|w|, x * sign(w)), pairs <= 2 * 128 * 127
        w = b.xor(q, ir.Constant(_V32I8, [0x80] * 32))
        magnitude = b.call(
            _fn(b, "llvm.abs.v32i8", _V32I8, [_V32I8, ir.IntType(1)]),
            [w, ir.Constant(ir.IntType(1), 0)],
        )
        signed_x = b.call(_fn(b, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8, _V32I8]), [xv, w])
        return _madd_ones(b, _maddubs(b, magnitude, signed_x))  # + 128 * sum(x): _x_total
    v32 = ir.VectorType(_I32, 32)
    products = b.mul(b.zext(q, v32), b.sext(xv, v32))
    v16 = b.add(
        _shuffle(b, products, products, list(range(16))),
        _shuffle(b, products, products, list(range(16, 32))),
    )
    return b.add(_shuffle(b, v16, v16, list(range(8))), _shuffle(b, v16, v16, list(range(8, 16))))


def _pair_dot(b: ir.IRBuilder, low: ir.Value, high: ir.Value, x: ir.Value) -> ir.Value:
    """4-bit chunks 2p, 2p + 1: v16 i16, the low half 8 partial sums of chunk 2p (each of 4
    products, |.| <= 4 * 15 * 127), the high half chunk 2p + 1's. x at the pair's 64 bytes."""
    return b.add(
        _maddubs(b, low, _load(b, x, _const(0), _V32I8)),
        _maddubs(b, high, _load(b, x, _const(32), _V32I8)),
    )


def _sum8_u4(b: ir.IRBuilder, pairs: list[ir.Value]) -> ir.Value:
    """Four _pair_dot results (chunks c0 .. c0 + 7) -> v8 i32 of the chunks' sums, in order.
    Two phaddw levels keep 16 products a value (<= 30480: no wrap), madd widens the last pair."""
    h01, h23 = _hadd16(b, pairs[0], pairs[1]), _hadd16(b, pairs[2], pairs[3])
    sums = _madd_ones(b, _hadd16(b, h01, h23))  # chunks 0, 2, 4, 6, 1, 3, 5, 7
    return _shuffle(b, sums, sums, [0, 4, 1, 5, 2, 6, 3, 7])


def _sum8(b: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    """[sum(parts[0]), ..., sum(parts[7])] as one v8i32 (integer adds: exact in any order)."""
    stages = (
        ([0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]),
        ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]),
        ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]),
    )
    for even, odd in stages:
        parts = [
            b.add(
                _shuffle(b, parts[i], parts[i + 1], even), _shuffle(b, parts[i], parts[i + 1], odd)
            )
            for i in range(0, len(parts), 2)
        ]
    return parts[0]


def _hsum_i32(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Sum of the 8 lanes of a v8 i32."""
    total = b.extract_element(v, ir.Constant(_I32, 0))
    for lane in range(1, 8):
        total = b.add(total, b.extract_element(v, ir.Constant(_I32, lane)))
    return total


# ----------------------------------------------------------------------------- operands
class _Operands:
    """Pointers and sizes of dot_q8's arguments, unpacked from the Numba array structs."""

    def __init__(self, context, builder, sig, args):  # type: ignore[no-untyped-def]
        codes, scales, biases, group_shift, xq, xs, row0, out, first, last, out_offset = args
        b = builder
        arrays = [
            context.make_array(t)(context, b, a)
            for t, a in zip(sig.args[:3], (codes, scales, biases), strict=True)
        ]
        self.codes = b.bitcast(arrays[0].data, _I8.as_pointer())
        self.code_row_bytes = b.mul(cgutils.unpack_tuple(b, arrays[0].shape)[1], _const(4))
        # scales and biases as uint16 arrays: float16 bits (Numba has no float16 arrays)
        self.half = sig.args[1].dtype == types.uint16
        self.scales, self.biases = arrays[1].data, arrays[2].data
        if self.half:
            half_ptr = ir.HalfType().as_pointer()
            self.scales, self.biases = b.bitcast(self.scales, half_ptr), b.bitcast(self.biases, half_ptr)
        self.num_groups = cgutils.unpack_tuple(b, arrays[1].shape)[1]
        self.group_shift = context.cast(b, group_shift, sig.args[3], types.intp)
        x = context.make_array(sig.args[4])(context, b, xq)
        self.xq, self.in_features = x.data, cgutils.unpack_tuple(b, x.shape)[1]
        self.xs = context.make_array(sig.args[5])(context, b, xs).data
        self.chunks = b.udiv(self.in_features, _const(CHUNK))
        o = context.make_array(sig.args[7])(context, b, out)
        self.out, self.out_features = o.data, cgutils.unpack_tuple(b, o.shape)[1]
        self.row0 = context.cast(b, row0, sig.args[6], types.intp)
        self.first = context.cast(b, first, sig.args[8], types.intp)
        self.last = context.cast(b, last, sig.args[9], types.intp)
        self.out_offset = context.cast(b, out_offset, sig.args[10], types.intp)


class _Feature:
    """One weight row's pointers and the rows of x it meets."""

    def __init__(self, b: ir.IRBuilder, ops: _Operands, o: ir.Value, rows: int, bits: int):
        self.ops, self.bits = ops, bits
        self.codes = b.gep(ops.codes, [b.mul(o, ops.code_row_bytes)])
        group0 = b.mul(o, ops.num_groups)
        self.scales, self.biases = b.gep(ops.scales, [group0]), b.gep(ops.biases, [group0])
        self.x_rows = [
            b.gep(ops.xq, [b.mul(b.add(ops.row0, _const(k)), ops.in_features)]) for k in range(rows)
        ]
        thrice = b.mul(ops.chunks, _const(3))
        self.xs_rows = [
            b.gep(ops.xs, [b.mul(b.add(ops.row0, _const(k)), thrice)]) for k in range(rows)
        ]

    def codes_at(self, b: ir.IRBuilder, c: ir.Value) -> ir.Value:
        return b.gep(self.codes, [b.mul(c, _const(CHUNK * self.bits // 8))])

    def x_at(self, b: ir.IRBuilder, k: int, c: ir.Value) -> ir.Value:
        """Row k's bytes of chunk c (4-bit, c even: the pair c, c + 1's 64 bytes)."""
        return b.gep(self.x_rows[k], [b.mul(c, _const(CHUNK))])

    def scale_vectors(
        self, b: ir.IRBuilder, c0: ir.Value, contiguous: bool
    ) -> tuple[ir.Value, ir.Value]:
        half = self.ops.half
        if contiguous:  # a group per chunk: the 8 scales side by side
            return _load8(b, self.scales, c0, half), _load8(b, self.biases, c0, half)
        groups = [b.lshr(b.add(c0, _const(j)), self.ops.group_shift) for j in range(8)]
        return _lane_gather(b, self.scales, groups, half), _lane_gather(b, self.biases, groups, half)

    def scale_at(self, b: ir.IRBuilder, g: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Group g's scale and bias as f32 (from f16 exactly where stored so)."""
        return tuple(_widen(b, b.load(b.gep(p, [g])), self.ops.half)
                     for p in (self.scales, self.biases))  # type: ignore[return-value]


def _widen(b: ir.IRBuilder, v: ir.Value, half: bool) -> ir.Value:
    """f16 -> f32 (exact) where `half`, else v as it is."""
    if not half:
        return v
    return b.fpext(v, _V8F32 if isinstance(v.type, ir.VectorType) else _F)


def _lane_gather(b: ir.IRBuilder, base: ir.Value, indices: list[ir.Value],
                 half: bool = False) -> ir.Value:
    v = ir.Constant(_V8F32, ir.Undefined)
    for lane, index in enumerate(indices):
        value = _widen(b, b.load(b.gep(base, [index])), half)
        v = b.insert_element(v, value, ir.Constant(_I32, lane))
    return v


def _load8(b: ir.IRBuilder, base: ir.Value, index: ir.Value, half: bool = False) -> ir.Value:
    """base[index .. index + 7] as a v8 f32 (an f16 base: widened, exact)."""
    vector = _V8F16 if half else _V8F32
    loaded = b.load(b.bitcast(b.gep(base, [index]), vector.as_pointer()), align=2 if half else 4)
    return _widen(b, loaded, half)


# ----------------------------------------------------------------------------- float part
def _block_sums(b: ir.IRBuilder, f: _Feature, rows: int, c0: ir.Value) -> list[ir.Value]:
    """Each row's exact sums of chunks c0 .. c0 + 7 (c0 % 8 == 0) as a v8 i32."""
    chunk_ids = [b.add(c0, _const(j)) for j in range(8)]
    if f.bits == 8:
        return [
            _x_total(
                b,
                f,
                k,
                c0,
                _sum8(
                    b, [_lone_chunk_dot(b, f.codes_at(b, c), f.x_at(b, k, c), 8) for c in chunk_ids]
                ),
                8,
            )
            for k in range(rows)
        ]
    nibbles = [_nibbles(b, f, chunk_ids[2 * pair]) for pair in range(4)]
    return [
        _sum8_u4(
            b,
            [
                _pair_dot(b, low, high, f.x_at(b, k, chunk_ids[2 * pair]))
                for pair, (low, high) in enumerate(nibbles)
            ],
        )
        for k in range(rows)
    ]


def _nibbles(b: ir.IRBuilder, f: _Feature, c: ir.Value) -> tuple[ir.Value, ir.Value]:
    """4-bit chunks c, c + 1: both chunks' 32 code bytes as their low nibbles, high nibbles."""
    q = _load(b, f.codes_at(b, c), _const(0), _V32I8)
    return b.and_(q, ir.Constant(_V32I8, [15] * 32)), b.lshr(q, ir.Constant(_V32I8, [4] * 32))


def _x_total(
    b: ir.IRBuilder, f: _Feature, k: int, c: ir.Value, sums: ir.Value, width: int,
    mask: ir.Value | None = None,
) -> ir.Value:
    """8-bit codes on AVX2 without VNNI: sums of (code - 128) * x plus 128 * sum(x) of chunks
    c .. c + width - 1 (width 8: a v8 i32, the sums of the lanes of `mask` only when given (the
    row's last values: nothing read past them); 1: an i32); otherwise `sums` as they are."""
    if f.bits != 8 or not AVX2 or VNNI:
        return sums
    at = b.add(c, b.mul(f.ops.chunks, _const(2)))
    if width == 1:
        total = b.fptosi(b.load(b.gep(f.xs_rows[k], [at])), _I32)
        return b.add(sums, b.shl(total, ir.Constant(_I32, 7)))
    loaded = _load8(b, f.xs_rows[k], at) if mask is None else _masked_load8(b, f.xs_rows[k], at, mask)
    total = b.fptosi(loaded, _V8I32)
    return b.add(sums, b.shl(total, ir.Constant(_V8I32, [7] * 8)))


def _emit_block(
    b: ir.IRBuilder, f: _Feature, accs: list[ir.Value], c0: ir.Value, contiguous: bool
) -> None:
    """Chunks c0 .. c0 + 7 (c0 % 8 == 0) into every row's lanes (c0 % 32) .. + 7."""
    s8, b8 = f.scale_vectors(b, c0, contiguous)
    _block_floats(b, f, accs, c0, (s8, b8), _block_sums(b, f, len(accs), c0))


def _block_floats(
    b: ir.IRBuilder,
    f: _Feature,
    accs: list[ir.Value],
    c0: ir.Value,
    scales: tuple[ir.Value, ir.Value],
    isums: list[ir.Value],
    mask: ir.Value | None = None,
) -> None:
    """Each row's chunk sums isums[k] (v8 i32, chunks c0 .. c0 + 7) into its lanes (c0 % 32)
    .. + 7: fma(s * d, isum, acc), then fma(b, d * sum(x), acc); with a mask, the lanes
    outside it keep their value (a select: an added 0.0 would turn a -0.0 lane into +0.0)
    and x's scales are read for its lanes only."""
    s8, b8 = scales
    fma = _fn(b, "llvm.fma.v8f32", _V8F32, [_V8F32] * 3)
    lane_vector = b.and_(b.lshr(c0, _const(3)), _const(3))
    for k, isum in enumerate(isums):
        at = (c0, b.add(c0, f.ops.chunks))  # with a mask (a row's tail): nothing read past it
        d8, dsum8 = ((_load8(b, f.xs_rows[k], i) for i in at) if mask is None
                     else (_masked_load8(b, f.xs_rows[k], i, mask) for i in at))
        slot = b.gep(accs[k], [_const(0), lane_vector])
        old = b.load(slot)
        new = b.call(fma, [b8, dsum8, b.call(fma, [b.fmul(s8, d8), b.sitofp(isum, _V8F32), old])])
        b.store(new if mask is None else b.select(mask, new, old), slot)


def _add_chunk(
    b: ir.IRBuilder, f: _Feature, acc: ir.Value, k: int, c: ir.Value, isum: ir.Value
) -> None:
    """Chunk c's exact sum isum (i32) of row k into lane c % 32 (the tail after the blocks)."""
    ops = f.ops
    g = b.lshr(c, ops.group_shift)
    scale, bias = f.scale_at(b, g)
    d = b.load(b.gep(f.xs_rows[k], [c]))
    dsum = b.load(b.gep(f.xs_rows[k], [b.add(c, ops.chunks)]))
    fma = _fn(b, "llvm.fma.f32", _F, [_F] * 3)
    slot = b.gep(b.bitcast(acc, _F.as_pointer()), [b.and_(c, _const(31))])
    new = b.call(fma, [b.fmul(scale, d), b.sitofp(isum, _F), b.load(slot)])
    b.store(b.call(fma, [bias, dsum, new]), slot)


def _lane_mask(b: ir.IRBuilder, count: ir.Value) -> ir.Value:
    """v8 i1: lanes 0 .. count - 1 (count an i64 <= 8)."""
    v8i32 = ir.VectorType(_I32, 8)
    n = b.insert_element(
        ir.Constant(v8i32, ir.Undefined), b.trunc(count, _I32), ir.Constant(_I32, 0)
    )
    n = _shuffle(b, n, n, [0] * 8)
    return b.icmp_unsigned("<", ir.Constant(v8i32, list(range(8))), n)


def _masked_load8(b: ir.IRBuilder, base: ir.Value, index: ir.Value, mask: ir.Value,
                  half: bool = False) -> ir.Value:
    """base[index + j] for the lanes of mask (nothing read past them), 0.0 elsewhere (an f16
    base: widened to f32, exact)."""
    v8i1 = ir.VectorType(ir.IntType(1), 8)
    vector, name = (_V8F16, "llvm.masked.load.v8f16.p0") if half else (_V8F32, "llvm.masked.load.v8f32.p0")
    fn = _fn(b, name, vector, [base.type, _I32, v8i1, vector])
    zero = ir.Constant(vector, [0.0] * 8)
    loaded = b.call(fn, [b.gep(base, [index]), ir.Constant(_I32, 2 if half else 4), mask, zero])
    return _widen(b, loaded, half)


def _emit_masked_block(
    b: ir.IRBuilder,
    f: _Feature,
    accs: list[ir.Value],
    c0: ir.Value,
    live: ir.Value,
    contiguous: bool,
) -> None:
    """Chunks c0 .. c0 + live - 1 (1 <= live <= 7, c0 % 8 == 0; 4-bit: live even, the x
    layout's pairs) as one 8-chunk block whose missing chunks sum to 0 and whose lanes past
    them are kept (_block_floats' mask): the same per-lane arithmetic as chunk by chunk.
    Scales and x sums are read only for the chunks there are (masked loads; gathered indices
    clamped to the row's last chunk)."""
    width = 2 if f.bits == 4 else 1  # chunks a dot: a 4-bit pair, or one 8-bit chunk
    vector = _V16I16 if f.bits == 4 else _V8I32
    zero = ir.Constant(vector, [0] * vector.count)
    dots = [[cgutils.alloca_once_value(b, zero) for _ in range(8 // width)] for _ in accs]
    for step in range(8 // width):
        c = b.add(c0, _const(width * step))
        with b.if_then(b.icmp_unsigned("<", _const(width * step), live)):
            if f.bits == 4:
                low, high = _nibbles(b, f, c)
            for k in range(len(accs)):
                dot = (_pair_dot(b, low, high, f.x_at(b, k, c)) if f.bits == 4
                       else _lone_chunk_dot(b, f.codes_at(b, c), f.x_at(b, k, c), 8))
                b.store(dot, dots[k][step])
    mask = _lane_mask(b, live)
    if contiguous:
        half = f.ops.half
        scales = (_masked_load8(b, f.scales, c0, mask, half),
                  _masked_load8(b, f.biases, c0, mask, half))
    else:
        last = b.sub(f.ops.chunks, _const(1))
        groups = []
        for j in range(8):
            c = b.add(c0, _const(j))
            c = b.select(b.icmp_unsigned("<", c, last), c, last)
            groups.append(b.lshr(c, f.ops.group_shift))
        scales = (_lane_gather(b, f.scales, groups, f.ops.half),
                  _lane_gather(b, f.biases, groups, f.ops.half))
    isums = []
    for k, row_dots in enumerate(dots):
        parts = [b.load(d) for d in row_dots]
        if f.bits == 4:
            isums.append(_sum8_u4(b, parts))
        else:
            isums.append(_x_total(b, f, k, c0, _sum8(b, parts), 8, mask))
    _block_floats(b, f, accs, c0, scales, isums, mask)


def _emit_tail(
    b: ir.IRBuilder, f: _Feature, accs: list[ir.Value], c0: ir.Value, contiguous: bool
) -> None:
    """Chunks c0 .. chunks - 1 (fewer than 8) as one masked block: 8-bit all of them, 4-bit
    its pairs (the x layout's), a lone last 4-bit chunk then alone."""
    ops = f.ops
    rest = b.sub(ops.chunks, c0)
    live = b.shl(b.lshr(rest, _const(1)), _const(1)) if f.bits == 4 else rest
    with b.if_then(b.icmp_unsigned("!=", live, _const(0))):
        _emit_masked_block(b, f, accs, c0, live, contiguous)
    with cgutils.for_range(b, b.sub(rest, live)) as loop:
        c = b.add(b.add(c0, live), loop.index)
        for k, acc in enumerate(accs):
            sums = _lone_chunk_dot(b, f.codes_at(b, c), f.x_at(b, k, c), f.bits)
            _add_chunk(b, f, acc, k, c, _x_total(b, f, k, c, _hsum_i32(b, sums), 1))


def _lane_sum(b: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """The 32 lanes' halving sum (lanes + lanes[i ^ 16], ^ 8, ^ 4, ^ 2, ^ 1; lane 0)."""
    a = [b.load(b.gep(acc, [_const(0), _const(i)])) for i in range(4)]
    v = b.fadd(b.fadd(a[0], a[2]), b.fadd(a[1], a[3]))
    width = 8
    while width > 1:
        width //= 2
        v = b.fadd(
            _shuffle(b, v, v, list(range(width))), _shuffle(b, v, v, list(range(width, 2 * width)))
        )
    return b.extract_element(v, ir.Constant(_I32, 0))


def _prefetch(b: ir.IRBuilder, ptr: ir.Value, nbytes: ir.Value) -> None:
    """Ask for the cache lines of [ptr, ptr + nbytes) (a hint: never faults)."""
    fn = _fn(b, "llvm.prefetch.p0", ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
    base = b.bitcast(ptr, _I8.as_pointer())
    with cgutils.for_range(b, b.udiv(b.add(nbytes, _const(63)), _const(64))) as loop:
        line = b.gep(base, [b.shl(loop.index, _const(6))])
        b.call(fn, [line, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _prefetch_feature(b: ir.IRBuilder, ops: _Operands, o: ir.Value) -> None:
    """Feature o + PREFETCH_FEATURES's codes, scales and biases, on their way while o runs."""
    ahead = b.add(o, _const(PREFETCH_FEATURES))
    _prefetch(b, b.gep(ops.codes, [b.mul(ahead, ops.code_row_bytes)]), ops.code_row_bytes)
    group0 = b.mul(ahead, ops.num_groups)
    group_bytes = b.mul(ops.num_groups, _const(2 if ops.half else 4))
    _prefetch(b, b.gep(ops.scales, [group0]), group_bytes)
    _prefetch(b, b.gep(ops.biases, [group0]), group_bytes)


def _emit_feature(
    b: ir.IRBuilder, ops: _Operands, o: ir.Value, accs: list[ir.Value], bits: int, contiguous: bool
) -> None:
    zero = ir.Constant(_ACC, [ir.Constant(_V8F32, [0.0] * 8)] * 4)
    for acc in accs:
        b.store(zero, acc)
    _prefetch_feature(b, ops, o)
    f = _Feature(b, ops, o, len(accs), bits)
    full = b.lshr(ops.chunks, _const(3))
    with cgutils.for_range(b, full) as loop:
        _emit_block(b, f, accs, b.shl(loop.index, _const(3)), contiguous)
    _emit_tail(b, f, accs, b.shl(full, _const(3)), contiguous)
    column = b.add(o, ops.out_offset)
    for k, acc in enumerate(accs):
        row = b.add(ops.row0, _const(k))
        b.store(_lane_sum(b, acc), b.gep(ops.out, [b.add(b.mul(row, ops.out_features), column)]))


def _dot_q8(bits: int, rows: int, contiguous: bool):  # type: ignore[no-untyped-def]
    @intrinsic
    def dot(
        typingctx,
        codes,
        scales,
        biases,
        group_shift,
        xq,
        xs,
        row0,
        out,
        first,  # noqa: ARG001
        last,
        out_offset,
    ):
        sig = types.void(
            codes, scales, biases, group_shift, xq, xs, row0, out, first, last, out_offset
        )

        def codegen(context, builder, sg, args):  # type: ignore[no-untyped-def]
            ops = _Operands(context, builder, sg, args)
            accs = [cgutils.alloca_once(builder, _ACC) for _ in range(rows)]
            with cgutils.for_range(builder, builder.sub(ops.last, ops.first)) as loop:
                _emit_feature(
                    builder, ops, builder.add(ops.first, loop.index), accs, bits, contiguous
                )
            return context.get_dummy_value()

        return sig, codegen

    dot.__doc__ = (
        f"out[row0 + k, out_offset + o] for k < {rows}, first <= o < last: "
        f"{bits}-bit codes . int8 x (module docstring)"
    )
    return dot


dot_u4_rows1, dot_u4_rows4 = _dot_q8(4, 1, True), _dot_q8(4, 4, True)
dot_u8_rows1, dot_u8_rows4 = _dot_q8(8, 1, True), _dot_q8(8, 4, True)
dot_u4_rows1_g, dot_u4_rows4_g = _dot_q8(4, 1, False), _dot_q8(4, 4, False)
dot_u8_rows1_g, dot_u8_rows4_g = _dot_q8(8, 1, False), _dot_q8(8, 4, False)


# ----------------------------------------------------------------------------- jitted
# x layouts of _quantize: the GPU's (kernels.matmul_affine_int8x, cuda_kernels/qdot.py), 4-bit
# order or natural, xs (d, d * sum) interleaved; this file's (matmul), 4-bit or 8-bit.
_GPU_Q4, _GPU_NATURAL, _OWN_U4, _OWN_U8 = 0, 1, 2, 3


@njit(**_JIT)
def _x_position(layout, chunks, c, j):
    """Byte of element j of chunk c in a quantized row. GPU 4-bit: per 8 elements the 4 even
    then the 4 odd (cuda_kernels.qdot.x_position); this file's 4-bit: chunks in pairs (2p,
    2p + 1) of 64 bytes, the even elements of 2p, of 2p + 1, then the odd ones of 2p, of
    2p + 1 (a lone last chunk: its even elements, then its odd ones); else natural."""
    if layout == _GPU_Q4:
        return c * CHUNK + (j // 8) * 8 + (j % 2) * 4 + (j % 8) // 2
    if layout != _OWN_U4:
        return c * CHUNK + j
    if c == chunks - 1 and chunks % 2 == 1:
        return c * CHUNK + (j % 2) * 16 + j // 2
    return (c - c % 2) * CHUNK + (j % 2) * 32 + (c % 2) * 16 + j // 2


@njit(**_JIT)
def _quantize(x, layout, xq, xs):
    """x [rows, K] f32 -> xq [rows, K] int8 per chunk of 32: d = amax / 127, q = the nearest
    integer to the exact x * (127 / amax), ties to even (a zero chunk: d = 0, q = 0), bytes at
    _x_position; xs: GPU layouts (d, d * sum(q)) per chunk [rows, 2K/32], this file's the
    chunks' d, then d * sum(q), then sum(q) [rows, 3K/32]."""
    chunks = x.shape[1] // CHUNK
    for r in range(x.shape[0]):
        for c in range(chunks):
            base = c * CHUNK
            amax = _F32(0.0)
            for j in range(CHUNK):
                amax = max(amax, abs(x[r, base + j]))
            d = amax / _F32(127.0)
            inv = _F32(127.0) / amax if amax > _F32(0.0) else _F32(0.0)
            total = _F32(0.0)
            for j in range(CHUNK):
                t = np.float64(x[r, base + j]) * np.float64(inv)  # exact; then nearest, ties even
                q = _F32((t + 6755399441055744.0) - 6755399441055744.0)
                q = min(max(q, _F32(-127.0)), _F32(127.0))
                xq[r, _x_position(layout, chunks, c, j)] = np.int8(q)
                total += q
            if layout == _GPU_Q4 or layout == _GPU_NATURAL:
                xs[r, 2 * c], xs[r, 2 * c + 1] = d, d * total
            else:
                xs[r, c], xs[r, chunks + c], xs[r, 2 * chunks + c] = d, d * total, total


@njit(**_JIT)
def quantize_rows_int8(x, q4_order, xq, xs):
    """x [rows, K] f32 -> xq [rows, K] int8 (chunks of 32, in kernels.int8_x_position order)
    and xs [rows, 2K/32] f32: (d, d * sum(xi)) per chunk: the x of kernels'
    matmul_affine_int8x and of the GPU's qdot (also reachable as kernels.quantize_rows_int8)."""
    _quantize(x, _GPU_Q4 if q4_order else _GPU_NATURAL, xq, xs)


@njit(**_JIT)
def quantize_rows(x, bits, xq, xs):
    """The same values as quantize_rows_int8 in this file's layout (matmul's x)."""
    _quantize(x, _OWN_U4 if bits == 4 else _OWN_U8, xq, xs)


@njit(**_JIT)
def _tile(codes, scales, biases, group_shift, xq, xs, row0, four, out, first, last, offset, bits):
    # rows row0 .. +3 (four) or row0, features [first, last): the same per-row arithmetic
    if group_shift == 0:
        if bits == 4:
            if four:
                dot_u4_rows4(
                    codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset
                )
            else:
                dot_u4_rows1(
                    codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset
                )
        elif four:
            dot_u8_rows4(codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset)
        else:
            dot_u8_rows1(codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset)
    elif bits == 4:
        if four:
            dot_u4_rows4_g(
                codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset
            )
        else:
            dot_u4_rows1_g(
                codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset
            )
    elif four:
        dot_u8_rows4_g(codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset)
    else:
        dot_u8_rows1_g(codes, scales, biases, group_shift, xq, xs, row0, out, first, last, offset)


@njit(**_JIT)
def _features(xq, xs, codes, scales, biases, group_shift, bits, first, last, out, offset):
    # features [first, last) of one weight in tiles of 16, each tile over all rows by 4
    rows = xq.shape[0]
    for o0 in range(first, last, _FEATURE_TILE):
        o1 = min(o0 + _FEATURE_TILE, last)
        for r in range(0, rows - rows % 4, 4):
            _tile(codes, scales, biases, group_shift, xq, xs, r, True, out, o0, o1, offset, bits)
        for r in range(rows - rows % 4, rows):
            _tile(codes, scales, biases, group_shift, xq, xs, r, False, out, o0, o1, offset, bits)


@njit(**_JIT)
def _parts_chunk(chunk, num_chunks, xq, xs, codes, scales, biases, group_shift, bits, offsets, out):
    total = offsets[-1]
    first, last = chunk * total // num_chunks, (chunk + 1) * total // num_chunks
    for p in range(len(codes)):
        lo, hi = max(first, offsets[p]), min(last, offsets[p + 1])
        if lo < hi:
            _features(
                xq,
                xs,
                codes[p],
                scales[p],
                biases[p],
                group_shift,
                bits,
                lo - offsets[p],
                hi - offsets[p],
                out,
                offsets[p],
            )


@njit(**_JIT, parallel=True)
def _parts_parallel(xq, xs, codes, scales, biases, group_shift, bits, offsets, out):
    num_chunks = max(1, min(_MAX_CHUNKS, offsets[-1]))
    for chunk in prange(num_chunks):
        _parts_chunk(
            chunk, num_chunks, xq, xs, codes, scales, biases, group_shift, bits, offsets, out
        )


@njit(**_JIT)
def matmul(x, codes, scales, biases, bits, group_size, out):
    """out = x @ [w_0 | w_1 | ...].T on int8 x, the weights affine `bits`-bit parts of one
    group size (tuples of codes, scales, biases; one part for a plain weight; scales and
    biases float32, or the float16 bits of compact_scales as uint16): x is quantized
    once, then one parallel region goes over all the parts' features. Takes in_features and
    group_size multiples of 32 (`fits`)."""
    rows, in_features = x.shape
    offsets = np.zeros(len(codes) + 1, np.int64)
    for p in range(len(codes)):
        offsets[p + 1] = offsets[p] + codes[p].shape[0]
    if rows == 0 or offsets[-1] == 0:
        return
    xq = np.empty((rows, in_features), np.int8)
    xs = np.empty((rows, 3 * (in_features // CHUNK)), _F32)
    quantize_rows(x, bits, xq, xs)
    group_shift = 0
    while (CHUNK << group_shift) < group_size:
        group_shift += 1
    if rows * offsets[-1] * in_features >= _PARALLEL_MIN_WORK:
        _parts_parallel(xq, xs, codes, scales, biases, group_shift, bits, offsets, out)
    else:
        _parts_chunk(0, 1, xq, xs, codes, scales, biases, group_shift, bits, offsets, out)


def compact_scales(
    scales: tuple[np.ndarray, ...], biases: tuple[np.ndarray, ...]
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The parts' scales and biases as float16 copies (their bits, as uint16) where every
    value of every part is one exactly (a GGUF block's d and m, an MLX bf16 scale that
    fits): `matmul` widens them back to the same float32s, so the outputs keep their bits
    and a decode step reads 2 bytes a group instead of 4 (docs/PERFORMANCE.md, session 27).
    Otherwise (a value float16 rounds, overflows or a NaN) the arrays as they are."""
    arrays = scales + biases
    with np.errstate(over="ignore", invalid="ignore"):
        halves = tuple(a.astype(np.float16) for a in arrays)
    exact = all(np.array_equal(h.astype(np.float32), a) for h, a in zip(halves, arrays, strict=True))
    if not exact:
        return scales, biases
    bits = tuple(h.view(np.uint16) for h in halves)  # Numba has no float16 arrays
    return bits[: len(scales)], bits[len(scales):]


def fits(bits: int, in_features: int, group_size: int) -> bool:
    """Whether `matmul` takes an affine weight of this kind: 4 or 8 bits, in_features whole
    chunks, groups of 32 * 2**k."""
    chunks = group_size // CHUNK
    return (
        bits in (4, 8)
        and in_features % CHUNK == 0
        and group_size % CHUNK == 0
        and chunks > 0
        and chunks & (chunks - 1) == 0
    )
