"""Affine 4-bit matmul of a few int8-x rows (1 to 16: decode rounds of several streams, verify
rows) on the tensor cores, with the bits of cuda_kernels/qdot.py, row for row.

Why a kernel of its own: at a few rows the weights are all the bytes, so the launch must stream
them at the memory's rate. cuda_kernels/qmma.py (built for prompt steps) loads 4 bytes of a
feature a lane and a scale per feature and chunk straight from global memory: at 8 rows an H100
spent its time in L1 wavefronts (90% busy, 11 of 32 bytes a sector used) at 0.9 TB/s. Here
a lane copies 16 contiguous bytes of a feature (4 chunks) and the 4 lanes of a quad swap words
so that each holds its mma fragment of each chunk; weight words and the quads' scale pieces
come through a ring of `stages` steps in shared memory (cp.async: no registers hold them in
flight).

The bits: qdot's out[r, o] is the butterfly sum (offsets 16, 8, 4, 2, 1) of 32 partials, partial
p the ordered chain over chunks c = p, p + 32, ...:
    acc = fma(s * d, float(isum), acc); acc = fma(b, e, acc),
isum = sum(q * xi) over the chunk, an exact integer (here from mma.m16n8k32, u8 x s8 -> s32, as
in qmma.py; see there for the fragments and the k order inside a chunk). A block has 8 warps;
warp w holds the 4 chains p = 4w + i (i = 0..3) and at step u multiplies chunks 32u + 4w + i,
so each chain runs in qdot's order. The butterfly's pairs are then: offsets 16, 8, 4 pair warp
w with w ^ 4, w ^ 2, w ^ 1 (through shared memory, one level at a time), offsets 2 and 1
pair a warp's chains i ^ 2, i ^ 1:
    out = (T0 + T2) + (T1 + T3),  T_i = chain i summed over the warps in that order.
Float addition is commutative bit for bit, so these are the butterfly's very additions.

Quad swap: lane (g, t) loads words 0..3 of chunk 32u + 4w + t of feature g (one 16-byte load);
mma needs word t of each of the 4 chunks: a 4 x 4 transpose over the quad (4 shuffles).

A block covers `ftiles` 16-feature tiles (for 'swiglu': 8 gate rows then the 8 up rows of the
same 8 outputs) by `rtiles` 8-row tiles. Shared memory: the ring and the cross-warp sums
(fits()). Index math is unsigned: numba adds a negative-index wraparound to signed indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuda_kernels import matmul as mm
from cuda_kernels import qmma as qm
from cuda_kernels.env import SIMULATOR, cuda, float_as_int, kernel

WARPS = 8  # warp w holds partials 4w .. 4w + 3
THREADS = 32 * WARPS
CHAINS = 4  # partials (chains) a warp
STEP = 32  # chunks a step: one of each partial
WORDS = 4  # q4 words a chunk
SHARED_LIMIT = 48 * 1024  # static shared memory a block
MAX_ROWS = 16
_NIB = np.uint32(0x0F0F0F0F)
_FULL = 0xFFFFFFFF
_U = np.uint32


@dataclass(frozen=True, slots=True)
class FewVariant:
    """Compile-time shape of one kernel; none of it changes a row's bits."""

    ftiles: int  # 16-feature tiles a block
    rtiles: int  # 8-row tiles a block
    max_registers: int = 0  # a cap for the compiler (0: none)
    stages: int = 3  # steps in the cp.async ring (2 or more)
    x_ring: bool = False  # the ring carries the block's x and x scales instead of the weights


if SIMULATOR:

    @cuda.jit(device=True)
    def _shfl_u32(v, offset):
        # Every thread of the block calls (uniform flow): exchange through shared memory.
        buf = cuda.shared.array(THREADS, np.uint32)
        tid = cuda.threadIdx.x
        buf[tid] = v
        cuda.syncthreads()
        other = buf[tid ^ offset]
        cuda.syncthreads()
        return np.uint32(other)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _shfl_u32(typingctx, v, offset):
        """shfl.sync.bfly.b32 over the full warp: lane l gets v of lane l ^ offset."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            val = context.cast(builder, args[0], sig.args[0], types.uint32)
            off = context.cast(builder, args[1], sig.args[1], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]),
                               f"shfl.sync.bfly.b32 $0, $1, $2, 0x1f, {_FULL:#x};", "=r,r,r")
            return builder.call(asm, [val, off])

        return types.uint32(v, offset), codegen


if SIMULATOR:

    @cuda.jit(device=True)
    def _copy_async(ring, row, col, src, words):
        # A synchronous copy: `words` 4-byte words of src (a row view) into ring[row], from
        # word col (the simulator has no asynchronous copies).
        for k in range(words):
            ring[row, col + k] = mm._ld_u32(src, k)  # the bits (scales are float32)

    @cuda.jit(device=True)
    def _commit():
        pass

    @cuda.jit(device=True)
    def _wait_ring():
        cuda.syncthreads()  # every thread of the block calls (uniform flow)

    @cuda.jit(device=True)
    def _ld_ring4(ring, row):
        return ring[row, 0], ring[row, 1], ring[row, 2], ring[row, 3]

    @cuda.jit(device=True)
    def _ld_ring2(ring, row, col):
        return ring[row, col], ring[row, col + 1]

else:

    def _shared_address(context, builder, sig, args):
        # The 32-bit shared-window address of ring[row, col] (a C-contiguous (rows, 4) uint32
        # shared array; row and col 32-bit): the array's base converted once (a pure asm the
        # compiler hoists), the rest 32-bit integer math.
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        generic = builder.ptrtoint(ary.data, i64)
        to_shared = ir.InlineAsm(ir.FunctionType(i32, [i64]),
                                 "{ .reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t; }", "=r,l")
        base = builder.call(to_shared, [generic])
        row = context.cast(builder, args[1], sig.args[1], types.uint32)
        col = context.cast(builder, args[2], sig.args[2], types.uint32)
        offset = builder.add(builder.mul(row, ir.Constant(i32, 16)), builder.mul(col, ir.Constant(i32, 4)))
        return builder.add(base, offset)

    def _make_copy_async(nbytes: int):
        cache = "cg" if nbytes == 16 else "ca"

        @intrinsic
        def copy_async(typingctx, ring, row, col, src, words):
            """cp.async of nbytes from global address src (a row reference) into
            ring[row, col ..] (no register holds the data in flight)."""
            def codegen(context, builder, sig, args):
                dst = _shared_address(context, builder, sig, args[:3])
                text = f"cp.async.{cache}.shared.global [$0], [$1], {nbytes};"
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [dst.type, ir.IntType(64)]), text,
                                   "r,l,~{memory}", side_effect=True)
                builder.call(asm, [dst, context.cast(builder, args[3], sig.args[3], types.int64)])
                return context.get_dummy_value()

            return types.void(ring, row, col, src, words), codegen

        return copy_async

    _COPIES = {n: _make_copy_async(n) for n in (4, 8, 16)}

    @intrinsic
    def _commit(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    def _make_wait(pending: int):
        @intrinsic
        def wait(typingctx):
            """This thread's copies but the `pending` newest groups have landed."""
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {pending};",
                                   "~{memory}", side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return wait

    def _make_ld_ring(count: int):
        @intrinsic
        def ld_ring(typingctx, ring, row, col):
            """`count` uint32 words of ring[row] from word col (ld.shared)."""
            def codegen(context, builder, sig, args):
                addr = _shared_address(context, builder, sig, args)
                i32 = ir.IntType(32)
                regs = ", ".join(f"${n}" for n in range(count))
                text = f"ld.shared.v{count}.u32 {{{regs}}}, [${count}];"
                out = ir.LiteralStructType([i32] * count)
                asm = ir.InlineAsm(ir.FunctionType(out, [addr.type]), text, ",".join(["=r"] * count + ["r"])
                                   + ",~{memory}", side_effect=True)
                res = builder.call(asm, [addr])
                vals = [builder.extract_value(res, n) for n in range(count)]
                return context.make_tuple(builder, sig.return_type, vals)

            return types.UniTuple(types.uint32, count)(ring, row, col), codegen

        return ld_ring

    _ld_ring4_impl, _ld_ring2 = _make_ld_ring(4), _make_ld_ring(2)

    @cuda.jit(device=True)
    def _ld_ring4(ring, row):
        return _ld_ring4_impl(ring, row, 0)



@cuda.jit(device=True)
def _quad_transpose(m, at, t):
    """Lane t of a quad holds row t of a 4 x 4 matrix in m[at .. at + 3]; afterwards column
    t (element i: row i's element t)."""
    m0, m1, m2, m3 = m[at], m[at + 1], m[at + 2], m[at + 3]
    hi = (t & 2) != 0
    r0 = _shfl_u32(m0 if hi else m2, 2)  # lanes t, t ^ 2 swap their off-diagonal 2 x 2 blocks
    r1 = _shfl_u32(m1 if hi else m3, 2)
    if hi:
        m0, m1 = r0, r1
    else:
        m2, m3 = r0, r1
    # now rows (t & 1, (t & 1) + 2) x columns (t & 2, (t & 2) + 1), as m0 m1 / m2 m3
    odd = (t & 1) != 0
    r0 = _shfl_u32(m0 if odd else m1, 1)
    r1 = _shfl_u32(m2 if odd else m3, 1)
    if odd:
        m[at], m[at + 1], m[at + 2], m[at + 3] = r0, m1, r1, m3
    else:
        m[at], m[at + 1], m[at + 2], m[at + 3] = m0, r0, m2, r1


def _make_feature(swiglu: bool):
    @cuda.jit(device=True)
    def feature(a, m, feat0, n_feat):
        # The weight row of mma row m (0..15) of tile a (clamped: computed, not stored)
        if swiglu:  # rows 0..7 gate features, 8..15 the up rows of the same outputs
            inter = n_feat // 2
            return min(feat0 + 8 * a + m % 8, inter - 1) + (inter if m >= 8 else 0)
        return min(feat0 + 16 * a + m, n_feat - 1)

    return feature


def _make_finish(variant: FewVariant, epilogue: str):
    """(reduce_warps, store): the butterfly's offsets 16, 8, 4 over the warps, then warp 0's
    offsets 2, 1 over its chains and the epilogue."""
    ft, rt = variant.ftiles, variant.rtiles
    swiglu = epilogue == "swiglu"
    n_out = ft * rt * 4
    n_acc = CHAINS * n_out
    put = mm._make_put(epilogue)

    @cuda.jit(device=True)
    def reduce_warps(acc, red):
        # Offsets 16, 8, 4 of the butterfly: warp w (< half) adds warp w + half's chains,
        # through red, a (rows, 4) uint32 shared array of at least RED_ROWS rows (the bits).
        warp, lane = _U(cuda.threadIdx.x) // _U(32), _U(cuda.threadIdx.x % 32)
        half = _U(WARPS // 2)
        while half >= _U(1):
            if half <= warp < _U(2) * half:
                for j in range(n_acc):
                    at = ((warp - half) * _U(n_acc) + _U(j)) * _U(32) + lane
                    red[at // _U(4), at % _U(4)] = np.uint32(float_as_int(acc[j]))
            cuda.syncthreads()
            if warp < half:
                for j in range(n_acc):
                    at = (warp * _U(n_acc) + _U(j)) * _U(32) + lane
                    acc[j] = acc[j] + mm._bits_f32(red[at // _U(4), at % _U(4)])
            cuda.syncthreads()
            half //= _U(2)

    @cuda.jit(device=True)
    def store(acc, row0, row_end, feat0, out):
        # Warp 0: offsets 2 and 1 over its chains, then the epilogue.
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        for a in range(ft):
            for b in range(rt):
                for k in range(4):
                    if swiglu and k >= 2:
                        continue
                    o = (a * rt + b) * 4 + k
                    total = (acc[o] + acc[2 * n_out + o]) + (acc[n_out + o] + acc[3 * n_out + o])
                    up_total = total
                    if swiglu:
                        o2 = o + 2
                        up_total = (acc[o2] + acc[2 * n_out + o2]) + (acc[n_out + o2] + acc[3 * n_out + o2])
                    m = g + 8 * (k // 2)
                    row = row0 + 8 * b + 2 * t + k % 2
                    feat = feat0 + (8 * a + m if swiglu else 16 * a + m)
                    if row < row_end and feat < out.shape[1]:
                        put(out, row, feat, total, up_total)

    return reduce_warps, store


def _make_chunk_math(variant: FewVariant, group_chunks: int):
    """qdot's chunk step for the lane's chain i of a step, every row and feature tile: the
    mma of the chunk's codes and x, then (live) the float chain with the scales of piece p
    (4a + 2h: scale, 4a + 2h + 1: bias of weight row g + 8h of tile a) for the chunk's group.
    live: False past the end (the mma still runs: the simulator's needs every thread)."""
    ft, rt = variant.ftiles, variant.rtiles
    per_step, gi_div, n_out = max(1, CHAINS // group_chunks), min(group_chunks, CHAINS), ft * rt * 4

    @cuda.jit(device=True)
    def chunk_math(i, wv, xv, dv, sv, acc, live):
        gi = i // gi_div
        for b in range(rt):
            d0, e0 = dv[16 * b + 2 * i], dv[16 * b + 2 * i + 1]
            d1, e1 = dv[16 * b + 8 + 2 * i], dv[16 * b + 8 + 2 * i + 1]
            for a in range(ft):
                w0, w1 = wv[8 * a + i], wv[8 * a + 4 + i]
                i0, i1, i2, i3 = qm._mma(w0 & _NIB, w1 & _NIB, (w0 >> np.uint32(4)) & _NIB,
                                         (w1 >> np.uint32(4)) & _NIB, xv[(b * 4 + i) * 2],
                                         xv[(b * 4 + i) * 2 + 1])
                if not live:
                    continue
                s0 = mm._bits_f32(sv[(4 * a) * per_step + gi])
                bias0 = mm._bits_f32(sv[(4 * a + 1) * per_step + gi])
                s1 = mm._bits_f32(sv[(4 * a + 2) * per_step + gi])
                bias1 = mm._bits_f32(sv[(4 * a + 3) * per_step + gi])
                o = i * n_out + (a * rt + b) * 4
                qm.chunk_fma(acc, o, s0, bias0, s1, bias1, d0, e0, d1, e1, i0, i1, i2, i3)

    return chunk_math


def _make_async_kernel(variant: FewVariant, group_chunks: int, epilogue: str):
    """The kernel with `variant.stages` steps of weights and scales in flight through cp.async
    into a shared ring (no registers hold them), in_features a multiple of 128 (whole
    4-chunk sets: a warp's step is all there or all past the end)."""
    ft, rt, stages = variant.ftiles, variant.rtiles, variant.stages
    swiglu = epilogue == "swiglu"
    feats_block = ft * (8 if swiglu else 16)
    per_step = max(1, CHAINS // group_chunks)  # scale groups of a warp's step
    piece = piece_bytes(32 * group_chunks)
    w_rows, quads, per_row = 2 * ft * THREADS, THREADS // 4, 16 // piece  # pieces a 16-byte row
    p_rows = quads // per_row  # rows of one piece index (the warp's quads side by side)
    stage_rows = ring_stage_rows(variant, group_chunks)
    ring_rows = max(stages * stage_rows, sum_rows(variant))
    n_out = ft * rt * 4
    n_acc = CHAINS * n_out
    n_w, n_x, n_d, n_sv = 2 * ft * WORDS, rt * CHAINS * 2, 16 * rt, 4 * ft * per_step
    ft2, rt2 = 2 * ft, 2 * rt
    feature = _make_feature(swiglu)
    reduce_warps, store = _make_finish(variant, epilogue)
    copy_w, copy_s = (_copy_async, _copy_async) if SIMULATOR else (_COPIES[16], _COPIES[piece])
    wait = _wait_ring if SIMULATOR else _make_wait(stages - 1)
    wait_all = _wait_ring if SIMULATOR else _make_wait(0)

    @cuda.jit(device=True)
    def warp_barrier():
        if SIMULATOR:
            cuda.syncthreads()
        else:
            cuda.syncwarp()

    @cuda.jit(device=True)
    def issue(u, chunks, w_refs, p_refs, ring):
        # Step u's weight words and scale pieces into its ring slot (clamped to the last
        # 4 chunks past the end: not used), then one commit group.
        tid = _U(cuda.threadIdx.x)
        base = min(_U(STEP) * u + _U(CHAINS) * (tid // _U(32)), chunks - _U(CHAINS))
        slot = (u % _U(stages)) * _U(stage_rows)
        mine = base + tid % _U(4)
        for r in range(2 * ft):
            copy_w(ring, slot + _U(r * THREADS) + tid, 0, mm._at(w_refs[r], mine * _U(WORDS)), 4)
        quad = tid // _U(4)
        at, col = slot + _U(w_rows) + quad // _U(per_row), (quad % _U(per_row)) * _U(piece // 4)
        for j in range(ft):  # piece 4j + t of the quad, at row (4j + t) * p_rows of the pieces
            copy_s(ring, at + (_U(4 * j) + tid % _U(4)) * _U(p_rows), col,
                   mm._at(p_refs[j], base // _U(group_chunks)), per_step)
        _commit()

    @cuda.jit(device=True)
    def read(u, ring, wv, sv):
        tid = _U(cuda.threadIdx.x)
        slot = (u % _U(stages)) * _U(stage_rows)
        for r in range(2 * ft):
            wv[4 * r], wv[4 * r + 1], wv[4 * r + 2], wv[4 * r + 3] = _ld_ring4(ring, slot + _U(r * THREADS) + tid)
        quad = tid // _U(4)
        at0, col = slot + _U(w_rows) + quad // _U(per_row), (quad % _U(per_row)) * _U(piece // 4)
        for p in range(4 * ft):
            at = at0 + _U(p * p_rows)
            if per_step == 4:
                sv[4 * p], sv[4 * p + 1], sv[4 * p + 2], sv[4 * p + 3] = _ld_ring4(ring, at)
            elif per_step == 2:
                sv[2 * p], sv[2 * p + 1] = _ld_ring2(ring, at, col)
            else:
                sv[p] = ring[at, col]

    chunk_math = _make_chunk_math(variant, group_chunks)

    @cuda.jit(device=True)
    def load_x(base, x_refs, xs_refs, xv, dv):
        t = _U(cuda.threadIdx.x % 4)
        for b in range(rt):
            for i in range(CHAINS):
                at = mm._at(x_refs[b], (base + _U(i)) * _U(8))
                xv[(b * 4 + i) * 2], xv[(b * 4 + i) * 2 + 1] = qm._ld_x2(at, _U(2) * t)
        for r in range(2 * rt):
            dv[8 * r], dv[8 * r + 1], dv[8 * r + 2], dv[8 * r + 3] = mm._ld_f32x4(xs_refs[r], _U(2) * base)
            dv[8 * r + 4], dv[8 * r + 5], dv[8 * r + 6], dv[8 * r + 7] = mm._ld_f32x4(
                xs_refs[r], _U(2) * base + _U(4))

    options = {"max_registers": variant.max_registers} if variant.max_registers and not SIMULATOR else {}

    @kernel(**options)
    def qmma_few_async_k(xq, xs, w, scales, biases, out):
        # xq: [rows, K / 4] u32 (int8 x, quantize_rows' order); xs: [rows, 2 * K / 32] f32;
        # w: [1, out_f, K / 8] u32; scales/biases: [1, out_f, groups] f32; out: [rows, out_f]
        # f32 (swiglu: w's rows / 2; add: updated in place). Grid (row blocks, feature blocks).
        ring = cuda.shared.array((ring_rows, 4), np.uint32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        row0, row_end = cuda.blockIdx.x * 8 * rt, xq.shape[0]
        feat0, n_feat = cuda.blockIdx.y * feats_block, w.shape[1]
        w_refs = cuda.local.array(ft2, mm._REF)
        p_refs = cuda.local.array(ft, mm._REF)
        x_refs = cuda.local.array(rt, mm._REF)
        xs_refs = cuda.local.array(rt2, mm._REF)
        for a in range(ft):
            for h in range(2):
                w_refs[2 * a + h] = mm._row3(w, 0, feature(a, g + 8 * h, feat0, n_feat))
            row = feature(a, g + 8 * (t // 2), feat0, n_feat)  # piece 4a + t
            p_refs[a] = mm._row3(scales, 0, row) if t % 2 == 0 else mm._row3(biases, 0, row)
        for b in range(rt):
            x_refs[b] = mm._row2(xq, min(row0 + 8 * b + g, row_end - 1))
            for h in range(2):
                xs_refs[2 * b + h] = mm._row2(xs, min(row0 + 8 * b + 2 * t + h, row_end - 1))
        acc = cuda.local.array(n_acc, np.float32)
        for j in range(n_acc):
            acc[j] = np.float32(0.0)
        wv = cuda.local.array(n_w, np.uint32)
        xv = cuda.local.array(n_x, np.uint32)
        dv = cuda.local.array(n_d, np.float32)
        sv = cuda.local.array(n_sv, np.uint32)
        chunks = _U(w.shape[2] // WORDS)
        steps = (chunks + _U(STEP - 1)) // _U(STEP)
        for j in range(stages - 1):
            if _U(j) < steps:
                issue(_U(j), chunks, w_refs, p_refs, ring)
            else:
                _commit()
        for u in range(steps):
            uu = _U(u)
            warp_barrier()  # the slot refilled below was read by the whole warp last step
            if uu + _U(stages - 1) < steps:
                issue(uu + _U(stages - 1), chunks, w_refs, p_refs, ring)
            else:
                _commit()
            wait()
            warp_barrier()  # the quad's scale pieces, copied by its 4 lanes
            read(uu, ring, wv, sv)
            base = _U(STEP) * uu + _U(CHAINS) * _U(warp)
            live = base < chunks
            base = min(base, chunks - _U(CHAINS))
            load_x(base, x_refs, xs_refs, xv, dv)
            for r in range(2 * ft):
                _quad_transpose(wv, 4 * r, _U(t))
            for i in range(CHAINS):
                chunk_math(i, wv, xv, dv, sv, acc, live)
        wait_all()
        cuda.syncthreads()  # every copy landed and every warp done with the ring: reuse it
        reduce_warps(acc, ring)
        if warp == 0:
            store(acc, row0, row_end, feat0, out)

    return qmma_few_async_k


X_ROW_PAD, XS_ROW_PAD = 65, 17  # 16-byte rows of one x row (64) and x-scale row (16) of a step, padded


def xring_stage_rows(variant: FewVariant, group_chunks: int) -> int:
    """16-byte rows of one step in the x ring: the quads' scale pieces, the block's x rows
    (32 chunks each) and their x scales."""
    pieces = 4 * variant.ftiles * (THREADS // 4)
    per_row = 16 // piece_bytes(32 * group_chunks)
    rows = 8 * variant.rtiles
    return (pieces + per_row - 1) // per_row + rows * (X_ROW_PAD + XS_ROW_PAD)


def _make_xring_kernel(variant: FewVariant, group_chunks: int, epilogue: str):
    """As _make_async_kernel, but the ring carries the block's x and x scales of each step
    (copied once by all threads, read by every warp: one block barrier a step) and the
    scale pieces; the weight words are prefetched a step ahead in registers."""
    ft, rt, stages = variant.ftiles, variant.rtiles, variant.stages
    swiglu = epilogue == "swiglu"
    feats_block = ft * (8 if swiglu else 16)
    per_step = max(1, CHAINS // group_chunks)
    piece = piece_bytes(32 * group_chunks)
    quads, per_row = THREADS // 4, 16 // piece
    p_rows = quads // per_row
    x0 = (4 * ft * quads + per_row - 1) // per_row  # first row of the x part of a stage
    xs0 = x0 + 8 * rt * X_ROW_PAD
    stage_rows = xring_stage_rows(variant, group_chunks)
    ring_rows = max(stages * stage_rows, sum_rows(variant))
    x_copies = 8 * rt * 64 // THREADS  # 16-byte x pieces a thread copies a step
    xs_threads = 8 * rt * 16  # threads that copy one 16-byte x-scale piece a step
    n_out = ft * rt * 4
    n_acc = CHAINS * n_out
    n_w, n_x, n_d, n_sv = 2 * ft * WORDS, rt * CHAINS * 2, 16 * rt, 4 * ft * per_step
    ft2 = 2 * ft
    feature = _make_feature(swiglu)
    reduce_warps, store = _make_finish(variant, epilogue)
    copy16, copy_s = (_copy_async, _copy_async) if SIMULATOR else (_COPIES[16], _COPIES[piece])
    wait = _wait_ring if SIMULATOR else _make_wait(max(0, stages - 2))
    wait_all = _wait_ring if SIMULATOR else _make_wait(0)

    @cuda.jit(device=True)
    def issue(u, chunks, p_refs, xc_refs, xsc_ref, ring):
        # Step u's scale pieces (per quad), the block's x (32 chunks of each row) and x scales
        # into its ring slot, then one commit group. Chunks past the end: clamped copies.
        tid = _U(cuda.threadIdx.x)
        slot = (u % _U(stages)) * _U(stage_rows)
        base = min(_U(STEP) * u + _U(CHAINS) * (tid // _U(32)), chunks - _U(CHAINS))
        quad = tid // _U(4)
        at, col = slot + quad // _U(per_row), (quad % _U(per_row)) * _U(piece // 4)
        for j in range(ft):
            copy_s(ring, at + (_U(4 * j) + tid % _U(4)) * _U(p_rows), col,
                   mm._at(p_refs[j], base // _U(group_chunks)), per_step)
        for m in range(x_copies):
            k = tid + _U(m * THREADS)
            r, seg = k // _U(64), k % _U(64)
            c = min(_U(STEP) * u + seg // _U(2), chunks - _U(1))
            copy16(ring, slot + _U(x0) + r * _U(X_ROW_PAD) + seg, 0,
                   mm._at(xc_refs[m], c * _U(8) + (seg % _U(2)) * _U(4)), 4)
        if tid < _U(xs_threads):
            r, seg = tid // _U(16), tid % _U(16)
            c = min(_U(STEP) * u + _U(2) * seg, chunks - _U(2))
            copy16(ring, slot + _U(xs0) + r * _U(XS_ROW_PAD) + seg, 0, mm._at(xsc_ref[0], _U(2) * c), 4)
        _commit()

    @cuda.jit(device=True)
    def read(u, ring, xv, dv, sv):
        tid = _U(cuda.threadIdx.x)
        warp, lane = tid // _U(32), tid % _U(32)
        g, t = lane // _U(4), lane % _U(4)
        slot = (u % _U(stages)) * _U(stage_rows)
        quad = tid // _U(4)
        at0, col = slot + quad // _U(per_row), (quad % _U(per_row)) * _U(piece // 4)
        for p in range(4 * ft):
            at = at0 + _U(p * p_rows)
            if per_step == 4:
                sv[4 * p], sv[4 * p + 1], sv[4 * p + 2], sv[4 * p + 3] = _ld_ring4(ring, at)
            elif per_step == 2:
                sv[2 * p], sv[2 * p + 1] = _ld_ring2(ring, at, col)
            else:
                sv[p] = ring[at, col]
        for b in range(rt):
            xrow = slot + _U(x0) + (_U(8 * b) + g) * _U(X_ROW_PAD) + _U(8) * warp + t // _U(2)
            for i in range(CHAINS):  # chunk 4w + i: 16-byte rows 2(4w + i) + t // 2
                xv[(b * 4 + i) * 2], xv[(b * 4 + i) * 2 + 1] = _ld_ring2(ring, xrow + _U(2 * i),
                                                                          _U(2) * (t % _U(2)))
            for h in range(2):
                srow = slot + _U(xs0) + (_U(8 * b + h) + _U(2) * t) * _U(XS_ROW_PAD) + _U(2) * warp
                for j in range(2):
                    v0, v1, v2, v3 = _ld_ring4(ring, srow + _U(j))
                    k = (2 * b + h) * 8 + 4 * j
                    dv[k], dv[k + 1] = mm._bits_f32(v0), mm._bits_f32(v1)
                    dv[k + 2], dv[k + 3] = mm._bits_f32(v2), mm._bits_f32(v3)

    @cuda.jit(device=True)
    def load_w(base, last, w_refs, wv):
        mine = min(base + _U(cuda.threadIdx.x % 4), last)
        for r in range(2 * ft):
            at = mm._at(w_refs[r], mine * _U(WORDS))
            wv[4 * r], wv[4 * r + 1], wv[4 * r + 2], wv[4 * r + 3] = mm._ld_u32x4(at, 0)

    chunk_math = _make_chunk_math(variant, group_chunks)

    options = {"max_registers": variant.max_registers} if variant.max_registers and not SIMULATOR else {}

    @kernel(**options)
    def qmma_few_xring_k(xq, xs, w, scales, biases, out):
        # As qmma_few_async_k.
        ring = cuda.shared.array((ring_rows, 4), np.uint32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        row0, row_end = cuda.blockIdx.x * 8 * rt, xq.shape[0]
        feat0, n_feat = cuda.blockIdx.y * feats_block, w.shape[1]
        w_refs = cuda.local.array(ft2, mm._REF)
        p_refs = cuda.local.array(ft, mm._REF)
        xc_refs = cuda.local.array(x_copies, mm._REF)  # the x rows this thread copies
        xsc_ref = cuda.local.array(1, mm._REF)  # the x-scale row this thread copies
        for a in range(ft):
            for h in range(2):
                w_refs[2 * a + h] = mm._row3(w, 0, feature(a, g + 8 * h, feat0, n_feat))
            row = feature(a, g + 8 * (t // 2), feat0, n_feat)
            p_refs[a] = mm._row3(scales, 0, row) if t % 2 == 0 else mm._row3(biases, 0, row)
        for m in range(x_copies):
            xc_refs[m] = mm._row2(xq, min(row0 + (tid + m * THREADS) // 64, row_end - 1))
        xsc_ref[0] = mm._row2(xs, min(row0 + min(tid, xs_threads - 1) // 16, row_end - 1))
        acc = cuda.local.array(n_acc, np.float32)
        for j in range(n_acc):
            acc[j] = np.float32(0.0)
        wv = cuda.local.array(n_w, np.uint32)
        wn = cuda.local.array(n_w, np.uint32)
        xv = cuda.local.array(n_x, np.uint32)
        dv = cuda.local.array(n_d, np.float32)
        sv = cuda.local.array(n_sv, np.uint32)
        chunks = _U(w.shape[2] // WORDS)
        steps = (chunks + _U(STEP - 1)) // _U(STEP)
        last, base0 = chunks - _U(1), _U(CHAINS) * _U(warp)
        load_w(min(base0, chunks - _U(CHAINS)), last, w_refs, wn)
        for j in range(stages - 1):
            if _U(j) < steps:
                issue(_U(j), chunks, p_refs, xc_refs, xsc_ref, ring)
            else:
                _commit()
        for u in range(steps):
            uu = _U(u)
            wait()  # this thread's copies of step u landed
            cuda.syncthreads()  # everyone's; and every warp done with the slot refilled next
            if uu + _U(stages - 1) < steps:
                issue(uu + _U(stages - 1), chunks, p_refs, xc_refs, xsc_ref, ring)
            else:
                _commit()
            for j in range(n_w):
                wv[j] = wn[j]
            base = _U(STEP) * uu + base0
            if uu + _U(1) < steps:
                load_w(min(base + _U(STEP), chunks - _U(CHAINS)), last, w_refs, wn)
            read(uu, ring, xv, dv, sv)
            for r in range(2 * ft):
                _quad_transpose(wv, 4 * r, _U(t))
            live = base < chunks
            for i in range(CHAINS):
                chunk_math(i, wv, xv, dv, sv, acc, live)
        wait_all()
        cuda.syncthreads()
        reduce_warps(acc, ring)
        if warp == 0:
            store(acc, row0, row_end, feat0, out)

    return qmma_few_xring_k


_KERNELS: dict[tuple[FewVariant, int, str], object] = {}


def qmma_few_kernel(variant: FewVariant, group_chunks: int, epilogue: str = "store"):
    """The kernel for q4 weights whose scale groups are group_chunks chunks of 32 (1, 2, 4..),
    and epilogue ('store', 'add', 'swiglu')."""
    if group_chunks < 1 or group_chunks & (group_chunks - 1) or epilogue not in mm.EPILOGUES:
        raise ValueError(f"qmma_few: {group_chunks} chunks a group, epilogue {epilogue!r}")
    if variant.stages < 2 or not fits(variant, group_chunks):
        raise ValueError(f"qmma_few: {variant} (a ring of 2+ steps within a block's shared memory)")
    key = (variant, group_chunks, epilogue)
    if key not in _KERNELS:
        make = _make_xring_kernel if variant.x_ring else _make_async_kernel
        _KERNELS[key] = make(variant, group_chunks, epilogue)
    return _KERNELS[key]


def piece_bytes(group_size: int) -> int:
    """Bytes of one scale piece the ring copies (a warp's step: 4 chunks' groups of a row)."""
    return 4 * max(1, CHAINS // max(1, group_size // 32))


def sum_rows(variant: FewVariant) -> int:
    """16-byte rows of shared memory the cross-warp sums take (the bits of 4 warps' chains)."""
    return (WARPS // 2) * CHAINS * variant.ftiles * variant.rtiles * 4 * 32 // 4


def ring_stage_rows(variant: FewVariant, group_chunks: int) -> int:
    """16-byte rows of one step in the ring: the weight words, then the quads' scale pieces."""
    pieces = 4 * variant.ftiles * (THREADS // 4)
    per_row = 16 // piece_bytes(32 * group_chunks)
    return 2 * variant.ftiles * THREADS + (pieces + per_row - 1) // per_row


def shared_bytes(variant: FewVariant, group_chunks: int = 2) -> int:
    """Static shared memory of a block: the cp.async ring (the cross-warp sums reuse it)."""
    per_stage = (xring_stage_rows if variant.x_ring else ring_stage_rows)(variant, group_chunks)
    return max(variant.stages * per_stage, sum_rows(variant)) * 16


def fits(variant: FewVariant, group_chunks: int = 2) -> bool:
    return shared_bytes(variant, group_chunks) <= SHARED_LIMIT


VARIANT: FewVariant | None = None  # overrides plan() (benchmarks and checks of other variants)


def plan(rows: int, group_chunks: int = 2) -> FewVariant:
    """32 features a block (two 16-feature tiles), one 8-row tile (two row blocks past 8
    rows), x and its scales through a 3-step ring with the weights prefetched in registers,
    registers capped at 128 (4 bytes spilled). One H100, session 25 (bench_qmma.py, 27B
    gate|up / down): 8 rows 64.1 / 39.5 us against 84.7 / 58.1 for session 23's 1:1 ring
    and qdot's 90.2 / 42.3; 16 rows 105.8 / 60.8 against qdot's 166.5 / 72.4; at 4 rows
    qdot is faster (59.6 / 29.6 against 72.5 / 45.7). Groups of one chunk (group size 32)
    give it too many scale rows for 48 KB: session 23's 16-feature weight ring there."""
    if VARIANT is not None:
        return VARIANT
    best = FewVariant(2, 1, max_registers=128, x_ring=True)
    return best if fits(best, group_chunks) else FewVariant(1, 1)


# Launches of MIN_ROWS .. TAKE_MAX rows that take this kernel when the caller leaves the path
# to the launcher (None: none). One H100, session 25, side by side in the engine
# (bench_qwen35_gpu.py): 8 streams 27B 434.0 -> 479.6 tok/s with plan()'s variant at 5-8
# rows (session 23's kernel before); DFlash2 on 27B (16-row verify) 3.78x plain with 5-16
# rows, against 3.01-3.05x with qdot at 16 rows (sessions 22-23).
MIN_ROWS: int | None = 5
TAKE_MAX = 16


def supports(kind: str, rows: int, in_features: int, group_size: int) -> bool:
    """Whether a launch can take this kernel: q4 words, 1..16 rows, whole 4-chunk sets
    (in_features a multiple of 128: a warp's step is all there or all past the end), groups
    of 1, 2, 4.. whole chunks."""
    chunks = group_size // 32
    if kind != "q4" or not 1 <= rows <= MAX_ROWS or in_features % 128 or group_size % 32:
        return False
    return chunks & (chunks - 1) == 0 and in_features % group_size == 0 and fits(plan(rows, chunks), chunks)


def takes(kind: str, rows: int, in_features: int, group_size: int) -> bool:
    """Whether a launch left to the launcher goes to this kernel (same bits as qdot's)."""
    return (MIN_ROWS is not None and MIN_ROWS <= rows <= TAKE_MAX
            and supports(kind, rows, in_features, group_size))


def launch_shape(rows: int, out_features: int, variant: FewVariant, epilogue: str = "store"
                 ) -> tuple[tuple[int, int], int]:
    """(grid, block): grid (row blocks, feature blocks); out_features: the output's columns."""
    per_block = variant.ftiles * (8 if epilogue == "swiglu" else 16)
    rows_block = 8 * variant.rtiles
    return ((rows + rows_block - 1) // rows_block, (out_features + per_block - 1) // per_block), THREADS
