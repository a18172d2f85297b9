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
from cuda_kernels.env import SIMULATOR, cuda, kernel

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
    max_registers: int = 0  # a cap for the compiler (0: none): 64 lets 4 blocks share an SM
    stages: int = 3  # steps of weights and scale pieces in the cp.async ring (2 or more)


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
    def _copy_async(ring, row, half, src, words):
        # A synchronous copy: `words` 4-byte words of src (a row view) into ring[row], from
        # word 2 * half (the simulator has no asynchronous copies).
        for k in range(words):
            ring[row, 2 * half + k] = mm._ld_u32(src, k)  # the bits (scales are float32)

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
    def _ld_ring2(ring, row, half):
        return ring[row, 2 * half], ring[row, 2 * half + 1]

else:
    from numba.cuda import cgutils  # type: ignore[attr-defined]

    def _shared_address(context, builder, sig, args):
        # The shared-window address (u64) of ring[row, 2 * half] (a 2-D uint32 shared array)
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        row = context.cast(builder, args[1], sig.args[1], types.intp)
        col = builder.mul(context.cast(builder, args[2], sig.args[2], types.intp),
                          context.get_constant(types.intp, 2))
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [row, col])
        return builder.ptrtoint(ptr, ir.IntType(64))

    def _make_copy_async(nbytes: int):
        cache = "cg" if nbytes == 16 else "ca"

        @intrinsic
        def copy_async(typingctx, ring, row, half, src, words):
            """cp.async of nbytes from global address src (a row reference) into
            ring[row, 2 * half .. ] (no register holds the data in flight)."""
            def codegen(context, builder, sig, args):
                dst = _shared_address(context, builder, sig, args[:3])
                text = ("{ .reg .u64 s; cvta.to.shared.u64 s, $0; "
                        f"cp.async.{cache}.shared.global [s], [$1], {nbytes}; }}")
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [dst.type, dst.type]), text, "l,l,~{memory}",
                                   side_effect=True)
                builder.call(asm, [dst, context.cast(builder, args[3], sig.args[3], types.int64)])
                return context.get_dummy_value()

            return types.void(ring, row, half, src, words), codegen

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
        def ld_ring(typingctx, ring, row, half):
            """`count` uint32 words of ring[row] from word 2 * half (ld.shared)."""
            def codegen(context, builder, sig, args):
                addr = _shared_address(context, builder, sig, args)
                i32 = ir.IntType(32)
                regs = ", ".join(f"${n}" for n in range(count))
                text = (f"{{ .reg .u64 s; cvta.to.shared.u64 s, ${count}; "
                        f"ld.shared.v{count}.u32 {{{regs}}}, [s]; }}")
                out = ir.LiteralStructType([i32] * count)
                asm = ir.InlineAsm(ir.FunctionType(out, [addr.type]), text, ",".join(["=r"] * count + ["l"])
                                   + ",~{memory}", side_effect=True)
                res = builder.call(asm, [addr])
                vals = [builder.extract_value(res, n) for n in range(count)]
                return context.make_tuple(builder, sig.return_type, vals)

            return types.UniTuple(types.uint32, count)(ring, row, half), codegen

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
    n_acc, halves = CHAINS * n_out, WARPS // 2
    put = mm._make_put(epilogue)

    @cuda.jit(device=True)
    def reduce_warps(acc):
        # Offsets 16, 8, 4 of the butterfly: warp w (< half) adds warp w + half's chains.
        red = cuda.shared.array((halves, n_acc, 32), np.float32)
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        half = WARPS // 2
        while half >= 1:
            if half <= warp < 2 * half:
                for j in range(n_acc):
                    red[warp - half, j, lane] = acc[j]
            cuda.syncthreads()
            if warp < half:
                for j in range(n_acc):
                    acc[j] = acc[j] + red[warp, j, lane]
            cuda.syncthreads()
            half //= 2

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


def _make_async_kernel(variant: FewVariant, group_chunks: int, epilogue: str):
    """The kernel with `variant.stages` steps of weights and scales in flight through cp.async
    into a shared ring (no registers hold them), in_features a multiple of 128 (whole
    4-chunk sets: a warp's step is all there or all past the end)."""
    ft, rt, stages = variant.ftiles, variant.rtiles, variant.stages
    swiglu = epilogue == "swiglu"
    feats_block = ft * (8 if swiglu else 16)
    per_step = max(1, CHAINS // group_chunks)  # scale groups of a warp's step
    piece = piece_bytes(32 * group_chunks)
    gi_div = min(group_chunks, CHAINS)  # chunk i of a step is in the step's group i // gi_div
    w_rows, quads = 2 * ft * THREADS, THREADS // 4
    stage_rows = w_rows + 4 * ft * quads
    ring_rows = stages * stage_rows
    n_out = ft * rt * 4
    n_acc = CHAINS * n_out
    n_w, n_x, n_d, n_sv = 2 * ft * WORDS, rt * CHAINS * 2, 16 * rt, 4 * ft * per_step
    ft2, rt2 = 2 * ft, 2 * rt
    feature = _make_feature(swiglu)
    reduce_warps, store = _make_finish(variant, epilogue)
    copy_w, copy_s = (_copy_async, _copy_async) if SIMULATOR else (_COPIES[16], _COPIES[piece])
    wait = _wait_ring if SIMULATOR else _make_wait(stages - 1)

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
        for j in range(ft):  # pieces t + 4j of the quad
            copy_s(ring, slot + _U(w_rows + (4 * j) * quads) + (tid % _U(4)) * _U(quads) + quad, 0,
                   mm._at(p_refs[j], base // _U(group_chunks)), per_step)
        _commit()

    @cuda.jit(device=True)
    def read(u, ring, wv, sv):
        tid = _U(cuda.threadIdx.x)
        slot = (u % _U(stages)) * _U(stage_rows)
        for r in range(2 * ft):
            wv[4 * r], wv[4 * r + 1], wv[4 * r + 2], wv[4 * r + 3] = _ld_ring4(ring, slot + _U(r * THREADS) + tid)
        quad = tid // _U(4)
        for p in range(4 * ft):
            at = slot + _U(w_rows + p * quads) + quad
            if per_step == 4:
                sv[4 * p], sv[4 * p + 1], sv[4 * p + 2], sv[4 * p + 3] = _ld_ring4(ring, at)
            elif per_step == 2:
                sv[2 * p], sv[2 * p + 1] = _ld_ring2(ring, at, 0)
            else:
                sv[p] = ring[at, 0]

    @cuda.jit(device=True)
    def chunk_math(c, i, wv, xv, dv, sv, acc, live):
        # qdot's chunk step for chunk c, the lane's chain i; scales of piece p (4a + 2h: scale,
        # 4a + 2h + 1: bias of weight row g + 8h of tile a) for the chunk's group gi. live:
        # False past the end (the mma still runs: the simulator's needs every thread).
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
        # As qmma_few_k.
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
                chunk_math(base + _U(i), i, wv, xv, dv, sv, acc, live)
        reduce_warps(acc)
        if warp == 0:
            store(acc, row0, row_end, feat0, out)

    return qmma_few_async_k


_KERNELS: dict[tuple[FewVariant, int, str], object] = {}


def qmma_few_kernel(variant: FewVariant, group_chunks: int, epilogue: str = "store"):
    """The kernel for q4 weights whose scale groups are group_chunks chunks of 32 (1, 2, 4..),
    and epilogue ('store', 'add', 'swiglu')."""
    if group_chunks < 1 or group_chunks & (group_chunks - 1) or epilogue not in mm.EPILOGUES:
        raise ValueError(f"qmma_few: {group_chunks} chunks a group, epilogue {epilogue!r}")
    if variant.stages < 2 or not fits(variant):
        raise ValueError(f"qmma_few: {variant} (a ring of 2+ steps within a block's shared memory)")
    key = (variant, group_chunks, epilogue)
    if key not in _KERNELS:
        _KERNELS[key] = _make_async_kernel(variant, group_chunks, epilogue)
    return _KERNELS[key]


def piece_bytes(group_size: int) -> int:
    """Bytes of one scale piece the ring copies (a warp's step: 4 chunks' groups of a row)."""
    return 4 * max(1, CHAINS // max(1, group_size // 32))


def shared_bytes(variant: FewVariant) -> int:
    """Static shared memory of a block: the cp.async ring (weight words and a 16-byte row a
    scale piece) and the cross-warp sums."""
    ring = variant.stages * (2 * THREADS + THREADS) * variant.ftiles * 16
    sums = (WARPS // 2) * CHAINS * variant.ftiles * variant.rtiles * 4 * 32 * 4
    return ring + sums


def fits(variant: FewVariant) -> bool:
    return shared_bytes(variant) <= SHARED_LIMIT


VARIANT: FewVariant | None = None  # overrides plan() (benchmarks and checks of other variants)


def plan(rows: int) -> FewVariant:
    """One 8-row tile a block (two blocks past 8 rows: a block of two tiles needs twice the
    registers, H100 slower), 16 features a block (more blocks for the SMs at narrow outputs),
    3 steps in the ring."""
    return VARIANT if VARIANT is not None else FewVariant(1, 1)


# Launches of MIN_ROWS .. TAKE_MAX rows that take this kernel when the caller leaves the path
# to the launcher (None: none). One H100, session 23 (benchmarks/bench_qmma.py): at 8 rows
# 1.08-1.11x qdot at 4 of 5 Qwen3-8B/27B shapes (0.95x at 8B's down), at 4 rows and at 1
# row slower; at 16 rows qmma's wide tiles (WIDE_ROWS_MIN) do better. In the engine
# (bench_qwen35_gpu.py --streams 8, side by side): 27B 400 -> 443 tok/s, 35B-A3B 816 -> 885.
MIN_ROWS: int | None = 5
TAKE_MAX = 8


def supports(kind: str, rows: int, in_features: int, group_size: int) -> bool:
    """Whether a launch can take this kernel: q4 words, 1..16 rows, whole 4-chunk sets
    (in_features a multiple of 128: a warp's step is all there or all past the end), groups
    of 1, 2, 4.. whole chunks."""
    chunks = group_size // 32
    if kind != "q4" or not 1 <= rows <= MAX_ROWS or in_features % 128 or group_size % 32:
        return False
    return chunks & (chunks - 1) == 0 and in_features % group_size == 0 and fits(plan(rows))


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
