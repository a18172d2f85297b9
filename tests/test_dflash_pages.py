"""ContextPages (engine/drafters/dflash_pages.py) on a tiny pool with exact page ids: rows are
kept at their KV's page rows, count only while written in order by the page's occupant, a full
page only under the key it was filled with; copies carry rows; forgetting drops pages."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tf_async.backend.cpu.ops import CpuOps
from tf_async.engine.drafters.dflash_pages import make_context_pages
from tf_async.engine.pages import Runs

PAGE, HIDDEN = 4, 3


def _setup(keys: dict[tuple[int, int], bytes] | None = None):
    runs = Runs(paging=True, num_lanes=2, pages_per_lane=4, page_size=PAGE, num_pages=8)
    keys = {} if keys is None else keys

    def page_key(seq, index: int) -> bytes:
        return keys.get((seq.lane, index), b"k%d" % index)

    pages = make_context_pages(CpuOps(), runs, page_key, HIDDEN)
    return runs, pages, keys


def _seq(lane: int):
    return SimpleNamespace(lane=lane)


def _rows(first: int, stop: int) -> np.ndarray:
    return np.arange(first * HIDDEN, stop * HIDDEN, dtype=np.float32).reshape(-1, HIDDEN)


def test_rows_land_on_their_page_rows_and_read_back() -> None:
    runs, pages, _ = _setup()
    runs.open(0)
    assert runs.reserve(0, 10) == [0, 1, 2]
    seq = _seq(0)
    pages.keep(seq, _rows(0, 6), 0, 6)
    pages.keep(seq, _rows(6, 10), 6, 10)
    assert pages.rows.shape == (8 * PAGE, HIDDEN) and pages.num_bytes == 8 * PAGE * HIDDEN * 4
    assert np.array_equal(pages.rows[2 * PAGE + 1], _rows(9, 10)[0])  # position 9: page 2, row 1
    assert pages.can_rebuild(seq, 0, 10) and pages.can_rebuild(seq, 3, 10)
    assert not pages.can_rebuild(seq, 0, 11)  # row 2 of page 2 never written
    assert np.array_equal(pages.rows_of(seq, 2, 9), _rows(2, 9))


def test_a_gap_or_a_wrong_key_is_never_read() -> None:
    runs, pages, keys = _setup()
    runs.open(0)
    runs.reserve(0, 8)
    seq = _seq(0)
    pages.keep(seq, _rows(0, 2), 0, 2)
    pages.keep(seq, _rows(3, 8), 3, 8)  # position 2 missing: page 0 is not whole
    assert not pages.can_rebuild(seq, 0, 4) and pages.can_rebuild(seq, 4, 8)
    keys[(0, 1)] = b"other tokens"  # page 1 now expected under another chain key
    assert not pages.can_rebuild(seq, 4, 8) and pages.can_rebuild(seq, 4, 7)  # partial: no key


def test_a_new_occupant_restarts_a_page_and_forget_drops_it() -> None:
    runs, pages, _ = _setup()
    runs.open(0)
    runs.reserve(0, 8)
    seq = _seq(0)
    pages.keep(seq, _rows(0, 8), 0, 8)
    pages.forget(seq, 5, 8)  # KV of positions 5..7 written without their rows: page 1 goes
    assert pages.can_rebuild(seq, 0, 4) and not pages.can_rebuild(seq, 4, 5)
    pages.keep(seq, _rows(4, 5) + 100, 4, 5)  # row 0 again: a new occupant starts page 1
    assert pages.can_rebuild(seq, 4, 5) and not pages.can_rebuild(seq, 4, 6)


def test_copied_rows_travel_with_the_kv_copy() -> None:
    runs, pages, _ = _setup()
    runs.open(0)
    runs.open(1)
    runs.reserve(0, 6)  # pages 0, 1
    runs.reserve(1, 4)  # page 2
    pages.keep(_seq(0), _rows(0, 6), 0, 6)
    pages.copy(((1, 2, 2),))  # rows 0..1 of page 1 -> page 2 (a partial page of a prefix)
    assert np.array_equal(pages.rows[2 * PAGE: 2 * PAGE + 2], _rows(4, 6))
    assert pages.can_rebuild(_seq(1), 0, 2) and not pages.can_rebuild(_seq(1), 0, 3)
    pages.copy(((1, 3, 3),))  # page 1 has only 2 rows: nothing to carry, page 3 not readable
    runs.reserve(1, 8)
    assert runs.pages(1) == [2, 3]
    assert not pages.can_rebuild(_seq(1), 4, 5)
