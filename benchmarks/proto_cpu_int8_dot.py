"""Prototype (issue 25, CPU decode): a 4-bit x int8-activation dot on AVX2's maddubs, against
the CPU's float matmul (tf_async/backend/cpu/kernels.py matmul_affine), one row, the default
model's shapes (4-bit, groups of 32). x is quantized per 32 (even elements, then odd: the u4
layout) to int8 with (d, d * sum(xi)); a block's integer sum comes from vpmaddubsw +
vpmaddwd, then one fma per block with s * d (the bias term b * d * sum(xi) in a scalar
chain). The numerics are the GPU qdot's class (x rounded to int8), not its order: not a
drop-in replacement for either twin. Needs an AVX2 host.

    python benchmarks/proto_cpu_int8_dot.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V16I8, V32I8 = ir.VectorType(I8, 16), ir.VectorType(I8, 32)
V16I16, V8I32, V8F32 = ir.VectorType(I16, 16), ir.VectorType(I32, 8), ir.VectorType(F32, 8)


def _splat(b: ir.IRBuilder, v: ir.Value, vt: ir.VectorType) -> ir.Value:
    undef = ir.Constant(vt, ir.Undefined)
    one = b.insert_element(undef, v, ir.Constant(I32, 0))
    return b.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, vt.count), [0] * vt.count))


def _fn(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _row_ptr(context, b, sig_arg, array, row, elem):  # type: ignore[no-untyped-def]
    a = context.make_array(sig_arg)(context, b, array)
    width = cgutils.unpack_tuple(b, a.shape)[1]
    return b.gep(b.bitcast(a.data, elem.as_pointer()), [b.mul(row, width)]), width


def _hsum8(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    width = 8
    while width > 1:
        width //= 2
        lanes = ir.VectorType(I32, width)
        low = b.shuffle_vector(v, v, ir.Constant(lanes, list(range(width))))
        high = b.shuffle_vector(v, v, ir.Constant(lanes, list(range(width, 2 * width))))
        v = b.fadd(low, high)
    return b.extract_element(v, ir.Constant(I32, 0))


@intrinsic
def dot_q4_i8(typingctx, codes, xq, xs, scales, biases, o, r):  # type: ignore[no-untyped-def]  # noqa: ARG001
    """Weight row o (codes [out, in/8] u32, groups of 32) . int8 row r of xq -> float32."""
    sig = types.float32(codes, xq, xs, scales, biases, o, r)

    def codegen(context, b, sg, args):  # type: ignore[no-untyped-def]
        o = context.cast(b, args[5], sg.args[5], types.intp)
        r = context.cast(b, args[6], sg.args[6], types.intp)
        cbase, _ = _row_ptr(context, b, sg.args[0], args[0], o, I32)
        cbase = b.bitcast(cbase, I8.as_pointer())
        xbase, _ = _row_ptr(context, b, sg.args[1], args[1], r, I8)
        sbase, _ = _row_ptr(context, b, sg.args[2], args[2], r, F32)
        scb, groups = _row_ptr(context, b, sg.args[3], args[3], o, F32)
        bib, _ = _row_ptr(context, b, sg.args[4], args[4], o, F32)
        maddubs = _fn(b, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
        maddwd = _fn(b, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
        fma8 = _fn(b, "llvm.fma.v8f32", V8F32, [V8F32] * 3)
        fma1 = _fn(b, "llvm.fma.f32", F32, [F32] * 3)
        acc = cgutils.alloca_once_value(b, ir.Constant(V8F32, [0.0] * 8))
        acc_bias = cgutils.alloca_once_value(b, ir.Constant(F32, 0.0))
        with cgutils.for_range(b, groups) as loop:
            i = loop.index
            block = b.gep(cbase, [b.mul(i, ir.Constant(I64, 16))])
            q = b.load(b.bitcast(block, V16I8.as_pointer()), align=1)
            low = b.and_(q, ir.Constant(V16I8, [15] * 16))
            high = b.lshr(q, ir.Constant(V16I8, [4] * 16))
            q32 = b.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
            x_at = b.gep(xbase, [b.mul(i, ir.Constant(I64, 32))])
            xv = b.load(b.bitcast(x_at, V32I8.as_pointer()), align=1)
            sums = b.call(maddwd, [b.call(maddubs, [q32, xv]), ir.Constant(V16I16, [1] * 16)])
            d = b.load(b.gep(sbase, [b.mul(i, ir.Constant(I64, 2))]))
            dsum = b.load(b.gep(sbase, [b.add(b.mul(i, ir.Constant(I64, 2)), ir.Constant(I64, 1))]))
            scale, bias = b.load(b.gep(scb, [i])), b.load(b.gep(bib, [i]))
            sd = _splat(b, b.fmul(scale, d), V8F32)
            b.store(b.call(fma8, [b.sitofp(sums, V8F32), sd, b.load(acc)]), acc)
            b.store(b.call(fma1, [bias, dsum, b.load(acc_bias)]), acc_bias)
        return b.fadd(_hsum8(b, b.load(acc)), b.load(acc_bias))

    return sig, codegen


@njit(nogil=True)
def matmul_i8(codes, xq, xs, scales, biases, out):  # type: ignore[no-untyped-def]
    for r in range(xq.shape[0]):
        for o in range(codes.shape[0]):
            out[r, o] = dot_q4_i8(codes, xq, xs, scales, biases, o, r)


@njit(nogil=True, parallel=True)
def matmul_i8_parallel(codes, xq, xs, scales, biases, out):  # type: ignore[no-untyped-def]
    n = codes.shape[0]
    for chunk in prange(32):
        for o in range(chunk * n // 32, (chunk + 1) * n // 32):
            out[0, o] = dot_q4_i8(codes, xq, xs, scales, biases, o, 0)


@njit
def quantize(x, xq, xs):  # type: ignore[no-untyped-def]
    """Row 0 of x per 32: int8 of the even elements then the odd ones, and (d, d * sum)."""
    for c in range(x.shape[1] // 32):
        amax = np.float32(0)
        for j in range(32):
            amax = max(amax, abs(x[0, c * 32 + j]))
        d = amax / np.float32(127)
        inv = np.float32(127) / amax if amax > 0 else np.float32(0)
        total = 0
        for j in range(16):
            even, odd = int(np.rint(x[0, c * 32 + 2 * j] * inv)), int(np.rint(x[0, c * 32 + 2 * j + 1] * inv))
            xq[0, c * 32 + j], xq[0, c * 32 + 16 + j] = even, odd
            total += even + odd
        xs[0, 2 * c], xs[0, 2 * c + 1] = d, d * np.float32(total)


def _us(fn: Callable[[], None], repeats: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def bench(out_f: int, in_f: int, rng: np.random.Generator) -> str:
    from tf_async.backend.cpu import kernels

    codes = rng.integers(0, 2**32, (out_f, in_f // 8), dtype=np.uint32)
    scales = (rng.random((out_f, in_f // 32)) * 0.01).astype(np.float32)
    biases = -8 * scales
    x = rng.standard_normal((1, in_f)).astype(np.float32)
    xq, xs = np.empty((1, in_f), np.int8), np.empty((1, 2 * in_f // 32), np.float32)
    quantize(x, xq, xs)
    out, out_float = np.empty((1, out_f), np.float32), np.empty((1, out_f), np.float32)
    matmul_i8(codes, xq, xs, scales, biases, out)
    kernels.matmul_affine(x, codes, scales, biases, 4, 32, out_float)
    nibbles = codes.view(np.uint8)
    q = np.empty((out_f, in_f // 32, 32))
    q[:, :, 0::2] = (nibbles & 15).reshape(out_f, -1, 16)
    q[:, :, 1::2] = (nibbles >> 4).reshape(out_f, -1, 16)
    ref = (q * scales[:, :, None] + biases[:, :, None]).reshape(out_f, in_f) @ x[0].astype(np.float64)
    scale = np.abs(ref).max()
    times = (_us(lambda: matmul_i8(codes, xq, xs, scales, biases, out)),
             _us(lambda: matmul_i8_parallel(codes, xq, xs, scales, biases, out)),
             _us(lambda: quantize(x, xq, xs)),
             _us(lambda: kernels.matmul_affine(x, codes, scales, biases, 4, 32, out_float)))
    errors = (np.abs(out[0] - ref).max() / scale, np.abs(out_float[0] - ref).max() / scale)
    return (f"{out_f:>6} x {in_f:<5} {times[0]:>10.1f} {times[1]:>10.1f} {times[2]:>8.1f} "
            f"{times[3]:>10.1f} {errors[0]:>10.2e} {errors[1]:>10.2e}")


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'weight':<14} {'int8 1 thr':>10} {'int8 par':>10} {'quant':>8} {'float now':>10} "
          f"{'err int8':>10} {'err float':>10}   (us a call, one row; error vs float64, relative)")
    for out_f, in_f in ((1536, 576), (576, 1536), (49152, 576)):
        print(bench(out_f, in_f, rng), flush=True)


if __name__ == "__main__":
    main()
