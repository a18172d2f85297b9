"""DFlash context rows beside the prefix cache's pages: what a resumed stream's ring is
rebuilt from (docs/DFLASH.md, "Resumed streams").

The ring row of position p is a function of ctx[p] = hidden_norm(fc(target layers at p)),
which depends only on the tokens up to p, so ctx[p] is kept at the page row that holds p's KV
(same page id, same row). A stream resuming from cached pages reads the ctx rows of the
positions its ring needs and projects them into every drafter layer's K/V (row-independent
ops: the bits a fresh ring holds), instead of running the target over the prefix again.

    page:   | ctx rows 0 .. filled-1, written in order by the page's occupant | not yet |
    valid:  rows [0, filled); a full page also under the chain key it was filled with

Any write that breaks the order forgets the page; rows copied between pages (a partial last
page of a shared prefix) carry their ctx rows with them (Runner.on_page_copies); a stream that
writes KV without ctx rows (its drafter stopped) forgets the pages it writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...backend.base import Array, Ops
from .page_slots import PageKey

if TYPE_CHECKING:
    from ..pages import Runs
    from ..sequence import Sequence


class ContextPages:
    """Context rows of every page row of the pool (allocated once, at start)."""

    def __init__(self, ops: Ops, rows: Array, runs: Runs, page_key: PageKey):
        self.ops = ops
        self.rows = rows  # [num_pages * page_size, H] f32
        self.runs = runs
        self.page_key = page_key
        self.page_size = runs.page_size
        self._filled: dict[int, int] = {}  # page id -> rows [0, n) hold its occupant's ctx
        self._keys: dict[int, bytes] = {}  # full page id -> the chain key it was filled under

    @property
    def num_bytes(self) -> int:
        return int(self.rows.nbytes)

    # ---- keep -------------------------------------------------------------------------------
    def keep(self, seq: Sequence, ctx: Array, first_pos: int, stop_pos: int) -> None:
        """ctx [stop_pos - first_pos, H]: the context rows of positions [first_pos, stop_pos)."""
        if stop_pos <= first_pos:
            return
        pos = np.arange(first_pos, stop_pos, dtype=np.int64)
        self.rows[self.ops.asarray(self._page_rows(seq, pos))] = ctx
        table, size = self.runs.pages(_lane(seq)), self.page_size
        for p in pos.tolist():
            self._note_row(table[p // size], p % size)
            if p % size == size - 1 and self._filled.get(table[p // size]) == size:
                self._keys[table[p // size]] = self.page_key(seq, p // size)

    def forget(self, seq: Sequence, first_pos: int, stop_pos: int) -> None:
        """The stream wrote KV of positions [first_pos, stop_pos) without their ctx rows."""
        table, size = self.runs.pages(_lane(seq)), self.page_size
        for index in range(first_pos // size, min(-(-stop_pos // size), len(table))):
            self._drop(table[index])

    def copy(self, copies: tuple[tuple[int, int, int], ...]) -> None:
        """(source, page, rows): rows [0, rows) of page source copied into page (as the KV)."""
        size = self.page_size
        for source, page, num_rows in copies:
            self._drop(page)
            if self._filled.get(source, 0) >= num_rows:
                self.rows[page * size: page * size + num_rows] = \
                    self.rows[source * size: source * size + num_rows]
                self._filled[page] = num_rows

    def _note_row(self, page_id: int, row: int) -> None:
        self._keys.pop(page_id, None)
        if row == 0:  # a page's first row: a new occupant starts it
            self._filled[page_id] = 1
        elif self._filled.get(page_id) == row:
            self._filled[page_id] = row + 1
        else:  # a gap: the page's rows are not whole
            self._filled.pop(page_id, None)

    def _drop(self, page_id: int) -> None:
        self._filled.pop(page_id, None)
        self._keys.pop(page_id, None)

    # ---- rebuild ----------------------------------------------------------------------------
    def can_rebuild(self, seq: Sequence, first_pos: int, stop_pos: int) -> bool:
        """Whether the stream's pages hold the ctx rows of positions [first_pos, stop_pos):
        each page's rows filled that far, a full page under the key the stream expects."""
        table, size = self.runs.pages(_lane(seq)), self.page_size
        if stop_pos <= first_pos or len(table) * size < stop_pos:
            return False
        for index in range(first_pos // size, -(-stop_pos // size)):
            need = min(size, stop_pos - index * size)
            page_id = table[index]
            if self._filled.get(page_id, 0) < need:
                return False
            if need == size and self._keys.get(page_id) != self.page_key(seq, index):
                return False
        return True

    def rows_of(self, seq: Sequence, first_pos: int, stop_pos: int) -> Array:
        """The kept ctx rows [stop_pos - first_pos, H] of positions [first_pos, stop_pos)."""
        pos = np.arange(first_pos, stop_pos, dtype=np.int64)
        return self.rows[self.ops.asarray(self._page_rows(seq, pos))]

    def _page_rows(self, seq: Sequence, pos: np.ndarray) -> np.ndarray:
        table = np.asarray(self.runs.pages(_lane(seq)), np.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size


def _lane(seq: Sequence) -> int:
    assert seq.lane is not None
    return seq.lane


def make_context_pages(ops: Ops, runs: Runs, page_key: PageKey, hidden_size: int) -> ContextPages:
    """ContextPages for every page of the pool, f32 (allocated once, at start)."""
    rows = ops.xp.zeros((runs.num_pages_total * runs.page_size, hidden_size), dtype=np.float32)
    return ContextPages(ops, rows, runs, page_key)
