"""Affine 4-bit matmul of a few int8-x rows (1 to 16: decode rounds of several streams, verify
rows) on the tensor cores, with the bits of cuda_kernels/qdot.py, row for row.

Why a kernel of its own: at a few rows the weights are all the bytes, so the launch must stream
them at the memory's rate. cuda_kernels/qmma.py (built for prompt steps) loads 4 bytes of a
feature a lane and a scale per feature and chunk straight from global memory: at 8 rows an H100
spent its time in L1 wavefronts (90% busy, 11 of 32 bytes a sector used) at 0.9 TB/s. Here
a lane loads 16 contiguous bytes of a feature (4 chunks), the 4 lanes of a quad swap words so
that each holds its mma fragment of each chunk, and a block stages its features' scales and
biases in shared memory once.

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
same 8 outputs) by `rtiles` 8-row tiles. Shared memory: the block's scales and biases for
every group (so in_features is bounded, see fits()) and the cross-warp sums.
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
    ahead: int = 2  # steps of weight words in flight (1 or 2)
    max_registers: int = 0  # a cap for the compiler (0: none): 64 lets 4 blocks share an SM


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


@cuda.jit(device=True)
def _pair(scale, bias):
    """A weight row's (scale, bias) of one group as one 8-byte shared entry (one load)."""
    lo = np.uint64(np.uint32(float_as_int(scale)))
    return lo | (np.uint64(np.uint32(float_as_int(bias))) << np.uint64(32))


@cuda.jit(device=True)
def _unpair(v):
    return mm._bits_f32(v & np.uint64(0xFFFFFFFF)), mm._bits_f32(v >> np.uint64(32))


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


def _make_kernel(variant: FewVariant, group_chunks: int, groups: int, epilogue: str):
    ft, rt, ahead = variant.ftiles, variant.rtiles, variant.ahead
    swiglu = epilogue == "swiglu"
    feats_block = ft * (8 if swiglu else 16)
    mrows = 16 * ft  # mma rows (weight rows) a block
    srow = mrows + 1  # entries of one group in shared: (scale, bias) a weight row, padded
    sh_size, ft2, rt2 = groups * srow, 2 * ft, 2 * rt
    # scales of a step's 4 chunks: one read a group (a group of 2 chunks: chunks 0, 2)
    scale_every = min(group_chunks, CHAINS) if CHAINS % min(group_chunks, CHAINS) == 0 else 1
    n_out = ft * rt * 4  # C elements a lane, a chain
    n_acc = CHAINS * n_out
    n_w, n_x = 2 * ft * WORDS, rt * CHAINS * 2  # words a lane loads a step
    n_d, n_s = 16 * rt, 4 * ft  # x scales of a step, weight scales of a group
    feature = _make_feature(swiglu)

    per_row = THREADS // mrows  # threads staging one weight row's scales

    @cuda.jit(device=True)
    def stage_scales(scales, biases, feat0, n_feat, sh):
        # per_row threads a weight row, consecutive groups (coalesced); unsigned indices
        # throughout the hot code: no negative-index wraparound.
        tid = _U(cuda.threadIdx.x)
        f = tid // _U(per_row)
        row = feature(f // _U(16), f % _U(16), feat0, n_feat)
        for grp in range(tid % _U(per_row), _U(groups), _U(per_row)):
            sh[grp * _U(srow) + f] = _pair(scales[0, row, grp], biases[0, row, grp])
        cuda.syncthreads()

    @cuda.jit(device=True)
    def load_w(base, last, w_refs, wv):
        # wv[(2a + h) * 4 + k] = word k of chunk min(base + t, last) of the lane's weight row
        # (2a + h): base = 32u + 4w at step u (past the end: the last chunk, not used).
        mine = min(base + _U(cuda.threadIdx.x % 4), last)
        for r in range(2 * ft):
            at = mm._at(w_refs[r], mine * _U(WORDS))
            wv[4 * r], wv[4 * r + 1], wv[4 * r + 2], wv[4 * r + 3] = mm._ld_u32x4(at, 0)

    @cuda.jit(device=True)
    def load_x(base, last, x_refs, xv):
        # xv[(b * 4 + i) * 2 + j] = word 2t + j of chunk min(base + i, last) of the lane's x
        # row in tile b (through L1: every block reads the same few rows).
        t2 = _U(2) * _U(cuda.threadIdx.x % 4)
        for b in range(rt):
            for i in range(CHAINS):
                at = mm._at(x_refs[b], min(base + _U(i), last) * _U(8))
                xv[(b * 4 + i) * 2], xv[(b * 4 + i) * 2 + 1] = qm._ld_x2(at, t2)

    @cuda.jit(device=True)
    def chunk_math(c, i, wv, xv, dv, sv, sh, acc, live):
        # qdot's chunk step for chunk c (uint32), the lane's chain i, every output of the
        # lane; dv[(2b + h) * 8 + 2i + j]: (d, e) of the chunk of the lane's x row 2t + h.
        if i % scale_every == 0:
            s_at = (c // _U(group_chunks)) * _U(srow) + _U(cuda.threadIdx.x % 32 // 4)
            for r in range(2 * ft):
                sv[2 * r], sv[2 * r + 1] = _unpair(sh[s_at + _U(8 * r)])
        for b in range(rt):
            d0, e0 = dv[16 * b + 2 * i], dv[16 * b + 2 * i + 1]
            d1, e1 = dv[16 * b + 8 + 2 * i], dv[16 * b + 8 + 2 * i + 1]
            for a in range(ft):
                w0, w1 = wv[8 * a + i], wv[8 * a + 4 + i]
                i0, i1, i2, i3 = qm._mma(w0 & _NIB, w1 & _NIB, (w0 >> np.uint32(4)) & _NIB,
                                         (w1 >> np.uint32(4)) & _NIB, xv[(b * 4 + i) * 2],
                                         xv[(b * 4 + i) * 2 + 1])
                if live:
                    s0, bias0, s1, bias1 = sv[4 * a], sv[4 * a + 1], sv[4 * a + 2], sv[4 * a + 3]
                    o = i * n_out + (a * rt + b) * 4
                    acc[o] = cuda.fma(s0 * d0, np.float32(i0), acc[o])
                    acc[o] = cuda.fma(bias0, e0, acc[o])
                    acc[o + 1] = cuda.fma(s0 * d1, np.float32(i1), acc[o + 1])
                    acc[o + 1] = cuda.fma(bias0, e1, acc[o + 1])
                    acc[o + 2] = cuda.fma(s1 * d0, np.float32(i2), acc[o + 2])
                    acc[o + 2] = cuda.fma(bias1, e0, acc[o + 2])
                    acc[o + 3] = cuda.fma(s1 * d1, np.float32(i3), acc[o + 3])
                    acc[o + 3] = cuda.fma(bias1, e1, acc[o + 3])

    @cuda.jit(device=True)
    def load_scales_x(base, xs_refs, dv):
        # dv[(2b + h) * 8 + 2i + j]: x scale j of chunk base + i of the lane's x row 2t + h
        # (a whole step: the 4 chunks' 8 floats are contiguous, two 16-byte loads)
        for r in range(2 * rt):
            dv[8 * r], dv[8 * r + 1], dv[8 * r + 2], dv[8 * r + 3] = mm._ld_f32x4(xs_refs[r], _U(2) * base)
            dv[8 * r + 4], dv[8 * r + 5], dv[8 * r + 6], dv[8 * r + 7] = mm._ld_f32x4(
                xs_refs[r], _U(2) * base + _U(4))

    @cuda.jit(device=True)
    def step(base, chunks, wv, xv, dv, sv, x_refs, xs_refs, sh, acc, tail):
        # One step's x loads, quad swaps and 4 chunks (tail: the last, partial step)
        last = chunks - _U(1)
        load_x(base, last, x_refs, xv)
        t = _U(cuda.threadIdx.x % 4)
        for r in range(2 * ft):
            _quad_transpose(wv, 4 * r, t)
        if tail:  # chunks past the end: the last one's values, not used
            for i in range(CHAINS):
                c = min(base + _U(i), last)
                for r in range(2 * rt):
                    dv[8 * r + 2 * i], dv[8 * r + 2 * i + 1] = mm._ld_f32x2(xs_refs[r], _U(2) * c)
                chunk_math(c, i, wv, xv, dv, sv, sh, acc, base + _U(i) <= last)
        else:
            load_scales_x(base, xs_refs, dv)
            for i in range(CHAINS):
                chunk_math(base + _U(i), i, wv, xv, dv, sv, sh, acc, True)

    reduce_warps, store = _make_finish(variant, epilogue)

    options = {"max_registers": variant.max_registers} if variant.max_registers and not SIMULATOR else {}

    @kernel(**options)
    def qmma_few_k(xq, xs, w, scales, biases, out):
        # xq: [rows, K / 4] u32 (int8 x, quantize_rows' order); xs: [rows, 2 * K / 32] f32;
        # w: [1, out_f, K / 8] u32; scales/biases: [1, out_f, groups] f32; out: [rows, out_f]
        # f32 (swiglu: w's rows / 2; add: updated in place). Grid (row blocks, feature blocks).
        sh = cuda.shared.array(sh_size, np.uint64)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        row0, row_end = cuda.blockIdx.x * 8 * rt, xq.shape[0]
        feat0, n_feat = cuda.blockIdx.y * feats_block, w.shape[1]
        w_refs = cuda.local.array(ft2, mm._REF)
        x_refs = cuda.local.array(rt, mm._REF)
        xs_refs = cuda.local.array(rt2, mm._REF)
        for a in range(ft):
            for h in range(2):
                w_refs[2 * a + h] = mm._row3(w, 0, feature(a, g + 8 * h, feat0, n_feat))
        for b in range(rt):
            x_refs[b] = mm._row2(xq, min(row0 + 8 * b + g, row_end - 1))
            for h in range(2):
                xs_refs[2 * b + h] = mm._row2(xs, min(row0 + 8 * b + 2 * t + h, row_end - 1))
        acc = cuda.local.array(n_acc, np.float32)
        for j in range(n_acc):
            acc[j] = np.float32(0.0)
        wv = cuda.local.array(n_w, np.uint32)
        xv = cuda.local.array(n_x, np.uint32)
        wn = cuda.local.array(n_w, np.uint32)  # step u + 1
        wn2 = cuda.local.array(n_w, np.uint32)  # step u + 2 (ahead 2)
        dv = cuda.local.array(n_d, np.float32)
        sv = cuda.local.array(n_s, np.float32)
        chunks = _U(w.shape[2] // WORDS)
        steps, full = (chunks + _U(STEP - 1)) // _U(STEP), chunks // _U(STEP)
        last, base0 = chunks - _U(1), _U(CHAINS) * _U(warp)
        load_w(base0, last, w_refs, wn)  # in flight while the scales are staged
        if ahead == 2:
            load_w(base0 + _U(STEP), last, w_refs, wn2)
        stage_scales(scales, biases, feat0, n_feat, sh)
        for u in range(steps):
            base = _U(STEP) * _U(u) + base0
            for j in range(n_w):
                wv[j] = wn[j]
            if ahead == 2:
                for j in range(n_w):
                    wn[j] = wn2[j]
                if _U(u) + _U(2) < steps:
                    load_w(base + _U(2 * STEP), last, w_refs, wn2)
            elif _U(u) + _U(1) < steps:
                load_w(base + _U(STEP), last, w_refs, wn)
            if _U(u) < full:
                step(base, chunks, wv, xv, dv, sv, x_refs, xs_refs, sh, acc, False)
            else:
                step(base, chunks, wv, xv, dv, sv, x_refs, xs_refs, sh, acc, True)
        reduce_warps(acc)
        if warp == 0:
            store(acc, row0, row_end, feat0, out)

    return qmma_few_k


_KERNELS: dict[tuple[FewVariant, int, int, str], object] = {}


def qmma_few_kernel(variant: FewVariant, group_chunks: int, groups: int, epilogue: str = "store"):
    """The kernel for q4 weights of `groups` scale groups a row, each group_chunks chunks of
    32, and epilogue ('store', 'add', 'swiglu')."""
    if group_chunks < 1 or groups < 1 or epilogue not in mm.EPILOGUES:
        raise ValueError(f"qmma_few: {group_chunks} chunks a group, {groups} groups, epilogue {epilogue!r}")
    if not fits(variant, groups):
        raise ValueError(f"qmma_few: {groups} groups of scales do not fit a block's shared memory")
    key = (variant, group_chunks, groups, epilogue)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(variant, group_chunks, groups, epilogue)
    return _KERNELS[key]


def shared_bytes(variant: FewVariant, groups: int) -> int:
    """Static shared memory of a block: staged scales and the cross-warp sums."""
    scales = groups * (16 * variant.ftiles + 1) * 8
    sums = (WARPS // 2) * CHAINS * variant.ftiles * variant.rtiles * 4 * 32 * 4
    return scales + sums


def fits(variant: FewVariant, groups: int) -> bool:
    return shared_bytes(variant, groups) <= SHARED_LIMIT


def plan(rows: int) -> FewVariant:
    """One 8-row tile a block (two blocks past 8 rows: a block of two tiles needs twice the
    registers, H100 slower), 16 features a block (more blocks for the SMs at narrow outputs),
    two steps of weights in flight."""
    return FewVariant(1, 1)


# Launches of MIN_ROWS .. MAX_ROWS rows that take this kernel when the caller leaves the path
# to the launcher; None: none (until measured against qdot in an engine round).
MIN_ROWS: int | None = None


def supports(kind: str, rows: int, in_features: int, group_size: int) -> bool:
    """Whether a launch can take this kernel: q4 words, 1..16 rows, whole 16-byte x-scale rows
    (in_features a multiple of 64), whole chunks a group, the scales fitting shared memory."""
    if kind != "q4" or not 1 <= rows <= MAX_ROWS or in_features % 64 or group_size % 32:
        return False
    return in_features % group_size == 0 and fits(plan(rows), in_features // group_size)


def takes(kind: str, rows: int, in_features: int, group_size: int) -> bool:
    """Whether a launch left to the launcher goes to this kernel (same bits as qdot's)."""
    return MIN_ROWS is not None and rows >= MIN_ROWS and supports(kind, rows, in_features, group_size)


def launch_shape(rows: int, out_features: int, variant: FewVariant, epilogue: str = "store"
                 ) -> tuple[tuple[int, int], int]:
    """(grid, block): grid (row blocks, feature blocks); out_features: the output's columns."""
    per_block = variant.ftiles * (8 if epilogue == "swiglu" else 16)
    rows_block = 8 * variant.rtiles
    return ((rows + rows_block - 1) // rows_block, (out_features + per_block - 1) // per_block), THREADS
