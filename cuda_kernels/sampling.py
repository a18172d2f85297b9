"""Token choice on the device: greedy argmax (split over blocks: argmax_parts, then
argmax_reduce) and seeded top-k / top-p sampling (one block of SAMPLE_THREADS threads per row),
so logits never travel to the host and a row's token never depends on the other rows.

Randomness: a counter-based hash of (seed, position), all arithmetic mod 2**64:
    mix64(z):  z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
               z ^= z >> 31
    h = mix64(mix64(seed + 0x9E3779B97F4A7C15) ^ position)
    u = (h >> 40) * 2**-24            (float32, exactly, in [0, 1))
`uniform_host` below is the same function in Python integers (for a CPU twin).

Sampling a row with temperature t > 0 (t <= 0 means greedy argmax, ties: lowest id):
  z_i = logits_i / t; m = max z; key(z) = the float32 bits as an order-preserving int.
  top-k (0 < k < V): kept = {i : key(z_i) >= K}, K the k-th largest key (found by bisection
  over keys, so exact ties at the boundary are all kept).
  p_i = exp(z_i - m) over kept; top-p (0 < p < 1): raise the key threshold to the largest T
  whose kept mass sum(p_i : key >= T) >= top_p * total (bisection again).
  Draw: thread t (of 256) owns i = t, t+256, ...; partial_t = its kept p in that order; the
  token is the first i, in thread-major order, whose running sum exceeds u * sum_t partial_t.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels.env import block_sum, cuda, float_as_int, kernel

SAMPLE_THREADS = 256
_FBUF_SIZE = SAMPLE_THREADS + 2  # partials, then the owner's prefix and the owner thread
NEG_INF = np.float32(-np.inf)
_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_KEY_MIN = -(2**31)


def _mix64_host(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_host(seed: int, position: int) -> float:
    """The draw of (seed, position), bit-identical to the device's."""
    h = _mix64_host(_mix64_host((seed + 0x9E3779B97F4A7C15) & _MASK64) ^ (position & _MASK64))
    return float(np.float32((h >> 40) * 2.0**-24))


@cuda.jit(device=True)
def _mix64(z):
    z = z ^ (z >> np.uint64(30))
    z = z * _MIX1
    z = z ^ (z >> np.uint64(27))
    z = z * _MIX2
    return z ^ (z >> np.uint64(31))


@cuda.jit(device=True)
def uniform(seed, position):
    h = _mix64(_mix64(np.uint64(seed) + _GOLDEN) ^ np.uint64(position))
    return np.float32(h >> np.uint64(40)) * np.float32(5.960464477539063e-08)


@cuda.jit(device=True)
def _key(z):
    bits = np.int64(float_as_int(z))
    if bits < 0:
        return bits ^ 0x7FFFFFFF
    return bits


@cuda.jit(device=True, inline=True)
def _before(v, i, best_v, best_i):
    """(v, i) comes before (best_v, best_i): value descending, then id ascending; a NaN value
    never comes before anything. Over non-NaN values a total order (ids are distinct), so the
    first pair of a set is the same whatever the order or the grouping it is searched in."""
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit(device=True)
def _tree_best(vbuf, ibuf, best_v, best_i, threads):
    # The first (value, id) of the block's `threads` threads' pairs (vbuf, ibuf: shared memory
    # of `threads` entries, a power of two); every thread gets it, and the buffers are free again.
    tid = cuda.threadIdx.x
    vbuf[tid] = best_v
    ibuf[tid] = best_i
    cuda.syncthreads()
    stride = threads // 2
    while stride > 0:
        if tid < stride:
            ov = vbuf[tid + stride]
            oi = ibuf[tid + stride]
            if _before(ov, oi, vbuf[tid], ibuf[tid]):
                vbuf[tid] = ov
                ibuf[tid] = oi
        cuda.syncthreads()
        stride //= 2
    best_v = vbuf[0]
    best_i = ibuf[0]
    cuda.syncthreads()
    return best_v, best_i


@cuda.jit(device=True)
def _block_argmax(logits, row, vbuf, ibuf):
    # Largest logit of the row, lowest id on ties; a NaN never wins (a row of NaN and -inf:
    # its first -inf; all NaN: token 0).
    tid = cuda.threadIdx.x
    best_v = NEG_INF
    best_i = logits.shape[1]
    for i in range(tid, logits.shape[1], SAMPLE_THREADS):
        v = logits[row, i]
        if _before(v, i, best_v, best_i):
            best_v = v
            best_i = i
    best_v, best_i = _tree_best(vbuf, ibuf, best_v, best_i, SAMPLE_THREADS)
    if best_i >= logits.shape[1]:
        best_i = 0  # an all-NaN / all -inf row: token 0, never out of range
    return best_v, best_i


# Greedy argmax, split: argmax_parts (grid (rows, parts)) finds the first (value, id) pair of
# each part, a contiguous span of ceil(V / parts) ids, into scratch [rows, parts]; argmax_reduce
# (grid (rows,)) the first of those. The pairs start from (-inf, V), which every element
# of the row but a NaN comes before (-inf elements by the id rule), so an empty part never
# wins and a row of NaN / -inf gives what _block_argmax gives; (value descending, id
# ascending) is a total order, so the token is _block_argmax's for every split.
ARGMAX_PART_MIN = 4096  # ids a part takes, at least (unless the row has fewer)
ARGMAX_PARTS_MAX = 64
ARGMAX_LOADS = 8  # loads a thread of argmax_parts has in flight: ids i, i + 256, ...
ARGMAX_REDUCE_THREADS = 64  # a power of two


def argmax_parts_for(vocab: int) -> int:
    """Parts of a row of `vocab` logits: ceil(vocab / ARGMAX_PART_MIN), 1 to ARGMAX_PARTS_MAX."""
    return max(1, min(ARGMAX_PARTS_MAX, -(-vocab // ARGMAX_PART_MIN)))


@kernel
def argmax_parts(logits, part_values, part_ids):
    # logits: [rows, V] f32; part_values: [rows, parts] f32, part_ids: [rows, parts] i64.
    # grid (rows, parts), block SAMPLE_THREADS: ids part * span .. (span = ceil(V / parts))
    vbuf = cuda.shared.array(SAMPLE_THREADS, np.float32)
    ibuf = cuda.shared.array(SAMPLE_THREADS, np.int64)
    vals = cuda.local.array(ARGMAX_LOADS, np.float32)
    row, part = cuda.blockIdx.x, cuda.blockIdx.y
    vocab = logits.shape[1]
    span = (vocab + part_values.shape[1] - 1) // part_values.shape[1]
    start = min(part * span, vocab)
    end = min(start + span, vocab)
    best_v = NEG_INF
    best_i = np.int64(vocab)
    for base in range(start + cuda.threadIdx.x, end, SAMPLE_THREADS * ARGMAX_LOADS):
        for j in range(ARGMAX_LOADS):  # the loads first (a NaN past the span never wins)
            i = base + j * SAMPLE_THREADS
            vals[j] = logits[row, i] if i < end else np.float32(np.nan)
        for j in range(ARGMAX_LOADS):
            i = base + j * SAMPLE_THREADS
            if _before(vals[j], i, best_v, best_i):
                best_v = vals[j]
                best_i = i
    best_v, best_i = _tree_best(vbuf, ibuf, best_v, best_i, SAMPLE_THREADS)
    if cuda.threadIdx.x == 0:
        part_values[row, part] = best_v
        part_ids[row, part] = best_i


@kernel
def argmax_reduce(part_values, part_ids, vocab, out):
    # part_values, part_ids: argmax_parts' [rows, parts]; vocab: V; out: [rows] i64.
    # grid (rows,), block ARGMAX_REDUCE_THREADS
    vbuf = cuda.shared.array(ARGMAX_REDUCE_THREADS, np.float32)
    ibuf = cuda.shared.array(ARGMAX_REDUCE_THREADS, np.int64)
    row = cuda.blockIdx.x
    best_v = NEG_INF
    best_i = np.int64(vocab)
    for p in range(cuda.threadIdx.x, part_values.shape[1], ARGMAX_REDUCE_THREADS):
        v = part_values[row, p]
        i = part_ids[row, p]
        if _before(v, i, best_v, best_i):
            best_v = v
            best_i = i
    _, best_i = _tree_best(vbuf, ibuf, best_v, best_i, ARGMAX_REDUCE_THREADS)
    if cuda.threadIdx.x == 0:
        out[row] = best_i if best_i < vocab else 0  # an all-NaN / all -inf row: token 0


@cuda.jit(device=True)
def _kept_stats(logits, row, inv_t, m, threshold, want_mass, fbuf):
    # Count (want_mass=False) or mass of the tokens whose key >= threshold.
    acc = np.float32(0.0)
    for i in range(cuda.threadIdx.x, logits.shape[1], SAMPLE_THREADS):
        z = logits[row, i] * inv_t
        if _key(z) >= threshold:
            if want_mass:
                acc += np.float32(math.exp(z - m))
            else:
                acc += np.float32(1.0)
    return block_sum(acc, fbuf)


@cuda.jit(device=True)
def _top_k_threshold(logits, row, inv_t, m, top_k, fbuf):
    lo = np.int64(_KEY_MIN)
    if top_k <= 0 or top_k >= logits.shape[1]:
        return lo
    hi = _key(m) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _kept_stats(logits, row, inv_t, m, mid, False, fbuf) >= np.float32(top_k):
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def _top_p_threshold(logits, row, inv_t, m, lo, top_p, fbuf):
    if not (top_p > 0 and top_p < 1):
        return lo
    target = np.float32(top_p) * _kept_stats(logits, row, inv_t, m, lo, True, fbuf)
    hi = _key(m) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _kept_stats(logits, row, inv_t, m, mid, True, fbuf) >= target:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True)
def _draw(logits, row, inv_t, m, threshold, u, fbuf):
    # Thread-major inverse CDF; thread 0 picks the owning thread, that thread the token.
    tid = cuda.threadIdx.x
    part = np.float32(0.0)
    for i in range(tid, logits.shape[1], SAMPLE_THREADS):
        z = logits[row, i] * inv_t
        if _key(z) >= threshold:
            part += np.float32(math.exp(z - m))
    fbuf[tid] = part
    cuda.syncthreads()
    chosen = -1
    if tid == 0:
        target = u * _sequential_total(fbuf)
        cum = np.float32(0.0)
        owner = 0
        owner_cum = np.float32(0.0)
        for t in range(SAMPLE_THREADS):
            if fbuf[t] > 0:
                owner = t
                owner_cum = cum
                if cum + fbuf[t] > target:
                    break
                cum += fbuf[t]
        fbuf[SAMPLE_THREADS] = owner_cum
        fbuf[SAMPLE_THREADS + 1] = np.float32(owner)
    cuda.syncthreads()
    if tid == np.int64(fbuf[SAMPLE_THREADS + 1]):
        target = u * _sequential_total(fbuf)
        cum = fbuf[SAMPLE_THREADS]
        for i in range(tid, logits.shape[1], SAMPLE_THREADS):
            z = logits[row, i] * inv_t
            if _key(z) >= threshold:
                chosen = i
                cum += np.float32(math.exp(z - m))
                if cum > target:
                    break
    return chosen


@cuda.jit(device=True)
def _sequential_total(fbuf):
    total = np.float32(0.0)
    for t in range(SAMPLE_THREADS):
        total += fbuf[t]
    return total


@kernel
def sample(logits, temperatures, top_ks, top_ps, seeds, positions, out):
    # logits: [rows, V] f32; temperatures, top_ps: [rows] f32; top_ks: [rows] i32;
    # seeds: [rows] u64; positions: [rows] i64; out: [rows] i64. grid (rows,)
    vbuf = cuda.shared.array(SAMPLE_THREADS, np.float32)
    ibuf = cuda.shared.array(SAMPLE_THREADS, np.int64)
    fbuf = cuda.shared.array(_FBUF_SIZE, np.float32)
    row = cuda.blockIdx.x
    temperature = temperatures[row]
    best_v, best_i = _block_argmax(logits, row, vbuf, ibuf)
    if not temperature > 0:
        if cuda.threadIdx.x == 0:
            out[row] = best_i
        return
    inv_t = np.float32(1.0) / temperature
    m = best_v * inv_t
    lo = _top_k_threshold(logits, row, inv_t, m, top_ks[row], fbuf)
    lo = _top_p_threshold(logits, row, inv_t, m, lo, top_ps[row], fbuf)
    chosen = _draw(logits, row, inv_t, m, lo, uniform(seeds[row], positions[row]), fbuf)
    if chosen >= 0:
        out[row] = chosen
