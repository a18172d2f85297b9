"""Prototype (issue 25): a decode token's 121 CPU matmuls of the default model's shapes without
a fork-join each. Three ways, same kernels (int8_matmul._parts_chunk), same bits, side by side:

  a  today: one parallel region (TBB, 32 chunks) a matmul, each called from Python
  b  one parallel region for the whole token: 2 workers (prange(2)) each take one contiguous
     half of every matmul, an atomic counter a matmul says when both halves are done, and
     the workers spin (pause) until then before the next matmul
  b2 as b, but a half is claimed in --half pieces from a counter of its own (its own cache
     line), and a worker that ends its half takes the other half's unclaimed pieces: no
     deadlock and no full stall if a task of the region never runs or starts late

Random q4 weights (group 32) of SmolLM2-135M's layers (q|k|v 960x576, o 576x576, gate|up
3072x576, down 576x1536, 30 layers) and the 8-bit head (49152x576); one row, x quantized
beforehand. The whole set (~100 MB) cycles, so weights come from L3 as in the engine.

    python benchmarks/proto_persistent_cpu.py [--repeats 40] [--half 1]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List

from tf_async.engine.threads import choose_threading_layer

choose_threading_layer()

from tf_async.backend.cpu import int8_matmul as im  # noqa: E402

LINE = 8  # int64 counters a cache line: each counter on a line of its own


def _item_pointer(context: Any, builder: Any, arr_type: Any, arr: Any, index: Any) -> Any:
    ary = context.make_array(arr_type)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_type, ary, [index])


@intrinsic
def atomic_add(typingctx: Any, arr: Any, index: Any, value: Any) -> Any:
    sig = types.int64(arr, index, value)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx: Any, arr: Any, index: Any) -> Any:
    sig = types.int64(arr, index)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return sig, codegen


@intrinsic
def cpu_pause(typingctx: Any) -> Any:
    sig = types.void()

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True)
def _chunk(p, c, n, xqs, xss, codes, scales, biases, bits, outs, offs):
    im._parts_chunk(c, n, xqs[p], xss[p], (codes[p],), (scales[p],), (biases[p],), 0, bits[p],
                    offs[p], outs[p])


@njit(nogil=True)
def _halves_then_wait(p, w, half, claim, done, xqs, xss, codes, scales, biases, bits, outs, offs):
    n = 2 * half
    for k in range(2):
        h = np.int64(w) if k == 0 else np.int64(1 - w)
        while True:
            c = atomic_add(claim, 2 * LINE * p + LINE * h, 1)
            if c >= half:
                break
            _chunk(p, h * half + c, n, xqs, xss, codes, scales, biases, bits, outs, offs)
            atomic_add(done, 2 * LINE * p + LINE * h, 1)
    while atomic_load(done, 2 * LINE * p) + atomic_load(done, 2 * LINE * p + LINE) < n:
        cpu_pause()


@njit(nogil=True, parallel=True)
def one_region(half, claim, done, xqs, xss, codes, scales, biases, bits, outs, offs):
    for w in prange(2):
        for p in range(len(codes)):
            _halves_then_wait(p, w, half, claim, done, xqs, xss, codes, scales, biases, bits,
                              outs, offs)


def _weights(rng: np.random.Generator) -> dict[str, Any]:
    hidden, inter, vocab, gs = 576, 1536, 49152, 32
    shapes = [s for _ in range(30) for s in ((960, hidden, 4), (hidden, hidden, 4),
                                              (2 * inter, hidden, 4), (hidden, inter, 4))]
    shapes.append((vocab, hidden, 8))
    lists: dict[str, Any] = {k: List() for k in ("xqs", "xss", "codes", "scales", "biases", "outs", "offs")}
    for out_f, in_f, bits in shapes:
        words = rng.integers(0, 2**32, (out_f, in_f * bits // 32), dtype=np.uint64)
        lists["codes"].append(words.astype(np.uint32))
        for name in ("scales", "biases"):
            lists[name].append((rng.standard_normal((out_f, in_f // gs)) * 0.01).astype(np.float32))
        x = rng.standard_normal((1, in_f)).astype(np.float32)
        xq, xs = np.empty((1, in_f), np.int8), np.empty((1, 3 * in_f // 32), np.float32)
        im.quantize_rows(x, bits, xq, xs)
        lists["xqs"].append(xq)
        lists["xss"].append(xs)
        lists["outs"].append(np.empty((1, out_f), np.float32))
        lists["offs"].append(np.array([0, out_f], np.int64))
    lists["bits"] = np.array([s[2] for s in shapes], np.int64)
    return lists


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--half", type=int, default=1, help="b2: pieces a half is claimed in")
    args = parser.parse_args()
    w = _weights(np.random.default_rng(0))
    n = len(w["codes"])
    order = ("xqs", "xss", "codes", "scales", "biases", "bits", "outs", "offs")
    calls = [(w["xqs"][p], w["xss"][p], (w["codes"][p],), (w["scales"][p],), (w["biases"][p],), 0,
              int(w["bits"][p]), w["offs"][p], w["outs"][p]) for p in range(n)]

    def a_calls() -> None:
        for call in calls:
            im._parts_parallel(*call)

    def region(half: int) -> None:
        counters = np.zeros(2 * LINE * n, np.int64), np.zeros(2 * LINE * n, np.int64)
        one_region(half, *counters, *[w[k] for k in order])

    ways = {"a  a region a matmul": a_calls, "b  one region, halves": lambda: region(1),
            f"b2 one region, {args.half} a half": lambda: region(args.half)}
    for fn in ways.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    first = None
    print(f"{'way':28} {'median ms':>9} {'min ms':>7}  bits")
    for name, fn in ways.items():
        for out in w["outs"]:
            out.fill(np.nan)
        fn()
        bits = np.concatenate([o.ravel() for o in w["outs"]]).view(np.uint32)
        first = bits if first is None else first
        same = "same" if np.array_equal(bits, first) else "DIFFER"
        print(f"{name:28} {np.median(times[name]) * 1e3:9.2f} {min(times[name]) * 1e3:7.2f}  {same}")


if __name__ == "__main__":
    main()
