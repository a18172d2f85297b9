"""Prototype (not wired into the engine): a 4-bit affine matmul on the tensor cores, to measure
whether it streams the weights faster than the CUDA-core kernel of cuda_kernels/matmul.py.

Why: the CUDA-core kernel spends ~5.2 instructions a weight (exact f32 dequantization), which
caps batch-1 decode near 40% of the roofline (docs/PERFORMANCE.md). Here the codes go to the
tensor cores as bf16 (a code 0..15 is exact in bf16: two codes a LOP3 and one bf16x2 fma) and
x as three bf16 parts (hi + mid + lo = x exactly), so the products are exact and the sums are
the tensor core's f32; per group of 64: y += s * sum(q x) + b * sum(x).

- mma.sync m16n8k16 (bf16 in, f32 out): A = 16 features x 16 k (the codes), B = 16 k x 8 rows
  (x), so up to 8 rows share one mma and a row's column never mixes with another's.
- Codes repacked (here, on the host) so that one 16-byte load of a lane holds its A fragments
  for the 4 k-tiles of a group: [features/16, groups, 32 lanes x 4 words].
- A block of W warps: warp w takes groups wU .. wU + U - 1, then W U further, ... of F feature
  tiles, all U F 16-byte loads of a step issued first (a fixed split of k), combined in warp
  order through shared memory: the same bits whatever the row count.
- x's fragments and group sums: made by every warp for itself, or (prepared) once per launch
  by `prep_x` and loaded (the same operations in the same order).

Findings (docs/PERFORMANCE.md, session 4): at 8 rows 2-2.5x faster than the CUDA-core kernel;
at one row 15-40% slower in every configuration tried.

    python benchmarks/proto_mma_q4.py [--rows 1,8] [--configs F:U:W:chains:parts:buffers:prepared:regs,...]

Prints, per Qwen3-8B-shaped linear: relative error of both kernels against float64, and the
GPU time and weight TB/s of each (graph replay over weight copies larger than the L2).
"""

from __future__ import annotations

import argparse

import numpy as np
from graph_timing import graph_seconds

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
WORKING_SET = 400 << 20
GROUP = 64


def repack(q: np.ndarray) -> np.ndarray:
    """codes [N, K] (0..15) -> [N/16, K/64, 128] uint32: word 4*lane + j holds lane's A
    fragment of k-tile j: register r (rows g / g+8, k 2t.. / 2t+8..) in nibbles r (its first
    element) and r + 4 (its second), lane = 4g + t."""
    n, k = q.shape
    qt = q.reshape(n // 16, 16, k // GROUP, GROUP).transpose(0, 2, 1, 3)  # [NT, G, 16, 64]
    lane, j, r, h = np.meshgrid(
        np.arange(32), np.arange(4), np.arange(4), np.arange(2), indexing="ij"
    )
    g, t = lane // 4, lane % 4
    m = g + 8 * (r % 2)
    kk = j * 16 + 2 * t + 8 * (r // 2) + h
    sel = qt[:, :, m, kk].astype(np.uint32)  # [NT, G, 32, 4, 4, 2]
    shifts = (4 * r + 16 * h).astype(np.uint32)[None, None]
    words = np.bitwise_or.reduce((sel << shifts).reshape(*sel.shape[:4], 8), axis=-1)
    return np.ascontiguousarray(words.reshape(n // 16, k // GROUP, 128)).astype(np.uint32)


def make_kernel(  # noqa: C901, PLR0913
    feats: int,
    unroll: int,
    warps: int,
    chains: int = 1,
    nparts: int = 3,
    buffers: int = 1,
    prep: int = 0,
    regs: int = 0,
):
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda.extending import intrinsic

    from cuda_kernels.matmul import _asm_load, _bits_f32, _ld_f32x2, _row2, _row3

    nacc = 4 * feats  # accumulators a lane: 4 per feature tile
    split_chains = chains == 4  # 4 independent mma chains a group (else one of 12)
    double_buffer = buffers == 2  # the next step's loads issued before this step's math
    prepared = prep == 1  # x's fragments and group sums read from prep_x's output
    nxv, nwv = 16 * unroll, 4 * unroll * feats
    ld_x4 = _asm_load("ld.global.nc.v4.u32", 4, "r", types.UniTuple(types.uint32, 4))
    ld_u32x4 = _asm_load(
        "ld.global.nc.L1::no_allocate.v4.u32", 4, "r", types.UniTuple(types.uint32, 4)
    )

    def _i32(builder, val):
        if val.type.width > 32:
            return builder.trunc(val, ir.IntType(32))
        return builder.zext(val, ir.IntType(32)) if val.type.width < 32 else val

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            out = ir.LiteralStructType([f32] * 4)
            text = (
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, "
                "{$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
            )
            ins = [_i32(builder, a) for a in args[:6]] + list(args[6:])
            fnty = ir.FunctionType(out, [a.type for a in ins])
            asm = ir.InlineAsm(fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, ins)
            vals = [builder.extract_value(res, n) for n in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)

        return types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    @intrinsic
    def bf16x2(typingctx, hi, lo):
        """cvt.rn.bf16x2.f32: hi in the upper half, lo in the lower."""

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            asm = ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, list(args))

        return types.uint32(hi, lo), codegen

    @intrinsic
    def minus128(typingctx, v):
        """bf16x2 (128 + a, 128 + b) -> (a, b): fma(v, 1, -128) per half (exact)."""

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(i32, [i32] * 3)
            asm = ir.InlineAsm(fnty, "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r")
            one, minus = ir.Constant(i32, 0x3F803F80), ir.Constant(i32, 0xC300C300)
            return builder.call(asm, [_i32(builder, args[0]), one, minus])

        return types.uint32(v), codegen

    @cuda.jit(device=True)
    def split3(hi_x, lo_x, parts, at):
        # parts[at], parts[at + 2], parts[at + 4]: bf16x2 hi, mid, lo of (lo_x, hi_x);
        # x - part is exact in f32 at each step, so hi + mid + lo = x.
        for p in range(nparts):
            v = bf16x2(hi_x, lo_x)
            parts[at + 2 * p] = v
            lo_x = lo_x - _bits_f32(v << np.uint32(16))
            hi_x = hi_x - _bits_f32(v & np.uint32(0xFFFF0000))

    @cuda.jit(device=True)
    def load_x(xr, gi, t, xv, at):
        # xv[at .. at + 15]: the lane's x of group gi (k-tile j: k 2t, 2t+1, 2t+8, 2t+9).
        for j in range(4):
            k0 = gi * GROUP + j * 16 + 2 * t
            xv[at + 4 * j], xv[at + 4 * j + 1] = _ld_f32x2(xr, k0)
            xv[at + 4 * j + 2], xv[at + 4 * j + 3] = _ld_f32x2(xr, k0 + 8)

    @cuda.jit(device=True)
    def prepare_x(xv, at, keep, bparts):
        # From load_x's values: bparts = their bf16 parts (k-tile j: [6j .. 6j+5] = hi0 hi1
        # mid0 mid1 lo0 lo1), and the group's sum of x's row g (every lane of row g).
        part = np.float32(0.0)
        for i in range(16):
            xv[at + i] = xv[at + i] * keep
            part = part + xv[at + i]
        part = part + cuda.shfl_xor_sync(0xFFFFFFFF, part, 1)
        part = part + cuda.shfl_xor_sync(0xFFFFFFFF, part, 2)
        for j in range(4):
            split3(xv[at + 4 * j + 1], xv[at + 4 * j], bparts, 6 * j)
            split3(xv[at + 4 * j + 3], xv[at + 4 * j + 2], bparts, 6 * j + 1)
        return part

    @cuda.jit(device=True)
    def fetch(packed, ft0, gi0, lane, wn):
        # Every load of a step: unroll groups x feats tiles, 512 B each a warp.
        for u in range(unroll):
            for f in range(feats):
                at = 4 * (u * feats + f)
                wn[at], wn[at + 1], wn[at + 2], wn[at + 3] = ld_u32x4(
                    _row3(packed, ft0 + f, gi0 + u), 4 * lane
                )

    @(cuda.jit(max_registers=regs) if regs else cuda.jit)
    def kernel(x, xfrag, xsum, packed, scales, biases, out):
        # x [rows <= 8, K] f32; packed [N/16, K/64, 128] u32; scales, biases [N, K/64] f32
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        g, t = lane // 4, lane % 4
        rows = x.shape[0]
        groups = packed.shape[1]
        ft0 = cuda.blockIdx.x * feats
        xr = _row2(x, min(g, rows - 1))
        keep = np.float32(1.0) if g < rows else np.float32(0.0)
        acc = cuda.local.array(nacc, np.float32)
        for i in range(nacc):
            acc[i] = np.float32(0.0)
        xv = cuda.local.array(nxv, np.float32)
        bparts = cuda.local.array(24, np.uint32)  # x's B fragments (see prepare_x)
        a = cuda.local.array(4, np.uint32)  # one k-tile's A fragment
        wv = cuda.local.array(nwv, np.uint32)  # group u, tile f: [4(u F + f) ..], its 4 k-tiles
        wn = cuda.local.array(nwv, np.uint32)  # the next step's words
        ct = cuda.local.array(16, np.float32)  # split_chains: the 4 k-tiles' sums
        gi0 = warp * unroll
        fetch(packed, ft0, gi0, lane, wn)
        while gi0 < groups:
            for i in range(nwv):
                wv[i] = wn[i]
            if double_buffer and gi0 + warps * unroll < groups:  # the next step's loads in flight
                fetch(packed, ft0, gi0 + warps * unroll, lane, wn)
            if not prepared:
                for u in range(unroll):
                    load_x(xr, gi0 + u, t, xv, 16 * u)
            for u in range(unroll):
                gi = gi0 + u
                if prepared:  # x's bf16 parts in fragment order and its group sums, loaded
                    if g < rows:
                        for c in range(6):
                            v0, v1, v2, v3 = ld_x4(_row3(xfrag, gi, c), 4 * lane)
                            bparts[4 * c], bparts[4 * c + 1] = v0, v1
                            bparts[4 * c + 2], bparts[4 * c + 3] = v2, v3
                    else:
                        for c in range(24):
                            bparts[c] = np.uint32(0)
                    sum0, sum1 = _ld_f32x2(_row2(xsum, gi), 2 * t)
                else:
                    part = prepare_x(xv, 16 * u, keep, bparts)
                    sum0 = cuda.shfl_sync(0xFFFFFFFF, part, 8 * t)  # row 2t
                    sum1 = cuda.shfl_sync(0xFFFFFFFF, part, 8 * t + 4)  # row 2t + 1
                for f in range(feats):
                    ft = ft0 + f
                    c0 = c1 = c2 = c3 = np.float32(0.0)
                    for j in range(4):
                        if split_chains:  # k-tile j in its own chain of 3 mma (summed below)
                            c0 = c1 = c2 = c3 = np.float32(0.0)
                        w = wv[4 * (u * feats + f) + j]
                        for r in range(4):  # register r: nibbles r and r + 4, as bf16 128 + q
                            code = (w >> np.uint32(4 * r)) & np.uint32(0x000F000F)
                            a[r] = minus128(code | np.uint32(0x43004300))
                        for p in range(nparts):
                            b0, b1 = bparts[6 * j + 2 * p], bparts[6 * j + 2 * p + 1]
                            c0, c1, c2, c3 = mma(a[0], a[1], a[2], a[3], b0, b1, c0, c1, c2, c3)
                        if split_chains:
                            ct[4 * j], ct[4 * j + 1], ct[4 * j + 2], ct[4 * j + 3] = c0, c1, c2, c3
                    if split_chains:
                        c0 = ((ct[0] + ct[4]) + ct[8]) + ct[12]
                        c1 = ((ct[1] + ct[5]) + ct[9]) + ct[13]
                        c2 = ((ct[2] + ct[6]) + ct[10]) + ct[14]
                        c3 = ((ct[3] + ct[7]) + ct[11]) + ct[15]
                    feat = ft * 16 + g
                    s_lo, b_lo = scales[feat, gi], biases[feat, gi]
                    s_hi, b_hi = scales[feat + 8, gi], biases[feat + 8, gi]
                    acc[4 * f] = cuda.fma(b_lo, sum0, cuda.fma(s_lo, c0, acc[4 * f]))
                    acc[4 * f + 1] = cuda.fma(b_lo, sum1, cuda.fma(s_lo, c1, acc[4 * f + 1]))
                    acc[4 * f + 2] = cuda.fma(b_hi, sum0, cuda.fma(s_hi, c2, acc[4 * f + 2]))
                    acc[4 * f + 3] = cuda.fma(b_hi, sum1, cuda.fma(s_hi, c3, acc[4 * f + 3]))
            gi0 += warps * unroll
            if not double_buffer and gi0 < groups:
                fetch(packed, ft0, gi0, lane, wn)
        buf = cuda.shared.array((warps, nacc, 32), np.float32)
        for i in range(nacc):
            buf[warp, i, lane] = acc[i]
        cuda.syncthreads()
        if warp == 0:
            for i in range(nacc):
                total = buf[0, i, lane]
                for w in range(1, warps):
                    total = total + buf[w, i, lane]
                row = 2 * t + i % 2
                feat = (ft0 + i // 4) * 16 + g + 8 * ((i // 2) % 2)
                if row < rows and feat < out.shape[1]:
                    out[row, feat] = total

    @cuda.jit
    def prep_x(x, xfrag, xsum):
        # grid (groups,), 32 threads: lane 4g + t writes its B fragments of group gi (x's row g,
        # 3 bf16 parts, 4 k-tiles: 24 words) and lane 4g writes the group's sum of row g, by
        # the kernel's own load_x and prepare_x.
        gi = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        rows = x.shape[0]
        xr = _row2(x, min(g, rows - 1))
        keep = np.float32(1.0) if g < rows else np.float32(0.0)
        xv = cuda.local.array(16, np.float32)
        bparts = cuda.local.array(24, np.uint32)
        load_x(xr, gi, t, xv, 0)
        part = prepare_x(xv, 0, keep, bparts)
        if t == 0:
            xsum[gi, g] = part
        for c in range(24):
            xfrag[gi, c // 4, 4 * lane + c % 4] = bparts[c]

    return kernel, prep_x


def replay_each(cp, cuda, launch_one, copies: list, once: bool = False) -> float:
    """GPU seconds of one launch_one(stream, *copy), averaged over a graph of one per copy;
    once: launch_one on the first copy only, eagerly (nothing timed: for a profiler)."""
    if once:
        launch_one(cuda.external_stream(cp.cuda.get_current_stream().ptr), *copies[0])
        cp.cuda.get_current_stream().synchronize()
        return float("nan")

    def record(stream) -> None:
        ns = cuda.external_stream(stream.ptr)
        for parts in copies:
            launch_one(ns, *parts)

    return graph_seconds(cp, record) / len(copies)


def main() -> None:  # noqa: C901
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument(
        "--configs",
        default="1:4:4:1:3:1:1:0,1:4:4:1:3:1:1:96,1:4:4:1:3:1:1:80,1:2:4:1:3:1:1:80,2:2:4:1:3:1:1:0,2:2:4:1:3:1:1:104,1:2:8:1:3:1:1:80",
        help="F:U:W:chains:parts:buffers:prepared:regs (parts < 3: x rounded, to time the split; prepared 1: x from prep_x; regs: a register cap, 0 none), ...",
    )
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--once", action="store_true", help="no timing: each kernel runs once (for ncu)"
    )
    args = parser.parse_args()
    import cupy as cp
    from numba import cuda

    from cuda_kernels import launch
    from cuda_kernels.launch import _go
    from tf_async.backend.weights import pack_codes

    rng = np.random.default_rng(0)
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    kernels = {c: make_kernel(*c) for c in configs}
    prep_x = make_kernel(1, 1, 1)[1]
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'shape':8} {'rows':>4} {'kernel':18} {'rel err':>9} {'us':>8} {'TB/s':>6}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        one = n * k // 2 + 2 * 4 * n * k // GROUP
        copies = max(2, WORKING_SET // one)
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        codes = cp.asarray(pack_codes(q, 4))
        packed = cp.asarray(repack(q))
        scales = cp.asarray((rng.random((n, k // GROUP)) * 0.02 + 0.001).astype(np.float32))
        biases = cp.asarray(
            (-7.5 * cp.asnumpy(scales) + 0.001 * rng.standard_normal(scales.shape)).astype(
                np.float32
            )
        )
        deq = (
            cp.asarray(q).astype(cp.float64).reshape(n, k // GROUP, GROUP) * scales[:, :, None]
            + biases[:, :, None]
        ).reshape(n, k)
        ours = [
            tuple(
                cuda.as_cuda_array(a, sync=False)
                for a in (packed.copy(), scales.copy(), biases.copy())
            )
            for _ in range(copies)
        ]
        base = [
            tuple(
                cuda.as_cuda_array(a, sync=False)
                for a in (codes[None].copy(), scales[None].copy(), biases[None].copy())
            )
            for _ in range(copies)
        ]
        ids = cuda.as_cuda_array(cp.zeros(1, cp.int32), sync=False)
        for rows in (int(v) for v in args.rows.split(",")):
            x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            want = x.astype(cp.float64) @ deq.T
            out = cp.full((rows, n), cp.nan, cp.float32)
            dx, dout = cuda.as_cuda_array(x, sync=False), cuda.as_cuda_array(out, sync=False)
            xfrag = cuda.as_cuda_array(cp.zeros((k // GROUP, 6, 128), cp.uint32), sync=False)
            xsum = cuda.as_cuda_array(cp.zeros((k // GROUP, 8), cp.float32), sync=False)
            prep_sec = replay_each(
                cp,
                cuda,
                lambda ns, xf, xs, dx=dx, groups=k // GROUP: _go(
                    prep_x, (groups,), 32, ns, dx, xf, xs
                ),
                [(xfrag, xsum)],
                args.once,
            )
            print(f"{name:8} {rows:>4} {'prep_x':18} {'':9} {prep_sec * 1e6:8.2f}")
            launch.matmul("q4", dx, base[0][0], base[0][1], base[0][2], GROUP, ids, dout)
            cp.cuda.Device().synchronize()
            err = float(cp.linalg.norm(out - want) / cp.linalg.norm(want))

            sec = replay_each(
                cp,
                cuda,
                lambda ns, c, s, b, dx=dx, dout=dout, ids=ids: launch.matmul(
                    "q4", dx, c, s, b, GROUP, ids, dout, ns
                ),
                base,
                args.once,
            )
            print(
                f"{name:8} {rows:>4} {'cuda-core':18} {err:9.2e} {sec * 1e6:8.2f} {one / sec / 1e12:6.2f}"
            )
            for (f, u, warps, chains, parts, bufs, *more), (kern, _) in kernels.items():
                if (k // GROUP) % (u * warps):
                    continue
                grid = n // (16 * f)
                out[...] = cp.nan
                _go(kern, (grid,), 32 * warps, None, dx, xfrag, xsum, *ours[0], dout)
                cp.cuda.Device().synchronize()
                err = float(cp.linalg.norm(out - want) / cp.linalg.norm(want))
                sec = replay_each(
                    cp,
                    cuda,
                    lambda ns, p, s, b, kern=kern, grid=grid, dx=dx, dout=dout, warps=warps, xf=xfrag, xs=xsum: (
                        _go(kern, (grid,), 32 * warps, ns, dx, xf, xs, p, s, b, dout)
                    ),
                    ours,
                    args.once,
                )
                label = "mma " + ":".join(map(str, (f, u, warps, chains, parts, bufs, *more)))
                print(
                    f"{name:8} {rows:>4} {label:18} {err:9.2e} {sec * 1e6:8.2f} {one / sec / 1e12:6.2f}"
                )


if __name__ == "__main__":
    main()
