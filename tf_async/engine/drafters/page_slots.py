"""MTP slots beside the prefix cache's pages: what a resumed stream's MTP ring is rebuilt from.

The MTP ring holds slot s = (token x_{s+1}, target hidden h_s) at ring row s % capacity. Both
depend only on the tokens up to position s + 1, so the slot of position p (= slot p - 1) is
kept on the KV page that holds position p, and each page also keeps h of its last position
(the state a ring continues from). A page's slots are therefore fixed by the page's chain key,
like its KV: a stream that resumes from cached pages copies their slots into its ring instead
of running the target over the prefix again (which the cache exists to avoid).

    page i:   | slot rows of positions iP .. iP+P-1 (page 0: from position 1) | h_{iP+P-1} |
    complete: every row and h written, in order, by one stream; recorded with the page's key

Rows are copied from the ring right after the ring gets them (same bytes, same KV dtype and
scales), so a rebuilt ring holds the bits a fresh ring would. Any write to a page forgets that
it was complete; a page is used for a rebuild only while it is complete under the key the
resuming stream expects there (so a page reused for other tokens is never read as the old one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...backend.base import Array, Ops

if TYPE_CHECKING:
    from ..pages import Runs
    from ..sequence import Sequence

PageKey = Callable[["Sequence", int], bytes]  # (stream, page index) -> the page's chain key


class PageSlots:
    """Slot rows and last hiddens of every page of the pool (allocated once, at start)."""

    def __init__(self, ops: Ops, kv: Array, hidden: Array, runs: Runs, page_key: PageKey):
        self.ops = ops
        self.kv = kv  # [1, 2, num_pages * page_size, kv_heads, head_dim], the ring's dtype
        self.hidden = hidden  # [num_pages, H] f32: h at each page's last position
        self.runs = runs
        self.page_key = page_key
        self.page_size = runs.page_size
        self._next_row: dict[int, int] = {}  # page id -> rows written in order from its first
        self._has_hidden: set[int] = set()
        self._complete: dict[int, bytes] = {}  # page id -> key of the page its slots belong to

    @property
    def num_bytes(self) -> int:
        return int(self.kv.nbytes) + int(self.hidden.nbytes)

    # ---- keep: ring -> pages --------------------------------------------------------------
    def keep(self, seq: Sequence, ring: Array, first_pos: int, stop_pos: int) -> None:
        """Copy the ring's slots of positions [first_pos, stop_pos) to the stream's pages.
        ring: [1, 2, capacity, kv_heads, head_dim]."""
        if stop_pos <= first_pos:
            return
        pos = np.arange(first_pos, stop_pos, dtype=np.int64)
        rows = self._page_rows(seq, pos)
        put = self.ops.asarray
        self.kv[0][:, put(rows)] = ring[0][:, put((pos - 1) % int(ring.shape[2]))]
        size, table = self.page_size, self.runs.pages(self._lane(seq))
        for p in pos.tolist():
            self._note_row(table[p // size], p % size, p < size)
            self._check_complete(seq, p // size)

    def keep_hidden(self, seq: Sequence, hidden: Array, start_pos: int, stop_pos: int) -> None:
        """h of each page's last position among [start_pos, stop_pos) (hidden: [rows, H], rows
        of positions start_pos..)."""
        size, table = self.page_size, self.runs.pages(self._lane(seq))
        for p in range(start_pos + (size - 1 - start_pos) % size, stop_pos, size):
            page_id = table[p // size]
            self.hidden[page_id] = hidden[p - start_pos]
            self._complete.pop(page_id, None)
            self._has_hidden.add(page_id)
            self._check_complete(seq, p // size)

    def _note_row(self, page_id: int, row: int, first_page: bool) -> None:
        self._complete.pop(page_id, None)
        if row == (1 if first_page else 0):  # the page's first slot row: a new page's start
            self._next_row[page_id] = row + 1
            self._has_hidden.discard(page_id)
        elif self._next_row.get(page_id) == row:
            self._next_row[page_id] = row + 1
        else:  # a gap: this page's slots are not whole
            self._next_row.pop(page_id, None)

    def _check_complete(self, seq: Sequence, page_index: int) -> None:
        """A page whose every slot row and last hidden are written is recorded with its key."""
        page_id = self.runs.pages(self._lane(seq))[page_index]
        if self._next_row.get(page_id) == self.page_size and page_id in self._has_hidden:
            self._complete[page_id] = self.page_key(seq, page_index)

    # ---- rebuild: pages -> ring -----------------------------------------------------------
    def can_rebuild(self, seq: Sequence, num_positions: int) -> bool:
        """Whether the stream's pages hold every slot of positions < num_positions (a page
        boundary) and the last hidden, each complete under the key the stream expects."""
        size, table = self.page_size, self.runs.pages(self._lane(seq))
        if num_positions <= 0 or num_positions % size or len(table) * size < num_positions:
            return False
        return all(self._complete.get(table[i]) == self.page_key(seq, i)
                   for i in range(num_positions // size))

    def copy_to_ring(self, seq: Sequence, ring: Array, state: Array, num_positions: int) -> None:
        """Slots of positions [1, num_positions) (the last `capacity` of them) into the ring,
        and h_{num_positions - 1} into state ([H] f32)."""
        capacity = int(ring.shape[2])
        pos = np.arange(max(1, num_positions - capacity), num_positions, dtype=np.int64)
        put = self.ops.asarray
        if len(pos):
            ring[0][:, put((pos - 1) % capacity)] = self.kv[0][:, put(self._page_rows(seq, pos))]
        last_page = self.runs.pages(self._lane(seq))[num_positions // self.page_size - 1]
        state[...] = self.hidden[last_page]

    def _page_rows(self, seq: Sequence, pos: np.ndarray) -> np.ndarray:
        table = np.asarray(self.runs.pages(self._lane(seq)), np.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    @staticmethod
    def _lane(seq: Sequence) -> int:
        assert seq.lane is not None
        return seq.lane


def make_page_slots(ops: Ops, runs: Runs, page_key: PageKey, *, num_kv_heads: int, head_dim: int,
                    hidden_size: int, ring_dtype: type) -> PageSlots:
    """PageSlots for every page of the pool, in the ring's dtype (allocated once, at start)."""
    num_rows = runs.num_pages_total * runs.page_size
    kv = ops.xp.zeros((1, 2, num_rows, num_kv_heads, head_dim), dtype=ring_dtype)
    hidden = ops.xp.zeros((runs.num_pages_total, hidden_size), dtype=np.float32)
    return PageSlots(ops, kv, hidden, runs, page_key)
