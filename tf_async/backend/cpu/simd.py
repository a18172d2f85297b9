"""Numba intrinsics for the CPU kernels: scalar bit casts, fused multiply-add, and the
16-byte dequantization steps of the affine matmul written as explicit LLVM vector code.

The auto-vectoriser cannot prove that the code buffer and the output buffer do not alias,
so it leaves the nibble decode scalar; these intrinsics emit one vector load, the integer
unpacking, `fma(q, scale, bias)` and vector stores. They compile on any x86-64 (LLVM splits
the 16-lane vectors where AVX-512 is absent) and round exactly like the scalar `fma32`.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_I8 = ir.IntType(8)
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


def _byte_ptr(context, builder, array_type, array_value, byte_offset):
    data = context.make_array(array_type)(context, builder, array_value).data
    return builder.gep(builder.bitcast(data, _I8.as_pointer()), [byte_offset])


def _float_ptr(context, builder, array_type, array_value, offset):
    data = context.make_array(array_type)(context, builder, array_value).data
    return builder.gep(data, [offset])


def _fma16(builder, codes_i32, scale, bias):
    fnty = ir.FunctionType(_V16_F32, [_V16_F32] * 3)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.v16f32")
    q = builder.sitofp(codes_i32, _V16_F32)
    return builder.call(fn, [q, _splat(builder, scale, _V16_F32), _splat(builder, bias, _V16_F32)])


def _store16(builder, value, ptr):
    builder.store(value, builder.bitcast(ptr, _V16_F32.as_pointer()), align=4)


def _load16_bytes(context, builder, sig, args):
    byte_offset = context.cast(builder, args[1], sig.args[1], types.intp)
    src = _byte_ptr(context, builder, sig.args[0], args[0], byte_offset)
    raw = builder.load(builder.bitcast(src, _V16_I8.as_pointer()), align=1)
    return builder.zext(raw, _V16_I32)


def _dequant_args(context, builder, sig, args):
    dst_offset = context.cast(builder, args[3], sig.args[3], types.intp)
    dst = _float_ptr(context, builder, sig.args[2], args[2], dst_offset)
    scale = context.cast(builder, args[4], sig.args[4], types.float32)
    bias = context.cast(builder, args[5], sig.args[5], types.float32)
    return dst, scale, bias


@intrinsic
def dequant16_u4(typingctx, codes, byte_offset, dst, dst_offset, scale, bias):  # noqa: ARG001
    """16 bytes of 4-bit codes at `byte_offset` -> 32 floats at dst[dst_offset:]:
    low nibbles (elements 0, 2, ..., 30) first, then high nibbles (1, 3, ..., 31)."""
    sig = types.void(codes, byte_offset, dst, dst_offset, scale, bias)

    def codegen(context, builder, signature, args):
        q = _load16_bytes(context, builder, signature, args)
        ptr, s, b = _dequant_args(context, builder, signature, args)
        low = builder.and_(q, ir.Constant(_V16_I32, [15] * 16))
        high = builder.lshr(q, ir.Constant(_V16_I32, [4] * 16))
        _store16(builder, _fma16(builder, low, s, b), ptr)
        _store16(builder, _fma16(builder, high, s, b), builder.gep(ptr, [ir.Constant(_I32, 16)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dequant16_u8(typingctx, codes, byte_offset, dst, dst_offset, scale, bias):  # noqa: ARG001
    """16 bytes of 8-bit codes at `byte_offset` -> 16 floats at dst[dst_offset:]."""
    sig = types.void(codes, byte_offset, dst, dst_offset, scale, bias)

    def codegen(context, builder, signature, args):
        q = _load16_bytes(context, builder, signature, args)
        ptr, s, b = _dequant_args(context, builder, signature, args)
        _store16(builder, _fma16(builder, q, s, b), ptr)
        return context.get_dummy_value()

    return sig, codegen
