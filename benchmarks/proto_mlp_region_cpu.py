"""Experiment (issue 25): the default model's MLP block (post norm, gate|up, silu, down +
residual) as one parallel region of 2 workers (contiguous halves, atomic done counters, as
proto_persistent_cpu.py) instead of 4 ops and 2 TBB regions a layer, patched into the CPU
decoder. Same kernels: the tokens are compared; then ms/token, the two alternating in one
process (median of N repeats of a 96-token completion).

    python benchmarks/proto_mlp_region_cpu.py [N]
"""
import asyncio
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from numba import njit, prange
from proto_persistent_cpu import LINE, atomic_add, atomic_load, cpu_pause

from tf_async import Engine
from tf_async.backend.cpu import int8_matmul as im
from tf_async.backend.cpu import kernels
from tf_async.models.decoder import Decoder


@njit(nogil=True)
def _halves(phase, w, claim, done, xq, xs, codes, scales, biases, shift, bits, offs, out):
    for k in range(2):
        h = np.int64(w) if k == 0 else np.int64(1 - w)
        if atomic_add(claim, 2 * LINE * phase + LINE * h, 1) == 0:
            im._parts_chunk(h, 2, xq, xs, codes, scales, biases, shift, bits, offs, out)
            atomic_add(done, 2 * LINE * phase + LINE * h, 1)


@njit(nogil=True)
def _wait(phase, done):
    while atomic_load(done, 2 * LINE * phase) + atomic_load(done, 2 * LINE * phase + LINE) < 2:
        cpu_pause()


@njit(nogil=True)
def _down_halves(w, claim, done, mq, ms, codes, scales, biases, shift, bits, offs, dout, h):
    total = offs[-1]
    for k in range(2):
        half = np.int64(w) if k == 0 else np.int64(1 - w)
        if atomic_add(claim, 2 * LINE + LINE * half, 1) == 0:
            im._parts_chunk(half, 2, mq, ms, codes, scales, biases, shift, bits, offs, dout)
            first, last = half * total // 2, (half + 1) * total // 2
            for r in range(h.shape[0]):
                for f in range(first, last):
                    h[r, f] = h[r, f] + dout[r, f]
            atomic_add(done, 2 * LINE + LINE * half, 1)


@njit(nogil=True, parallel=True)
def mlp_region(h, norm_w, eps, gcodes, gscales, gbiases, gshift, gbits, goffs,
               dcodes, dscales, dbiases, dshift, dbits, doffs,
               xn, xq, xs, gu, m, mq, ms, dout, claim, done):
    for w in prange(2):
        kernels.rms_norm(h, norm_w, eps, xn[w])
        im.quantize_rows(xn[w], gbits, xq[w], xs[w])
        _halves(0, w, claim, done, xq[w], xs[w], gcodes, gscales, gbiases, gshift, gbits, goffs, gu)
        _wait(0, done)
        inter = gu.shape[1] // 2
        kernels.silu_mul(gu[:, :inter], gu[:, inter:], m[w])
        im.quantize_rows(m[w], dbits, mq[w], ms[w])
        _down_halves(w, claim, done, mq[w], ms[w], dcodes, dscales, dbiases, dshift, dbits, doffs, dout, h)


def shift_of(gs):
    s = 0
    while (32 << s) < gs:
        s += 1
    return s


class Fused:
    def __init__(self, decoder):
        self.d = decoder
        self.cache = {}

    def mlp(self, index, layer, fused, h):
        key = (index, h.shape[0])
        st = self.cache.get(key)
        if st is None:
            gp = fused.gate_up.parts
            dn = layer.down
            rows, H = h.shape
            inter = gp[0].out_features
            st = dict(
                g=(tuple(p.codes for p in gp), tuple(p.scales for p in gp), tuple(p.biases for p in gp),
                   shift_of(gp[0].group_size), gp[0].bits, np.array([0, inter, 2 * inter], np.int64)),
                d=((dn.codes,), (dn.scales,), (dn.biases,), shift_of(dn.group_size), dn.bits,
                   np.array([0, dn.out_features], np.int64)),
                bufs=(np.empty((2, rows, H), np.float32), np.empty((2, rows, H), np.int8),
                      np.empty((2, rows, 3 * H // 32), np.float32), np.empty((rows, 2 * inter), np.float32),
                      np.empty((2, rows, inter), np.float32), np.empty((2, rows, inter), np.int8),
                      np.empty((2, rows, 3 * inter // 32), np.float32), np.empty((rows, H), np.float32)))
            self.cache[key] = st
        claim, done = np.zeros(4 * LINE, np.int64), np.zeros(4 * LINE, np.int64)
        mlp_region(h, layer.post_norm, np.float32(self.d.config.rms_norm_eps), *st["g"], *st["d"],
                   *st["bufs"], claim, done)


ORIG = Decoder._fused_layer


def patched(self, index, layer, fused, h, batch, kv, kv_scales):
    if not PATCH[0] or fused.gate_up is None or layer.o_bias is not None:
        return ORIG(self, index, layer, fused, h, batch, kv, kv_scales)
    ops = self.ops
    o = self._attention_rows(index, layer, fused, h, batch, kv, kv_scales)
    ops.linear_into(o, layer.o, h)
    if not hasattr(self, "_fx"):
        self._fx = Fused(self)
    self._fx.mlp(index, layer, fused, h)


PATCH = [False]
Decoder._fused_layer = patched


async def main():
    prompts = ["The history of the Roman Empire", "Write a poem about the sea", "Explain gravity"]
    async with Engine(device="cpu", parallel=1, ctx=2048) as eng:
        outs = {}
        for on in (False, True):
            PATCH[0] = on
            outs[on] = [(await eng.complete(p, max_tokens=48, ignore_eos=True)).token_ids for p in prompts]
        print("same tokens:", outs[True] == outs[False])
        res = {False: [], True: []}
        for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
            for on in (False, True):
                PATCH[0] = on
                t = time.perf_counter()
                await eng.complete(prompts[0], max_tokens=96, ignore_eos=True)
                res[on].append((time.perf_counter() - t) / 96 * 1e3)
        for on in (False, True):
            print("fused" if on else "ops  ", "ms/token median", round(float(np.median(res[on])), 3),
                  [round(x, 2) for x in res[on]])

asyncio.run(main())
