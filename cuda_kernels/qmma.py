"""Affine 4/8-bit matmul on int8 x on the tensor cores: the bits of cuda_kernels/qdot.py's
kernel, row for row, at any number of rows.

Why the bits agree: qdot's output out[r, o] is the butterfly sum (offsets 16, 8, 4, 2, 1) of 32
partial sums, partial p being the ordered chain over chunks c = p, p + 32, p + 64, ...:
    acc = fma(s * d, float(isum), acc); acc = fma(b, e, acc)
where isum = sum(q * xi) over the chunk's 32 elements is an exact integer. Here isum comes from
`mma.sync.m16n8k32` (u8 codes x s8 x, int32 sums: exact, so the same integer), and the same
float operations run in the same order:
- a block has 4 warps; warp w takes the partials p with p % 4 == w (chunks c with c % 4 == w),
  all 4 warps for the same outputs;
- a warp's 8 partials p = w + 4j are "sets" j = 0..7, run one after the other in the order
  0, 4, 2, 6, 1, 5, 3, 7 and merged as they end exactly as the butterfly's first three steps
  merge them (offsets 16, 8, 4 pair set j with j ^ 4, j ^ 2, j ^ 1):
      T_w = ((S0 + S4) + (S2 + S6)) + ((S1 + S5) + (S3 + S7)),
  so a thread holds at most 4 sums an output at a time;
- the last two steps (offsets 2 and 1) pair the warps through shared memory:
      out = (T_0 + T_2) + (T_1 + T_3).
Float addition is commutative bit for bit, so these are the butterfly's very additions.

Fragments (PTX ISA, mma.m16n8k32 with 8-bit types; lane = 4g + t): A (16 features x 32 k)
a0, a2: feature row g, k 4t..4t+3 and 16+4t..16+4t+3; a1, a3: row g + 8. B (32 k x 8 rows)
b0, b1: x row g, the same k. C: c0, c1 feature g, x rows 2t, 2t+1; c2, c3 feature g + 8.
The k order inside a chunk is free (the sum is exact): for q4, k 4t.. are the even codes of the
chunk's weight word t (w & 0x0F0F0F0F) and k 16+4t.. its odd codes, which pair with int8 x
words 2t and 2t+1 (quantize_rows stores x per 8 elements as x0 x2 x4 x6 x1 x3 x5 x7); for q8,
weight and x words t and 4 + t. So a lane loads one (q4) or two (q8) words of a feature's chunk
and two words of a row's chunk, all in the layouts the other kernels use.

Tiles: a block covers `ftiles` 16-feature tiles (for 'swiglu': 8 gate rows then the 8 up rows
of the same 8 outputs) by `rtiles` 8-row tiles; a set's chunks are loaded `unroll` at a time
before their math. None of it changes a bit.

Expert-grouped rows (MoE, `grouped=True`): the rows come sorted by expert and a table gives
each block (expert, first row, end row), a run of at most 8 * rtiles rows of one expert
(cuda_kernels/expert_tiles.py); the block multiplies them by that expert's weights. Each row is still
computed as above, so it gets qdot's bits whichever block, expert run or row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuda_kernels import matmul as mm
from cuda_kernels import qdot as qd
from cuda_kernels.env import SIMULATOR, cuda, kernel

PARTS = 4  # warps a block: warp w takes the chunks c with c % 4 == w
THREADS = 32 * PARTS
TILE_ROWS = 8  # x rows a tile (mma n)
TILE_FEATS = 16  # weight rows a tile (mma m)
_NIB = np.uint32(0x0F0F0F0F)
_SIM_THREADS = 256  # threads a block of the kernels that call the simulator's mma (qmma_few: 256)


@dataclass(frozen=True, slots=True)
class MmaVariant:
    """Compile-time shape of one kernel; none of it changes a row's bits."""

    ftiles: int  # 16-feature tiles a block
    rtiles: int  # 8-row tiles a block
    unroll: int  # chunks of a set loaded together


if SIMULATOR:

    def _byte(word, i, signed):
        v = (int(word) >> (8 * i)) & 0xFF
        return v - 256 if signed and v >= 128 else v

    @cuda.jit(device=True)
    def _mma(a0, a1, a2, a3, b0, b1):
        # The warp's fragments through shared memory (every thread of the block calls, in
        # uniform flow), then each lane's four int32 sums as the tensor core forms them.
        buf = cuda.shared.array((_SIM_THREADS, 6), np.uint32)
        tid = cuda.threadIdx.x
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            buf[tid, i] = v
        cuda.syncthreads()
        base, lane = tid - tid % 32, tid % 32
        g, t = lane // 4, lane % 4
        sums = []
        for m, n in ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)):
            total = 0
            for tt in range(4):
                arow, brow = base + 4 * (m % 8) + tt, base + 4 * n + tt
                lo, hi = (0, 2) if m < 8 else (1, 3)
                for i in range(4):
                    total += _byte(buf[arow, lo], i, False) * _byte(buf[brow, 4], i, True)
                    total += _byte(buf[arow, hi], i, False) * _byte(buf[brow, 5], i, True)
            sums.append(np.int32(total))
        cuda.syncthreads()
        return sums[0], sums[1], sums[2], sums[3]

    _ld_w = mm._ld_u32

    @cuda.jit(device=True)
    def _ld_x2(row, i):
        return row[i], row[i + 1]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _mma(typingctx, a0, a1, a2, a3, b0, b1):
        """mma.sync.aligned.m16n8k32 u8 x s8 -> s32 with a zero accumulator: this lane's
        (c0, c1, c2, c3)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            ins = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args, strict=True)]
            zero = ir.Constant(i32, 0)
            text = ("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0,$1,$2,$3}, "
                    "{$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
            out = ir.LiteralStructType([i32] * 4)
            asm = ir.InlineAsm(ir.FunctionType(out, [i32] * 10), text, ",".join(["=r"] * 4 + ["r"] * 10))
            res = builder.call(asm, [*ins, zero, zero, zero, zero])
            vals = [builder.extract_value(res, n) for n in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)

        return types.UniTuple(types.int32, 4)(a0, a1, a2, a3, b0, b1), codegen

    _ld_w = mm._asm_load("ld.global.nc.u32", 1, "r", types.uint32)  # through L1: the block's
    # 4 warps read the 4 quarters of 64 contiguous bytes of a feature
    _ld_x2 = mm._asm_load("ld.global.nc.v2.u32", 2, "r", types.UniTuple(types.uint32, 2))


@cuda.jit(device=True)
def chunk_fma(acc, o, s0, bias0, s1, bias1, d0, e0, d1, e1, i0, i1, i2, i3):
    """qdot's chunk step for the 4 C elements of one mma tile, acc[o .. o + 3] (features g,
    g + 8 by x rows 2t, 2t + 1; their scales s0/bias0, s1/bias1; the rows' d, e):
    acc = fma(s * d, float(isum), acc); acc = fma(b, e, acc)."""
    acc[o] = cuda.fma(s0 * d0, np.float32(i0), acc[o])
    acc[o] = cuda.fma(bias0, e0, acc[o])
    acc[o + 1] = cuda.fma(s0 * d1, np.float32(i1), acc[o + 1])
    acc[o + 1] = cuda.fma(bias0, e1, acc[o + 1])
    acc[o + 2] = cuda.fma(s1 * d0, np.float32(i2), acc[o + 2])
    acc[o + 2] = cuda.fma(bias1, e0, acc[o + 2])
    acc[o + 3] = cuda.fma(s1 * d1, np.float32(i3), acc[o + 3])
    acc[o + 3] = cuda.fma(bias1, e1, acc[o + 3])


def _make_refs(variant: MmaVariant, swiglu: bool):
    ft, rt = variant.ftiles, variant.rtiles

    @cuda.jit(device=True)
    def refs(xq, xs, w, scales, biases, row0, last_row, expert, feat0, x_refs, xs_refs, w_refs,
             s_refs, b_refs):
        # Row references (clamped: rows past last_row and features past the end are computed
        # on a copy of the last one and not stored). x_refs[b]: B's x row g of row tile b;
        # xs_refs[2b + h]: the chunk scales of C's x row 2t + h; w/s/b_refs[2a + h]: A's
        # feature row g + 8h of expert `expert`.
        lane = cuda.threadIdx.x % 32
        g, t = lane // 4, lane % 4
        for b in range(rt):
            x_refs[b] = mm._row2(xq, min(row0 + TILE_ROWS * b + g, last_row))
            for h in range(2):
                xs_refs[2 * b + h] = mm._row2(xs, min(row0 + TILE_ROWS * b + 2 * t + h, last_row))
        for a in range(ft):
            for h in range(2):
                if swiglu:  # rows 0..7 gate features, rows 8..15 the up rows of the same outputs
                    inter = w.shape[1] // 2
                    feat = min(feat0 + 8 * a + g, inter - 1) + (inter if h else 0)
                else:
                    feat = min(feat0 + TILE_FEATS * a + g + 8 * h, w.shape[1] - 1)
                w_refs[2 * a + h] = mm._row3(w, expert, feat)
                s_refs[2 * a + h] = mm._row3(scales, expert, feat)
                b_refs[2 * a + h] = mm._row3(biases, expert, feat)

    return refs


def _make_load(kind: str, variant: MmaVariant):
    ft, rt = variant.ftiles, variant.rtiles
    q4, wpc = kind == "q4", qd.WORDS_PER_CHUNK[kind]
    a_words = 1 if q4 else 2  # words a lane loads of a feature's chunk

    @cuda.jit(device=True)
    def load(c, x_refs, w_refs, av, bv):
        # Chunk c: av[(2a + h) * a_words + i] the lane's weight words, bv[2b + i] its x words.
        t = cuda.threadIdx.x % 4
        for a in range(ft):
            for h in range(2):
                at = mm._at(w_refs[2 * a + h], c * wpc)
                if q4:
                    av[2 * a + h] = _ld_w(at, t)
                else:
                    av[2 * (2 * a + h)], av[2 * (2 * a + h) + 1] = _ld_w(at, t), _ld_w(at, 4 + t)
        for b in range(rt):
            at = mm._at(x_refs[b], c * 8)  # 8 words of int8 x a chunk
            if q4:
                bv[2 * b], bv[2 * b + 1] = _ld_x2(at, 2 * t)
            else:
                bv[2 * b], bv[2 * b + 1] = _ld_w(at, t), _ld_w(at, 4 + t)

    return load, 2 * ft * a_words, 2 * rt


def _make_math(kind: str, variant: MmaVariant, group_chunks: int):
    ft, rt = variant.ftiles, variant.rtiles
    q4 = kind == "q4"

    @cuda.jit(device=True)
    def math(c, av, bv, xs_refs, s_refs, b_refs, sv, acc, live):
        # qdot's chunk step for every output of the lane: acc[(a * rt + b) * 4 + k] is C's
        # element k of tiles (a, b). live: False only for the simulator's stand-in mma.
        group = c // group_chunks
        for i in range(2 * ft):
            sv[2 * i], sv[2 * i + 1] = mm._ld_f32(s_refs[i], group), mm._ld_f32(b_refs[i], group)
        for b in range(rt):
            d0, e0 = mm._ld_f32x2(xs_refs[2 * b], 2 * c)
            d1, e1 = mm._ld_f32x2(xs_refs[2 * b + 1], 2 * c)
            for a in range(ft):
                if q4:
                    w0, w1 = av[2 * a], av[2 * a + 1]
                    i0, i1, i2, i3 = _mma(w0 & _NIB, w1 & _NIB, (w0 >> np.uint32(4)) & _NIB,
                                          (w1 >> np.uint32(4)) & _NIB, bv[2 * b], bv[2 * b + 1])
                else:
                    i0, i1, i2, i3 = _mma(av[4 * a], av[4 * a + 2], av[4 * a + 1], av[4 * a + 3],
                                          bv[2 * b], bv[2 * b + 1])
                if not live:
                    continue
                o = (a * rt + b) * 4
                s0, bias0, s1, bias1 = sv[4 * a], sv[4 * a + 1], sv[4 * a + 2], sv[4 * a + 3]
                chunk_fma(acc, o, s0, bias0, s1, bias1, d0, e0, d1, e1, i0, i1, i2, i3)

    return math


def _make_set_sum(kind: str, variant: MmaVariant, group_chunks: int):
    unroll, n_out = variant.unroll, variant.ftiles * variant.rtiles * 4
    load, na, nb = _make_load(kind, variant)
    math = _make_math(kind, variant, group_chunks)

    @cuda.jit(device=True)
    def set_sum(j, chunks, x_refs, xs_refs, w_refs, s_refs, b_refs, work, acc):
        # acc = the chain of set j of this warp: chunks w + 4j, w + 4j + 32, ... ascending;
        # `unroll` of them loaded before their math.
        av, bv, sv = work
        for o in range(n_out):
            acc[o] = np.float32(0.0)
        warp = cuda.threadIdx.x // 32
        c = warp + 4 * j
        lead = c - warp if SIMULATOR else c  # the simulator's mma needs the 4 warps in step
        while lead < chunks:
            for u in range(unroll):
                if c + 32 * u < chunks:
                    load(c + 32 * u, x_refs, w_refs, av[u * na :], bv[u * nb :])
            for u in range(unroll):
                if c + 32 * u < chunks:
                    math(c + 32 * u, av[u * na :], bv[u * nb :], xs_refs, s_refs, b_refs, sv, acc, True)
                elif SIMULATOR and lead + 32 * u < chunks:  # an mma for the other warps' sake
                    math(chunks - 1, av[u * na :], bv[u * nb :], xs_refs, s_refs, b_refs, sv, acc, False)
            c += 32 * unroll
            lead += 32 * unroll

    return set_sum, na, nb


def _make_store(variant: MmaVariant, epilogue: str):
    rt, n_out = variant.rtiles, variant.ftiles * variant.rtiles * 4
    swiglu = epilogue == "swiglu"
    put = mm._make_put(epilogue)
    shape = (PARTS, n_out, 32)

    @cuda.jit(device=True)
    def total_of(buf, o, lane):
        return (buf[0, o, lane] + buf[2, o, lane]) + (buf[1, o, lane] + buf[3, o, lane])

    @cuda.jit(device=True)
    def store(tot, row0, row_end, feat0, out):
        # The butterfly's last two steps over the warps, then the epilogue.
        buf = cuda.shared.array(shape, np.float32)
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        for o in range(n_out):
            buf[warp, o, lane] = tot[o]
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, n_out * 32, THREADS):
            o, ln = i // 32, i % 32
            k, tile = o % 4, o // 4
            a, b = tile // rt, tile % rt
            m, row = ln // 4 + 8 * (k // 2), row0 + TILE_ROWS * b + 2 * (ln % 4) + k % 2
            if swiglu and m >= 8:
                continue
            total = total_of(buf, o, ln)
            up_total = total_of(buf, o + 2, ln) if swiglu else total
            feat = feat0 + (8 * a + m if swiglu else TILE_FEATS * a + m)
            if row < row_end and feat < out.shape[1]:
                put(out, row, feat, total, up_total)

    return store


def _make_kernel(kind: str, variant: MmaVariant, group_chunks: int, epilogue: str, grouped: bool):
    ft, rt, unroll = variant.ftiles, variant.rtiles, variant.unroll
    n_out, wpc = ft * rt * 4, qd.WORDS_PER_CHUNK[kind]
    feats_block = ft * (8 if epilogue == "swiglu" else TILE_FEATS)
    refs = _make_refs(variant, epilogue == "swiglu")
    set_sum, na, nb = _make_set_sum(kind, variant, group_chunks)
    store = _make_store(variant, epilogue)
    rt2, ft2, ft4, a_slots, b_slots = 2 * rt, 2 * ft, 4 * ft, unroll * na, unroll * nb

    @cuda.jit(device=True)
    def add_into(dst, a, b):
        for o in range(n_out):
            dst[o] = a[o] + b[o]

    @cuda.jit(device=True)
    def block_sum(xq, xs, w, scales, biases, row0, row_end, expert, feat0, out):
        x_refs = cuda.local.array(rt, mm._REF)
        xs_refs = cuda.local.array(rt2, mm._REF)
        w_refs = cuda.local.array(ft2, mm._REF)
        s_refs = cuda.local.array(ft2, mm._REF)
        b_refs = cuda.local.array(ft2, mm._REF)
        refs(xq, xs, w, scales, biases, row0, row_end - 1, expert, feat0, x_refs, xs_refs, w_refs,
             s_refs, b_refs)
        work = (cuda.local.array(a_slots, np.uint32), cuda.local.array(b_slots, np.uint32),
                cuda.local.array(ft4, np.float32))
        cur = cuda.local.array(n_out, np.float32)
        l0 = cuda.local.array(n_out, np.float32)
        l1 = cuda.local.array(n_out, np.float32)
        l2 = cuda.local.array(n_out, np.float32)
        chunks = w.shape[2] // wpc
        args = (chunks, x_refs, xs_refs, w_refs, s_refs, b_refs, work)
        set_sum(0, *args, l0)
        set_sum(4, *args, cur)
        add_into(l1, l0, cur)  # S0 + S4
        set_sum(2, *args, l0)
        set_sum(6, *args, cur)
        add_into(cur, l0, cur)  # S2 + S6
        add_into(l2, l1, cur)  # (S0 + S4) + (S2 + S6)
        set_sum(1, *args, l0)
        set_sum(5, *args, cur)
        add_into(l1, l0, cur)  # S1 + S5
        set_sum(3, *args, l0)
        set_sum(7, *args, cur)
        add_into(cur, l0, cur)  # S3 + S7
        add_into(cur, l1, cur)  # (S1 + S5) + (S3 + S7)
        add_into(cur, l2, cur)  # T_w
        store(cur, row0, row_end, feat0, out)

    if grouped:
        @kernel
        def qmma_grouped_k(xq, xs, w, scales, biases, tiles, out):
            # As qmma_k, rows sorted by expert; tiles: [blocks, 3] int32 (expert, first row,
            # end row) of each row block (an empty run: nothing to do).
            tile = cuda.blockIdx.x
            expert, row0, row_end = tiles[tile, 0], tiles[tile, 1], tiles[tile, 2]
            if row0 >= row_end:
                return
            block_sum(xq, xs, w, scales, biases, row0, row_end, expert,
                      cuda.blockIdx.y * feats_block, out)

        return qmma_grouped_k

    @kernel
    def qmma_k(xq, xs, w, scales, biases, out):
        # xq: [rows, K / 4] u32 (int8 x, quantize_rows' order); xs: [rows, 2 * K / 32] f32;
        # w: [1, out_f, K * bits / 32] u32; scales/biases: [1, out_f, groups] f32;
        # out: [rows, out_f] f32 (swiglu: w's rows / 2; add: updated in place).
        block_sum(xq, xs, w, scales, biases, cuda.blockIdx.x * TILE_ROWS * rt, xq.shape[0], 0,
                  cuda.blockIdx.y * feats_block, out)

    return qmma_k


_KERNELS: dict[tuple[str, MmaVariant, int, str, bool], object] = {}


def qmma_kernel(kind: str, variant: MmaVariant, group_chunks: int, epilogue: str = "store",
                grouped: bool = False):
    """The kernel for affine `kind` ('q4', 'q8'), `variant`, group_chunks chunks of 32 a scale
    group, and epilogue ('store', 'add', 'swiglu'); grouped: rows sorted by expert, with a
    table of row blocks (cuda_kernels/expert_tiles.py)."""
    if kind not in qd.WORDS_PER_CHUNK or group_chunks < 1:
        raise ValueError(f"qmma: kind {kind!r}, {group_chunks} chunks a group")
    if epilogue not in mm.EPILOGUES:
        raise ValueError(f"qmma: epilogue {epilogue!r}")
    key = (kind, variant, group_chunks, epilogue, grouped)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(kind, variant, group_chunks, epilogue, grouped)
    return _KERNELS[key]


FEW_ROWS_MAX = 16  # up to here qdot's many-rows kernel is the faster one (H200, bench_qmma.py)
MID_ROWS_MAX = 32  # up to here 32 features by 16 rows a block; beyond, 32 by 32
LONG_K = 8192  # in_features past which qdot is faster up to MID_ROWS_MAX rows


# Launches of WIDE_ROWS_MIN .. FEW_ROWS_MAX rows with at least WIDE_OUT outputs (and
# in_features <= LONG_K) taking this kernel too; None: off. One H100, session 22: at 16 rows
# and 24576 / 34816 outputs 1.25-1.3x faster than qdot, at 8 rows slower; not yet measured
# in an engine round (benchmarks/bench_qwen35_gpu.py --qmma-wide-rows 16 is the A/B).
WIDE_ROWS_MIN: int | None = None
WIDE_OUT = 16384


def takes(rows: int, in_features: int, out_features: int) -> bool:
    """Whether a launch of `rows` rows goes to this kernel rather than qdot's (same bits
    either way; H200 timings of benchmarks/bench_qmma.py, docs/PERFORMANCE.md)."""
    if (WIDE_ROWS_MIN is not None and WIDE_ROWS_MIN <= rows <= FEW_ROWS_MAX
            and out_features >= WIDE_OUT and in_features <= LONG_K):
        return True
    return rows > MID_ROWS_MAX or (rows > FEW_ROWS_MAX and in_features <= LONG_K)


def plan(rows: int) -> MmaVariant:
    """The variant of a launch (none changes a row's bits; the fastest measured on an H200 at
    the Qwen3-8B shapes): 32 features by 16 rows a block for batches of decode or verify rows,
    32 by 32 for prompt steps."""
    if rows <= MID_ROWS_MAX:
        return MmaVariant(2, 2, 2)
    return MmaVariant(2, 4, 2)


def launch_shape(rows: int, out_features: int, variant: MmaVariant, epilogue: str = "store"
                 ) -> tuple[tuple[int, int], int]:
    """(grid, block): grid (row blocks, feature blocks); out_features: the output's columns."""
    per_block = variant.ftiles * (8 if epilogue == "swiglu" else TILE_FEATS)
    row_block = TILE_ROWS * variant.rtiles
    return ((rows + row_block - 1) // row_block, (out_features + per_block - 1) // per_block), THREADS


GROUPED_VARIANT = MmaVariant(2, 2, 2)  # 16 rows a block: an expert's run of slots is short
