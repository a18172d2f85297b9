"""Matmuls out = x @ W.T for dense f32, dense bf16 (uint16 bits) and affine 4/8-bit weights
on float32 x, plus the affine embedding gather. (Affine weights whose scale groups are whole
chunks of 32 multiply int8 x instead: cuda_kernels/qdot.py, chosen per weight by
launch.uses_int8_x; this module's affine kernels serve the others.)

Weights are read as 32-bit words: f32 (1 value a word), bf16 (2: element 2w in the low
half), affine 4-bit (8 codes, LSB first) and 8-bit (4 codes). Every array carries a leading
expert axis `[E, out, ...]` (E = 1 for a plain linear); `grouped` kernels pick the expert of
each row from `expert_ids` (MoE dispatch without a host round trip).

Reduction order of out[r, o] (the same in every variant below, so a row's bits do not depend
on the rows sharing the launch, the rows per block, the features per warp or the path):
  lane l of one warp takes words l, l+32, l+64, ... of row o in ascending order and, inside
  a word, elements j = 0..per_word-1: acc = fma(x[r, k], w(o, k), acc), k = word*per_word + j;
  then a butterfly sum over the 32 lanes (offsets 16, 8, 4, 2, 1).
  Affine dequantization: w(o, k) = fma(float(q), scale, bias), exactly (see
  _make_code_decoder). (Factorizing it, s * sum(q x) + b * sum(x) per word, saves 6% of a
  one-row launch's instructions but costs 15% at 8 rows: measured, not kept.)

Work split (a `Variant`; see plan()): a block of WARPS_PER_BLOCK warps; each warp owns
`feats` output features and the block's `rows_tile` rows, so every weight word is loaded
once (coalesced: one 128-byte line per warp load), dequantized once and used for all rows
from registers. Each lane keeps `unroll * feats` words in flight: the next step's words are
loaded before the current step is computed (a register double buffer), with no shared
memory and no barrier in the loop; the warp's scale rows are prefetched into L1 at the
start. x is read through L1 (16-byte loads), shared by the warps of the multiprocessor.
Grid: (row tiles, feature blocks), row tiles fastest, so blocks that share weights run
together and the weights come from HBM once. Why 4-byte words interleaved over lanes rather
than 16-byte chunks per lane: a warp load is still one full line, and a lane's x elements
stay 32 contiguous bytes (a 16-byte chunk per lane would spread one x load over 32 lines).
- few-rows path (decode, <= FEW_ROWS_MAX rows, and grouped): 1 or 2 rows a block;
- many-rows path (prompt steps, verify rows, batches): 4 or MANY_ROWS_TILE rows a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cuda_kernels.env import SIMULATOR, cuda, kernel, warp_sum

WARPS_PER_BLOCK = 2 if SIMULATOR else 4  # fewer Python threads in the simulator
MATMUL_THREADS = 32 * WARPS_PER_BLOCK
FEW_ROWS_MAX = 2  # more rows per launch: the many-rows variant
MANY_ROWS_TILE = 8
PER_WORD = {"f32": 1, "bf16": 2, "q8": 4, "q4": 8}
X_BATCH = {"f32": 1, "bf16": 2, "q8": 4, "q4": 4}  # x floats read by one load
_REF = object if SIMULATOR else np.int64  # a row reference: a view, or an address


@dataclass(frozen=True, slots=True)
class Variant:
    """Compile-time shape of one matmul kernel; none of it changes a row's bits."""

    rows_tile: int  # rows per block
    feats: int  # output features per warp
    unroll: int  # words per lane and feature loaded ahead (per step)
    vec_x: bool  # x rows 16-byte aligned: vector loads of x
    warps: int = WARPS_PER_BLOCK  # warps per block
    ahead: int = 0  # L2 prefetch of the weights this many steps ahead (0: none)


# Memory access through "row references": the address of a row's first element on the GPU
# (so loads are base + constant offsets, no index arithmetic in the loop), a row view under
# the simulator. All loads take the read-only path; weight words skip L1 (streamed once),
# leaving it to x (read by every warp of the multiprocessor) and the prefetched scales.
if SIMULATOR:

    @cuda.jit(device=True)
    def _row3(a, i, j):
        return a[i, j]

    @cuda.jit(device=True)
    def _row2(a, i):
        return a[i]

    @cuda.jit(device=True)
    def _at(row, i):
        return row[i:]

    @cuda.jit(device=True)
    def _ld_u32(row, i):
        return row[i].view(np.uint32)  # the bits, also of a float32 row

    @cuda.jit(device=True)
    def _ld_f32(row, i):
        return np.float32(row[i])

    @cuda.jit(device=True)
    def _ld_f32x4(row, i):
        return row[i], row[i + 1], row[i + 2], row[i + 3]

    @cuda.jit(device=True)
    def _ld_f32x2(row, i):
        return row[i], row[i + 1]

    @cuda.jit(device=True)
    def _prefetch_l1(row, i):
        pass

    @cuda.jit(device=True)
    def _prefetch_l2(row, i):
        pass

    @cuda.jit(device=True)
    def _bits_f32(u):
        return np.uint32(u).view(np.float32)

    @cuda.jit(device=True)
    def _ld_u32x4(row, i):
        return row[i], row[i + 1], row[i + 2], row[i + 3]

    @cuda.jit(device=True)
    def _ld_x_u32x4(row, i):
        return row[i], row[i + 1], row[i + 2], row[i + 3]

    @cuda.jit(device=True)
    def _dp4a(a, b, c):
        # c + sum over the 4 bytes of a (unsigned) times those of b (signed)
        total = int(c)
        for i in range(4):
            ai = (int(a) >> (8 * i)) & 0xFF
            bi = (int(b) >> (8 * i)) & 0xFF
            total += ai * (bi - 256 if bi >= 128 else bi)
        return np.int32(total)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def _row_codegen(context, builder, sig, args):
        # Address (int64) of a[index..., 0]; the launcher checked every index.
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        pairs = zip(args[1:], sig.args[1:], strict=True)
        inds = [context.cast(builder, v, t, types.intp) for v, t in pairs]
        inds.append(context.get_constant(types.intp, 0))
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, inds)
        return builder.ptrtoint(ptr, ir.IntType(64))

    @intrinsic
    def _row3(typingctx, a, i, j):
        return types.int64(a, i, j), _row_codegen

    @intrinsic
    def _row2(typingctx, a, i):
        return types.int64(a, i), _row_codegen

    def _address(builder, row, i):
        return builder.add(row, builder.shl(i, ir.Constant(ir.IntType(64), 2)))

    @intrinsic
    def _at(typingctx, row, i):
        """The reference of element i of the row (its address: row + 4 * i)."""
        def codegen(context, builder, sig, args):
            return _address(builder, args[0], context.cast(builder, args[1], sig.args[1], types.int64))

        return types.int64(row, i), codegen

    def _asm_load(ptx: str, count: int, reg: str, ret_type):
        """An intrinsic load(row, i) of `count` 32-bit values at element i of the row."""
        @intrinsic
        def load(typingctx, row, i):
            def codegen(context, builder, sig, args):
                i64 = context.cast(builder, args[1], sig.args[1], types.int64)
                addr = _address(builder, args[0], i64)
                elem = ir.IntType(32) if reg == "r" else ir.FloatType()
                out = elem if count == 1 else ir.LiteralStructType([elem] * count)
                regs = ", ".join(f"${n}" for n in range(count))
                text = f"{ptx} {regs if count == 1 else '{' + regs + '}'}, [${count}];"
                asm = ir.InlineAsm(ir.FunctionType(out, [addr.type]), text,
                                   ",".join([f"={reg}"] * count + ["l"]))
                res = builder.call(asm, [addr])
                if count == 1:
                    return res
                vals = [builder.extract_value(res, n) for n in range(count)]
                return context.make_tuple(builder, sig.return_type, vals)

            return ret_type(row, i), codegen

        return load

    _ld_u32 = _asm_load("ld.global.nc.L1::no_allocate.u32", 1, "r", types.uint32)
    _ld_f32 = _asm_load("ld.global.nc.f32", 1, "f", types.float32)
    _ld_f32x4 = _asm_load("ld.global.nc.v4.f32", 4, "f", types.UniTuple(types.float32, 4))
    _ld_f32x2 = _asm_load("ld.global.nc.v2.f32", 2, "f", types.UniTuple(types.float32, 2))
    _ld_u32x4 = _asm_load("ld.global.nc.L1::no_allocate.v4.u32", 4, "r", types.UniTuple(types.uint32, 4))
    _ld_x_u32x4 = _asm_load("ld.global.nc.v4.u32", 4, "r", types.UniTuple(types.uint32, 4))  # through L1

    @intrinsic
    def _dp4a(typingctx, a, b, c):
        """c + the dot product of a's 4 bytes (unsigned) and b's 4 bytes (signed): an exact
        int32 (PTX dp4a.u32.s32)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args, strict=True)]
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "dp4a.u32.s32 $0, $1, $2, $3;",
                               "=r,r,r,r")
            return builder.call(asm, vals)

        return types.int32(a, b, c), codegen

    def _asm_prefetch(level: str):
        @intrinsic
        def prefetch(typingctx, row, i):
            """Bring the line of element i of the row into `level` (no register, no wait)."""
            def codegen(context, builder, sig, args):
                i64 = context.cast(builder, args[1], sig.args[1], types.int64)
                addr = _address(builder, args[0], i64)
                fnty = ir.FunctionType(ir.VoidType(), [addr.type])
                asm = ir.InlineAsm(fnty, f"prefetch.global.{level} [$0];", "l", side_effect=True)
                builder.call(asm, [addr])
                return context.get_dummy_value()

            return types.void(row, i), codegen

        return prefetch

    _prefetch_l1 = _asm_prefetch("L1")
    _prefetch_l2 = _asm_prefetch("L2")

    @intrinsic
    def _bits_f32(typingctx, u):
        """The float32 whose bits are the low 32 bits of integer u."""
        def codegen(context, builder, sig, args):
            val, i32 = args[0], ir.IntType(32)
            if val.type.width > 32:
                val = builder.trunc(val, i32)
            elif val.type.width < 32:
                val = builder.zext(val, i32)
            return builder.bitcast(val, ir.FloatType())

        return types.float32(u), codegen


# ---------------------------------------------------------------- decoding one element


@cuda.jit(device=True)
def _decode_bits(half, m):
    return _bits_f32(half)


@cuda.jit(device=True)
def _split_f32(word):
    return word, word


@cuda.jit(device=True)
def _split_bf16(word):
    return word << np.uint32(16), word & np.uint32(0xFFFF0000)


def _make_decoder(kind: str):
    """(split, decode): split(word) -> (lo, hi), the word's two 16-bit halves prepared once;
    decode(half, m) -> float32 value of element m of that half: the value itself (dense
    kinds) or its code q (affine kinds: the word step applies scale and bias). m is a
    compile-time constant once the caller's loops are unrolled."""
    if kind == "f32":
        return _split_f32, _decode_bits
    if kind == "bf16":
        return _split_bf16, _decode_bits
    return _make_code_decoder(32 // PER_WORD[kind])


def _make_code_decoder(bits: int):
    # Each half, its 16 bits in the mantissa of a float with every exponent bit set. Element
    # m (a code q at bit bits*m) is then one AND away from the float 2**e + q, where
    # e = 23 - bits*m: keep the code's bits and exponent 127 + e. Subtracting 2**e gives q
    # exactly: one logic op and one add an element, no shift and no int->float conversion.
    mask = (1 << bits) - 1

    @cuda.jit(device=True)
    def split_affine(word):
        lo = (word & np.uint32(0xFFFF)) + np.uint32(0x7F800000)
        return lo, (word >> np.uint32(16)) + np.uint32(0x7F800000)

    @cuda.jit(device=True)
    def decode_code(half, m):
        exponent = np.uint32((150 - bits * m) << 23)  # the bits of 2**(23 - bits*m)
        field = half & (exponent | np.uint32(mask << (bits * m)))
        return _bits_f32(field) - _bits_f32(exponent)

    return split_affine, decode_code


# ---------------------------------------------------------------- the kernel


def _make_x_loader(xb: int, vec_x: bool):
    """load(x_row, k, xv): xv[0:xb] = x[row, k : k + xb]."""
    if vec_x and xb == 4:

        @cuda.jit(device=True)
        def load4(x_row, k, xv):
            xv[0], xv[1], xv[2], xv[3] = _ld_f32x4(x_row, k)

        return load4
    if vec_x and xb == 2:

        @cuda.jit(device=True)
        def load2(x_row, k, xv):
            xv[0], xv[1] = _ld_f32x2(x_row, k)

        return load2

    @cuda.jit(device=True)
    def load_scalar(x_row, k, xv):
        for i in range(xb):
            xv[i] = _ld_f32(x_row, k + i)

    return load_scalar


def _make_fetch(variant: Variant):
    unroll, feats = variant.unroll, variant.feats

    @cuda.jit(device=True)
    def fetch(w_rows, first_word, words, wb):
        # wb[u * feats + f] = word first_word + 32u of feature f, for the words that exist;
        # one test for a whole step in the common case. Loads at constant offsets from one
        # reference per feature.
        full = first_word + 32 * (unroll - 1) < words
        for f in range(feats):
            at = _at(w_rows[f], first_word)
            for u in range(unroll):
                if full or first_word + 32 * u < words:
                    wb[u * feats + f] = _ld_u32(at, 32 * u)

    @cuda.jit(device=True)
    def fetch_full(w_rows, first_word, wb):
        # fetch() of a step known to be whole: no test at all.
        for f in range(feats):
            at = _at(w_rows[f], first_word)
            for u in range(unroll):
                wb[u * feats + f] = _ld_u32(at, 32 * u)

    return fetch, fetch_full


def _make_prefetch_ahead(variant: Variant):
    unroll, feats = variant.unroll, variant.feats
    lines = unroll * feats  # the warp's 128-byte weight lines of one step

    @cuda.jit(device=True)
    def prefetch_ahead(w_rows, first_word, words, lane):
        # Lane l < lines asks L2 for line l of the step whose lane-0 word is first_word: word
        # first_word + 32u of feature f (l = u * feats + f), so that step's loads hit L2.
        word = first_word + 32 * (lane // feats)
        if lane < lines and word < words:
            for f in range(feats):  # constant indices: the references stay in registers
                if lane % feats == f:
                    _prefetch_l2(w_rows[f], word)

    return prefetch_ahead


def _make_refs(variant: Variant, affine: bool, swiglu: bool):
    rows_tile, feats = variant.rows_tile, variant.feats
    half = feats // 2

    @cuda.jit(device=True)
    def refs(x, w, scales, biases, expert, row0, feat0, x_rows, w_rows, s_rows, b_rows):  # noqa: E501
        # Row references of the block's rows and the warp's features (clamped: rows and
        # features past the end are computed on a copy of the last one and not stored).
        # swiglu: w is [gate; up] (2*I rows); the warp's first half of features are gate
        # rows feat0.., its second half the up rows I + feat0.. of the same outputs.
        for r in range(rows_tile):
            x_rows[r] = _row2(x, min(row0 + r, x.shape[0] - 1))
        for f in range(feats):
            if swiglu:
                inter = w.shape[1] // 2
                feat = min(feat0 + f % half, inter - 1) + (inter if f >= half else 0)
            else:
                feat = min(feat0 + f, w.shape[1] - 1)
            w_rows[f] = _row3(w, expert, feat)
            if affine:
                s_rows[f], b_rows[f] = _row3(scales, expert, feat), _row3(biases, expert, feat)

    return refs


def _make_prefetch_scales(feats: int):
    @cuda.jit(device=True)
    def prefetch_scales(s_rows, b_rows, groups, lane):
        # The warp's scale and bias rows into L1 once (a few hundred bytes a row), so the
        # per-word scale loads of the loop hit L1 instead of waiting on HBM.
        for f in range(feats):
            for g in range(32 * lane, groups + 31, 32 * 32):  # one point per 128 bytes
                _prefetch_l1(s_rows[f], min(g, groups - 1))
                _prefetch_l1(b_rows[f], min(g, groups - 1))

    return prefetch_scales


def _make_word_step(kind: str, variant: Variant):
    affine = kind in ("q4", "q8")
    per_word, xb = PER_WORD[kind], X_BATCH[kind]
    per_half = max(1, per_word // 2)
    rows_tile, feats = variant.rows_tile, variant.feats
    split, decode = _make_decoder(kind)
    load_x = _make_x_loader(xb, variant.vec_x)

    @cuda.jit(device=True)
    def word_step(x_rows, s_rows, b_rows, xk, group, cw, work, acc):
        # The elements of a word (cw[f]: its bits for feature f; its x at element xk of the
        # row references, its scale and bias at `group`): decode xb elements of every
        # feature once (affine: fma(q, scale, bias)), then one fma per row and feature,
        # elements ascending.
        halves, wd, sv, xv = work
        for f in range(feats):
            if affine:
                sv[2 * f], sv[2 * f + 1] = _ld_f32(s_rows[f], group), _ld_f32(b_rows[f], group)
            halves[2 * f], halves[2 * f + 1] = split(cw[f])
        for h in range(per_word // xb):
            for f in range(feats):
                for i in range(xb):
                    j = h * xb + i
                    wd[f * xb + i] = decode(halves[2 * f + j // per_half], j % per_half)
                    if affine:
                        wd[f * xb + i] = cuda.fma(wd[f * xb + i], sv[2 * f], sv[2 * f + 1])
            for r in range(rows_tile):
                load_x(x_rows[r], xk + h * xb, xv)
                for i in range(xb):
                    for f in range(feats):
                        a = r * feats + f
                        acc[a] = cuda.fma(xv[i], wd[f * xb + i], acc[a])

    return word_step


@cuda.jit(device=True)
def _swiglu(g, u):
    # silu(g) * u, the same expression as norm.silu_mul (same bits)
    sig = np.float32(1.0) / (np.float32(1.0) + math.exp(-g))
    return (g * sig) * u


def _make_put(epilogue: str):
    """put(out, row, feat, total, up_total): write one output element.
    'store': out = total; 'add': out += total (a residual: out holds h, the same bits as
    h + (x @ W.T)); 'swiglu': out = silu(total) * up_total."""
    if epilogue == "add":

        @cuda.jit(device=True)
        def put_add(out, row, feat, total, up_total):
            out[row, feat] = out[row, feat] + total

        return put_add
    if epilogue == "swiglu":

        @cuda.jit(device=True)
        def put_swiglu(out, row, feat, total, up_total):
            out[row, feat] = _swiglu(total, up_total)

        return put_swiglu

    @cuda.jit(device=True)
    def put_store(out, row, feat, total, up_total):
        out[row, feat] = total

    return put_store


def _make_store(variant: Variant, epilogue: str):
    rows_tile, feats = variant.rows_tile, variant.feats
    if SIMULATOR:
        return _make_store_simulated(variant, epilogue)
    put = _make_put(epilogue)
    outs = feats // 2 if epilogue == "swiglu" else feats  # outputs per warp
    up_at = feats // 2 if epilogue == "swiglu" else 0

    @cuda.jit(device=True)
    def store(acc, row0, feat0, lane, out):
        for r in range(rows_tile):
            for f in range(outs):
                total = warp_sum(acc[r * feats + f])  # every lane: uniform flow
                up_total = warp_sum(acc[r * feats + up_at + f]) if up_at else total
                if lane == 0 and row0 + r < out.shape[0] and feat0 + f < out.shape[1]:
                    put(out, row0 + r, feat0 + f, total, up_total)

    return store


def _make_store_simulated(variant: Variant, epilogue: str):
    # The simulator has no shuffles and each emulated one costs two block barriers, so lane 0
    # evaluates the same butterfly tree (offsets 16, 8, 4, 2, 1) from shared memory: the
    # same float32 additions, one barrier.
    num_acc, feats, warps = variant.rows_tile * variant.feats, variant.feats, variant.warps
    put = _make_put(epilogue)
    outs = feats // 2 if epilogue == "swiglu" else feats
    up_at = feats // 2 if epilogue == "swiglu" else 0

    @cuda.jit(device=True)
    def tree(buf, warp, a):
        v = buf[warp, a].copy()
        for offset in (16, 8, 4, 2, 1):
            v = v + v[np.arange(32) ^ offset]
        return v[0]

    @cuda.jit(device=True)
    def store(acc, row0, feat0, lane, out):
        buf = cuda.shared.array((warps, num_acc, 32), np.float32)
        warp = cuda.threadIdx.x // 32
        for a in range(num_acc):
            buf[warp, a, lane] = acc[a]
        cuda.syncthreads()
        for a in range(num_acc if lane == 0 else 0):
            r, f = a // feats, a % feats
            if f >= outs:
                continue
            total = tree(buf, warp, a)
            up_total = tree(buf, warp, a + up_at) if up_at else total
            if row0 + r < out.shape[0] and feat0 + f < out.shape[1]:
                put(out, row0 + r, feat0 + f, total, up_total)

    return store


def _make_steps(kind: str, variant: Variant, group_words: int):
    """(full_step, last_step) over words base + 32u (u < unroll) of the warp's features,
    cw: their bits; work: scratch. A full step is straight-line code (one reference per row
    and feature, loads at constant offsets from it); only the last, partial step tests each
    word."""
    unroll, feats, rows_tile, per_word = variant.unroll, variant.feats, variant.rows_tile, PER_WORD[kind]
    word_step = _make_word_step(kind, variant)
    # The groups of words base + 32u are base // group_words + u * (32 // group_words) when
    # a group divides 32 words: scale loads at constant offsets too.
    groups_per_32 = 32 // group_words if group_words and 32 % group_words == 0 else 0

    @cuda.jit(device=True)
    def full_step(x_rows, s_rows, b_rows, base, cw, work, acc, refs):
        x_at, s_at, b_at = refs
        for r in range(rows_tile):
            x_at[r] = _at(x_rows[r], base * per_word)
        group0 = base // group_words if group_words else 0
        if groups_per_32:
            for f in range(feats):
                s_at[f], b_at[f] = _at(s_rows[f], group0), _at(b_rows[f], group0)
        for u in range(unroll):
            if groups_per_32:
                word_step(x_at, s_at, b_at, 32 * u * per_word, u * groups_per_32, cw[u * feats :], work, acc)
            else:
                group = (base + 32 * u) // group_words if group_words else 0
                word_step(x_at, s_rows, b_rows, 32 * u * per_word, group, cw[u * feats :], work, acc)

    @cuda.jit(device=True)
    def last_step(x_rows, s_rows, b_rows, base, words, cw, work, acc):
        for u in range(unroll):
            word = base + 32 * u
            if word < words:
                group = word // group_words if group_words else 0
                word_step(x_rows, s_rows, b_rows, word * per_word, group, cw[u * feats :], work, acc)

    return full_step, last_step


def _make_kernel(kind: str, variant: Variant, group_words: int, grouped: bool, epilogue: str):
    xb, rows_tile, feats, unroll = X_BATCH[kind], variant.rows_tile, variant.feats, variant.unroll
    warps = variant.warps
    outs = feats // 2 if epilogue == "swiglu" else feats  # output features per warp
    affine = kind in ("q4", "q8")
    slots, num_acc, num_wd, num_sv = unroll * feats, rows_tile * feats, feats * xb, 2 * feats
    (fetch, fetch_full), refs = _make_fetch(variant), _make_refs(variant, affine, epilogue == "swiglu")
    full_step, last_step = _make_steps(kind, variant, group_words)
    prefetch_scales, store = _make_prefetch_scales(feats), _make_store(variant, epilogue)

    prefetch_ahead, ahead = _make_prefetch_ahead(variant), variant.ahead

    @kernel
    def matmul_k(x, w, scales, biases, expert_ids, out):
        # x: [rows, in] f32; w: [E, out_f, words] u32 (f32 for 'f32'); scales/biases:
        # [E, out_f, words // group_words] (affine; else [1, 1, 1]);
        # expert_ids: [rows] i32 (grouped only; rows_tile 1); out: [rows, out_f] f32
        # (swiglu: out_f = w's rows / 2; add: out holds the residual, updated in place)
        lane = cuda.threadIdx.x % 32
        feat0 = (cuda.blockIdx.y * warps + cuda.threadIdx.x // 32) * outs
        row0 = cuda.blockIdx.x * rows_tile
        x_rows = cuda.local.array(rows_tile, _REF)
        w_rows = cuda.local.array(feats, _REF)
        s_rows = cuda.local.array(feats, _REF)
        b_rows = cuda.local.array(feats, _REF)
        expert = expert_ids[row0] if grouped else 0
        refs(x, w, scales, biases, expert, row0, feat0, x_rows, w_rows, s_rows, b_rows)
        acc = cuda.local.array(num_acc, np.float32)
        for a in range(num_acc):
            acc[a] = np.float32(0.0)
        wb = cuda.local.array(slots, np.uint32)  # the next step's words, in flight
        cw = cuda.local.array(slots, np.uint32)  # this step's words
        work = (cuda.local.array(num_sv, np.uint32), cuda.local.array(num_wd, np.float32),
                cuda.local.array(num_sv, np.float32), cuda.local.array(xb, np.float32))
        step_refs = (cuda.local.array(rows_tile, _REF), cuda.local.array(feats, _REF),
                     cuda.local.array(feats, _REF))
        words, base = w.shape[2], lane
        fetch(w_rows, base, words, wb)
        if affine:
            prefetch_scales(s_rows, b_rows, scales.shape[2], lane)
        while base + 32 * (2 * unroll - 1) < words:  # this step and the next are whole
            for s in range(slots):
                cw[s] = wb[s]
            if ahead:
                prefetch_ahead(w_rows, base - lane + 32 * unroll * (ahead + 1), words, lane)
            fetch_full(w_rows, base + 32 * unroll, wb)
            full_step(x_rows, s_rows, b_rows, base, cw, work, acc, step_refs)
            base += 32 * unroll
        if base + 32 * (unroll - 1) < words:  # a whole step, then maybe a partial one
            for s in range(slots):
                cw[s] = wb[s]
            fetch(w_rows, base + 32 * unroll, words, wb)
            full_step(x_rows, s_rows, b_rows, base, cw, work, acc, step_refs)
            base += 32 * unroll
        if base < words:
            last_step(x_rows, s_rows, b_rows, base, words, wb, work, acc)
        store(acc, row0, feat0, lane, out)

    return matmul_k


EPILOGUES = ("store", "add", "swiglu")
_KERNELS: dict[tuple[str, Variant, int, bool, str], object] = {}


def matmul_kernel(kind: str, variant: Variant, group_words: int = 0, grouped: bool = False,
                  epilogue: str = "store"):
    """The kernel for weight `kind` ('f32', 'bf16', 'q8', 'q4') and `variant`; group_words:
    words per scale group (affine kinds; a compile-time constant), 0 for dense kinds;
    grouped (MoE: each row's own expert) needs rows_tile 1. epilogue: 'store' (out = x @ W.T),
    'add' (out += x @ W.T) or 'swiglu' (W = [gate; up]: out = silu(x @ gate.T) * (x @ up.T),
    an even number of features per warp)."""
    if grouped and variant.rows_tile != 1:
        raise ValueError("grouped (MoE) matmul runs one row per block")
    if (kind in ("q4", "q8")) != (group_words > 0):
        raise ValueError(f"{kind}: group_words {group_words}")
    if epilogue not in EPILOGUES or (epilogue == "swiglu" and variant.feats % 2):
        raise ValueError(f"matmul epilogue {epilogue!r} with {variant.feats} features a warp")
    key = (kind, variant, group_words, grouped, epilogue)
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(kind, variant, group_words, grouped, epilogue)
    return _KERNELS[key]


def plan(rows: int, out_features: int, path: str, vec_x: bool, grouped: bool = False) -> Variant:
    """The variant of a launch (none changes a row's bits). 'few' (decode, memory bound):
    1 row a block with 2 features a warp and 8 words per feature and lane in flight (and an
    L2 prefetch one step further), or 2 rows with 4 words. 'many':
    4 rows a block and 8 features a warp, or MANY_ROWS_TILE rows and 4 features past 4
    rows; one step of words in flight, each decoded element feeds every row. Narrow
    outputs get half the features per warp so that the grid still covers the 132 SMs."""
    narrow = 2 if out_features < 4096 else 1
    if path == "many" and not grouped:
        if rows <= 4:
            return Variant(4, 8 // narrow, 1, vec_x)
        return Variant(MANY_ROWS_TILE, 4 // narrow, 1, vec_x)
    if rows <= 1 or grouped:  # 2 features, 8 words each in flight, the step after next
        return Variant(1, 2, 8, vec_x, ahead=1)  # asked of L2: the fastest on an H200 at
        # every Qwen3-8B shape but k and down, within 3% there (bench_matmul_variants.py)
    return Variant(2, 4 // narrow, 4, vec_x)


def launch_shape(rows: int, out_features: int, variant: Variant, epilogue: str = "store"
                 ) -> tuple[tuple[int, int], int]:
    """(grid, block) for a matmul kernel: grid (row tiles, feature blocks); out_features:
    the output's columns (for 'swiglu' half the weight's rows)."""
    per_block = variant.warps * (variant.feats // 2 if epilogue == "swiglu" else variant.feats)
    grid_rows = (rows + variant.rows_tile - 1) // variant.rows_tile
    return (grid_rows, (out_features + per_block - 1) // per_block), 32 * variant.warps


@kernel
def embed_affine(codes, scales, biases, bits, group_size, ids, out):
    # codes: [V, H*bits/32] u32; out[r] = dequant(codes[ids[r]]); grid (rows,)
    row = cuda.blockIdx.x
    token = ids[row]
    per_word = 32 // bits
    mask = (1 << bits) - 1
    for i in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        word = np.int64(codes[token, i // per_word])
        q = (word >> (bits * (i % per_word))) & mask
        g = i // group_size
        out[row, i] = cuda.fma(np.float32(q), scales[token, g], biases[token, g])
