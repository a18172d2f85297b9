"""CPU paged attention: values vs a float64 NumPy reference, and a row's bits independent of
the call it is in (other rows, other streams, how rows are cut into calls, row blocks, chunks
and threads). Stream 0's run of 40 rows spans two row blocks (32 rows); stream 2's rows end
on both sides of key and value tile edges; page tables are out of order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from tests.test_cpu_kernels import attention_reference
from tf_async.backend.cpu import kernels
from tf_async.backend.cpu.ops import CpuOps

OPS = CpuOps()
ROOT = Path(__file__).resolve().parent.parent
PAGE_SIZE, NUM_PAGES, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 5, 62, 2, 6, 32
# stream -> its pages in position order (shuffled arena order): 60, 50 and 200 positions, so
# stream 2 spans two key tiles (128 keys) and four value tiles (64)
_SHUFFLED = np.random.default_rng(21).permutation(NUM_PAGES).tolist()
PAGE_MAP = [_SHUFFLED[:12], _SHUFFLED[12:22], _SHUFFLED[22:]]


@dataclass(slots=True, frozen=True)
class Case:
    q: np.ndarray  # [rows, nh, hd] float32
    kv: np.ndarray  # [1, 2, slots, nkv, hd]
    scales: np.ndarray  # [1, 2] float32
    block_table: np.ndarray  # [seqs, max_pages] int32
    row_seq: np.ndarray  # [rows] int32
    row_pos: np.ndarray  # [rows] int64

    def run(self, rows: np.ndarray) -> np.ndarray:
        return OPS.attention(self.q[rows], self.kv, 0, self.scales, self.block_table,
                             self.row_seq[rows], self.row_pos[rows], PAGE_SIZE, 0.17)

    def reference(self) -> np.ndarray:
        return attention_reference(self.q, self.kv[0], tuple(self.scales[0]), self.block_table,
                                   self.row_seq, self.row_pos, PAGE_SIZE, 0.17)


def mixed_case(kv_dtype: str, seed: int = 3, head_dim: int = HEAD_DIM) -> Case:
    """Stream 0: a prompt run 0..39 (longer than a row block); stream 1: rows with gaps;
    stream 2: runs across tile edges and a decode row; interleaved as a round might send."""
    rng = np.random.default_rng(seed)
    kv = OPS.alloc_kv(1, NUM_PAGES * PAGE_SIZE, NUM_KV_HEADS, head_dim, kv_dtype)
    scales = np.array([[0.06, 0.09]], np.float32) if kv_dtype == "fp8" else None
    for pages in PAGE_MAP:
        pos = np.arange(len(pages) * PAGE_SIZE)
        slots = np.array(pages, np.int64)[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        k = rng.standard_normal((pos.size, NUM_KV_HEADS, head_dim)).astype(np.float32)
        v = rng.standard_normal((pos.size, NUM_KV_HEADS, head_dim)).astype(np.float32)
        OPS.kv_write(kv, 0, k, v, slots, scales)
    width = max(len(p) for p in PAGE_MAP)
    table = np.array([p + [-1] * (width - len(p)) for p in PAGE_MAP], np.int32)
    runs = [(2, [70, 71, 72]), (0, list(range(40))), (1, [3, 7, 8, 20, 33, 34, 49]),
            (2, list(range(124, 132))), (2, [199]), (0, [55, 59]), (1, [0]), (2, [63, 64])]
    row_seq = np.array([s for s, ps in runs for _ in ps], np.int32)
    row_pos = np.array([p for _, ps in runs for p in ps], np.int64)
    q = rng.standard_normal((row_seq.size, NUM_HEADS, head_dim)).astype(np.float32)
    return Case(q, kv, np.ones((1, 2), np.float32) if scales is None else scales, table,
                row_seq, row_pos)


def random_splits(case: Case, seed: int) -> np.ndarray:
    """All rows in their order, cut into calls of random sizes (1..25 rows)."""
    rng = np.random.default_rng(seed)
    rows, parts = case.row_seq.size, []
    start = 0
    while start < rows:
        stop = min(rows, start + int(rng.integers(1, 26)))
        parts.append(case.run(np.arange(start, stop)))
        start = stop
    return np.concatenate(parts)


def assert_rows_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    for r in range(want.shape[0]):
        assert np.array_equal(got[r], want[r], equal_nan=True), f"row {r}: {what}"


@pytest.mark.parametrize(("kv_dtype", "head_dim"), [("f32", 32), ("bf16", 32), ("fp8", 32),
                                                    ("f32", 30)])
def test_attention_matches_float64_reference(kv_dtype: str, head_dim: int) -> None:
    case = mixed_case(kv_dtype, head_dim=head_dim)  # head_dim 30: the score loop's d tail
    out = case.run(np.arange(case.row_seq.size))
    np.testing.assert_allclose(out, case.reference(), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize(("kv_dtype", "head_dim"), [("f32", 32), ("bf16", 32), ("f32", 30)])
def test_row_bits_do_not_depend_on_the_call(kv_dtype: str, head_dim: int) -> None:
    case = mixed_case(kv_dtype, head_dim=head_dim)
    rows = case.row_seq.size
    whole = case.run(np.arange(rows))
    one_by_one = np.concatenate([case.run(np.array([r])) for r in range(rows)])
    assert_rows_equal(one_by_one, whole, "one row per call")
    for seed in (1, 2):
        assert_rows_equal(random_splits(case, seed), whole, f"random split {seed}")
    order = np.random.default_rng(5).permutation(rows)
    assert_rows_equal(case.run(order), whole[order], "shuffled rows")
    stream0 = np.flatnonzero(case.row_seq == 0)
    others = np.flatnonzero(case.row_seq != 0)
    interleaved = np.empty(stream0.size + others.size, np.int64)
    interleaved[0::2][:others.size], interleaved[1::2][:others.size] = others, stream0[:others.size]
    interleaved[2 * others.size:] = stream0[others.size:]
    assert_rows_equal(case.run(interleaved), whole[interleaved], "interleaved streams")
    assert_rows_equal(case.run(stream0), whole[stream0], "stream 0 alone")
    reversed_run = stream0[::-1]
    assert_rows_equal(case.run(reversed_run), whole[reversed_run], "stream 0 reversed")


THREADS_SCRIPT = textwrap.dedent("""
    import sys
    import numba
    import numpy as np
    from tests.test_cpu_attention import mixed_case, random_splits

    case = mixed_case(sys.argv[2])
    outs = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        outs[f"whole{threads}"] = case.run(np.arange(case.row_seq.size))
        outs[f"split{threads}"] = random_splits(case, 7)
    np.savez(sys.argv[1], **outs)
""")


@pytest.mark.parametrize("kv_dtype", ["bf16"])
def test_row_bits_do_not_depend_on_threads(kv_dtype: str, tmp_path: Path) -> None:
    # A fresh process: this one runs Numba with one thread (conftest).
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    saved = tmp_path / "outs.npz"
    done = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(saved), kv_dtype], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    case = mixed_case(kv_dtype)
    one_by_one = np.concatenate([case.run(np.array([r])) for r in range(case.row_seq.size)])
    with np.load(saved) as outs:
        for name in outs.files:
            assert_rows_equal(outs[name], one_by_one, name)


@njit(cache=False)
def _transpose_blocks(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(0, src.shape[0] - 7, 8):
        for d in range(0, src.shape[1] - 7, 8):
            kernels.transpose8(src, i * src.shape[1] + d, dst, d * dst.shape[1] + i)


def test_transpose8_moves_8x8_blocks_exactly() -> None:
    src = np.random.default_rng(4).standard_normal((16, 24)).astype(np.float32)
    dst = np.full((24, 20), np.nan, np.float32)  # a row stride other than src's
    _transpose_blocks(src, dst)
    assert np.array_equal(dst[:, :16], src.T)
    assert np.isnan(dst[:, 16:]).all()


@njit(cache=False)
def _scores_chains(qs, ids, keys_t, num_keys, sm_scale, scores, first):
    # the scalar chains scores_group keeps: fma over d ascending from 0, then * sm_scale
    for v in ids:
        for j in range(num_keys):
            a = np.float32(0.0)
            for d in range(keys_t.shape[0]):
                a = kernels.fma32(qs[v, d], keys_t[d, j], a)
            scores[v, first + j] = a * sm_scale


@njit(cache=False)
def _values_chains(probs, ids, values, j0, j1, acc):
    # the scalar chains values_group keeps: fma over keys ascending into acc
    for v in ids:
        for d in range(acc.shape[1]):
            for j in range(j0, j1):
                acc[v, d] = kernels.fma32(probs[v, j], values[j, d], acc[v, d])


@njit(cache=False)
def _scores_group(qs, ids, count, keys_t, num_keys, sm_scale, scores, first):
    kernels.scores_group(qs, ids, count, keys_t, num_keys, sm_scale, scores, first)


@njit(cache=False)
def _values_group(probs, ids, count, src, kind, slots, slot_base, kv_head, j0, j1, acc):
    kernels.values_group(probs, ids, count, src, kind, slots, slot_base, kv_head, j0, j1, acc)


@pytest.mark.parametrize("head_dim", [64, 32, 30, 8, 3])
def test_group_kernels_keep_each_elements_chain(head_dim: int) -> None:
    """scores_group and values_group (1 to 4 vectors sharing each load, chains held in
    registers, 8 * 4 or 8 * 2 keys / dims a block, then 8, then one by one; values read in place
    through a slot list, f32 or bf16 bits, in chunks of keys) give the bits of the scalar chains
    for every count of keys and vectors, touching only the rows they name."""
    rng = np.random.default_rng(head_dim)
    keys_t = rng.standard_normal((head_dim, 128)).astype(np.float32)
    qs = rng.standard_normal((6, head_dim)).astype(np.float32)
    probs = rng.random((6, 160)).astype(np.float32)
    stored = rng.standard_normal((2, 200, 3, head_dim)).astype(np.float32)
    bf16 = (stored.view(np.uint32) >> 16).astype(np.uint16)
    slots = rng.permutation(200).astype(np.int64)
    for count in (1, 2, 3, 4):
        ids = rng.permutation(6)[:count].astype(np.int64)
        for num_keys in (0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 128):
            got = np.full((6, 140), np.nan, np.float32)
            want = got.copy()
            _scores_group(qs, ids, count, keys_t, num_keys, np.float32(0.17), got, 5)
            _scores_chains(qs, ids, keys_t, num_keys, np.float32(0.17), want, 5)
            assert np.array_equal(got, want, equal_nan=True), ("scores", count, num_keys)
        for src, floats in ((stored, stored), (bf16, (bf16.astype(np.uint32) << 16).view(np.float32))):
            for j0, j1 in ((0, 0), (0, 1), (3, 20), (10, 43), (0, 160)):
                rows = floats[1, slots[np.arange(160) - 0], 2] if j1 <= 160 else None
                acc = np.full((6, head_dim), np.nan, np.float32)
                acc[ids] = rng.standard_normal((count, head_dim)).astype(np.float32)
                acc_want = acc.copy()
                _values_group(probs, ids, count, src, 1, slots, 0, 2, j0, j1, acc)
                _values_chains(probs, ids, rows, j0, j1, acc_want)
                assert np.array_equal(acc, acc_want, equal_nan=True), ("values", count, j0, j1)
    # slot_base: key j's row is slots[j - slot_base] (a tile's rows)
    acc = np.zeros((6, head_dim), np.float32)
    acc_want = acc.copy()
    ids = np.array([4, 1], np.int64)
    _values_group(probs, ids, 2, stored, 0, slots, 40, 1, 40, 90, acc)
    shifted = np.zeros((90, head_dim), np.float32)
    shifted[40:] = stored[0, slots[:50], 1]
    _values_chains(probs, ids, shifted, 40, 90, acc_want)
    assert np.array_equal(acc, acc_want)


@pytest.mark.parametrize("page_size", [16, 5, 3])
def test_keys_go_straight_into_the_transposed_tile(page_size: int) -> None:
    """_load_keys_t on f32 and bf16 KV (8 keys at a time: loaded, converted and transposed by
    keys_t8, slots walked page by page) equals the stored keys' float32, transposed, for any
    page size, tile start and key count; fp8 takes the row-major path (_load_tile), same
    values as that path."""
    rng = np.random.default_rng(page_size)
    num_pages = 200 // page_size + 2
    pages = rng.permutation(num_pages).astype(np.int32)
    for kv_dtype in ("bf16", "f32", "fp8"):
        kv = OPS.alloc_kv(1, num_pages * page_size, 2, 64, kv_dtype)
        k = rng.standard_normal((num_pages * page_size, 2, 64)).astype(np.float32)
        scales = np.array([[0.05, 0.05]], np.float32) if kv_dtype == "fp8" else None
        OPS.kv_write(kv, 0, k, k, np.arange(k.shape[0], dtype=np.int64), scales)
        scale = np.float32(0.05 if kv_dtype == "fp8" else 1.0)
        for first, num_keys in ((0, 128), (0, 13), (128, 67), (128, 8), (0, 1)):
            keys_t = np.full((64, 128), np.nan, np.float32)
            rows = np.empty((128, 64), np.float32)
            kernels._load_keys_t(kv[0], scale, pages, first, num_keys, page_size, 1, rows, keys_t)
            tile = np.full((128, 64), np.nan, np.float32)
            kernels._load_tile(kv[0], 0, scale, pages, first, num_keys, page_size, 1, tile)
            assert np.array_equal(keys_t[:, :num_keys], tile[:num_keys].T), (kv_dtype, first, num_keys)
            assert np.isnan(keys_t[:, num_keys:]).all()
            if kv_dtype != "fp8":
                pos = np.arange(first, first + num_keys)
                slots = pages[pos // page_size].astype(np.int64) * page_size + pos % page_size
                stored = (kv[0, 0].astype(np.uint32) << 16).view(np.float32) if kv_dtype == "bf16" else kv[0, 0]
                assert np.array_equal(tile[:num_keys], stored[slots, 1])


@njit(cache=False)
def _decode_row_chains(q, kv_layer, pages, pos, page_size, sm_scale, out):
    # one decode row, head by head, as the scalar chains: score_j = fma over d ascending from
    # 0, times sm_scale; p = exp(s - max) (the kernel's softmax); acc = fma(p_j, V[j], acc) for j
    # ascending over 0..pos; out = acc / sum(p)
    num_keys, group = pos + 1, q.shape[0] // kv_layer.shape[2]
    scores = np.empty(num_keys, np.float32)
    for h in range(q.shape[0]):
        for j in range(num_keys):
            slot = np.int64(pages[j // page_size]) * page_size + j % page_size
            a = np.float32(0.0)
            for d in range(q.shape[1]):
                a = kernels.fma32(q[h, d], kv_layer[0, slot, h // group, d], a)
            scores[j] = a * sm_scale
        total = kernels._softmax_in_place(scores, num_keys)
        for d in range(q.shape[1]):
            acc = np.float32(0.0)
            for j in range(num_keys):
                slot = np.int64(pages[j // page_size]) * page_size + j % page_size
                acc = kernels.fma32(scores[j], kv_layer[1, slot, h // group, d], acc)
            out[h, d] = acc / total


@pytest.mark.parametrize(("num_keys", "nkv", "rows"),
                         [(1, 3, 1), (63, 3, 1), (65, 3, 1), (300, 3, 1), (1100, 3, 1),
                          (700, 1, 3), (600, 2, 2), (900, 3, 2)])
def test_a_decode_rows_bits_are_its_chains_over_every_key(num_keys: int, nkv: int, rows: int) -> None:
    """A decode row's keys, read in tiles and stretches with the next ones prefetched, still
    go through each score's chain and each output's one chain in ascending key order: the
    bits of the scalar chains (f32 KV, read in place), for one row or several, any KV heads."""
    rng = np.random.default_rng(num_keys)
    page_size, nh, hd = 16, 6, 64
    per_stream = num_keys // page_size + 2
    pages = rng.permutation(rows * per_stream + 8)[: rows * per_stream].astype(np.int32)
    block_table = pages.reshape(rows, per_stream)
    kv_layer = rng.standard_normal((2, (pages.max() + 1) * page_size, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((rows, nh, hd)).astype(np.float32)
    positions = np.array([num_keys - 1 - 7 * r for r in range(rows)], np.int64)
    got = np.full_like(q, np.nan)
    kernels.paged_attention(q, kv_layer, 1.0, 1.0, block_table, np.arange(rows, dtype=np.int32),
                            positions, page_size, 0.125, got)
    for r in range(rows):
        want = np.full((nh, hd), np.nan, np.float32)
        _decode_row_chains(q[r], kv_layer, block_table[r], positions[r], page_size,
                           np.float32(0.125), want)
        assert np.array_equal(got[r], want), r
