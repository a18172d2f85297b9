"""Page pool and runs: integers only, no arrays.

A run is what an open lane owns in the arena: its KV pages (taken on demand from the shared
pool with paging, or the lane's own contiguous block of `pages_per_lane` pages without).

    paging:     lane 0 run -> [7, 2, 9]     (any free pages, in the order taken)
    no paging:  lane 1 run -> [16..31]      (lane * pages_per_lane + 0..pages_per_lane-1)
"""

from __future__ import annotations

from collections import deque

from .prefix import PrefixCache


def pages_for_rows(num_rows: int, page_size: int) -> int:
    return -(-num_rows // page_size)


class PagePool:
    """Free list of page ids; pages are handed out in FIFO order of release."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages, or None (nothing taken) when they do not fit."""
        if not self.can_allocate(num_pages):
            return None
        return [self._free.popleft() for _ in range(num_pages)]

    def free(self, page_ids: list[int]) -> None:
        self._free.extend(page_ids)


class Runs:
    """Which pages each lane's run holds. `reserve` grows a run to cover `num_rows` rows.

    With a prefix cache (paging only), a run may start with cached pages that other runs hold
    too (`share`); a run's full pages are published to the cache (`publish`) and, when the run
    closes, stay cached (idle) until a reserve runs short and evicts them."""

    def __init__(self, *, paging: bool, num_lanes: int, pages_per_lane: int, page_size: int,
                 num_pages: int, prefix_cache: bool = False):
        self.paging = paging
        self.page_size = page_size
        self.pages_per_lane = pages_per_lane
        self.pool = PagePool(num_pages if paging else num_lanes * pages_per_lane)
        self.cache = PrefixCache() if prefix_cache and paging else None
        self._runs: dict[int, list[int]] = {}

    @property
    def num_pages_total(self) -> int:
        return self.pool.num_pages

    @property
    def num_pages_in_use(self) -> int:
        """Distinct pages held by open runs (a shared cached page counts once)."""
        return len({page for pages in self._runs.values() for page in pages})

    @property
    def num_available(self) -> int:
        """Pages a reserve may take: free ones, then idle cached ones (evicted on the way)."""
        return self.pool.num_free + (self.cache.num_idle if self.cache is not None else 0)

    def can_take(self, num_pages: int) -> bool:
        return num_pages <= self.num_available

    def _take(self, num_pages: int) -> list[int] | None:
        if not self.can_take(num_pages):
            return None
        short = num_pages - self.pool.num_free
        if short > 0 and self.cache is not None:
            self.pool.free(self.cache.evict(short))
        return self.pool.allocate(num_pages)

    def share(self, lane: int, page_ids: list[int]) -> None:
        """Append cached pages to a run whose every page is full (read-only from now on)."""
        assert self.cache is not None
        for page_id in page_ids:
            self.cache.hold(page_id)
        self._runs[lane].extend(page_ids)

    def publish(self, lane: int, page_index: int, key: bytes, tokens: tuple[int, ...],
                previous: bytes) -> None:
        """Offer the run's full page `page_index` to the cache (a page already cached stays)."""
        assert self.cache is not None
        page_id = self._runs[lane][page_index]
        if not self.cache.is_cached(page_id) and self.cache.publish(page_id, key, tokens, previous):
            self.cache.num_missed_pages += 1

    def publish_partial(self, lane: int, page_index: int, tokens: tuple[int, ...],
                        previous: bytes) -> None:
        """Offer the committed rows (`tokens`) of the run's page `page_index`, before it closes."""
        assert self.cache is not None
        page_id = self._runs[lane][page_index]
        if not self.cache.is_cached(page_id):
            self.cache.publish_partial(page_id, tokens, previous)

    def pages(self, lane: int) -> list[int]:
        return self._runs.get(lane, [])

    def is_open(self, lane: int) -> bool:
        return lane in self._runs

    def open(self, lane: int) -> list[int]:
        """Open an empty run (paging) or the lane's whole block (no paging); return new pages."""
        assert lane not in self._runs, f"run of lane {lane} opened twice"
        if self.paging:
            self._runs[lane] = []
            return []
        first = lane * self.pages_per_lane
        self._runs[lane] = list(range(first, first + self.pages_per_lane))
        return list(self._runs[lane])

    def pages_needed(self, lane: int, num_rows: int) -> int:
        return max(0, pages_for_rows(num_rows, self.page_size) - len(self._runs[lane]))

    def reserve(self, lane: int, num_rows: int) -> list[int] | None:
        """Grow the run to cover rows [0, num_rows); return the new pages, or None if no fit."""
        needed = self.pages_needed(lane, num_rows)
        if needed == 0:
            return []
        if not self.paging:
            return None  # a contiguous run never grows past ctx
        taken = self._take(needed)
        if taken is not None:
            self._runs[lane].extend(taken)
        return taken

    def can_reserve(self, lane: int, num_rows: int) -> bool:
        needed = self.pages_needed(lane, num_rows)
        return needed == 0 or (self.paging and self.can_take(needed))

    def close(self, lane: int) -> list[int]:
        """Return the run's pages (to the pool with paging; cached ones stay cached, idle once
        no run holds them, last page first: eviction keeps a chain's head, which every page
        after it needs, longest). Closing twice is a no-op."""
        pages = self._runs.pop(lane, None)
        if pages is None:
            return []
        if self.paging and self.cache is not None:
            for page_id in reversed(pages):  # the tail goes idle first: evicted before the head
                if self.cache.is_cached(page_id):
                    self.cache.drop(page_id)
            self.pool.free([p for p in pages if not self.cache.is_cached(p)])
        elif self.paging:
            self.pool.free(pages)
        return pages
