"""The scheduler's prefix-cache half (docs/PREFIX_CACHE.md): page keys, reuse before a prompt
cut (shared full pages, copied rows of a partial page), publishing, and for hybrids the kept
recurrent states. Integers only, like the scheduler; what a plan must do on the device goes
out through `take_plan_parts` (states to keep and resume, page copies).

    run before a cut:  | shared full pages | copied rows | rows to compute ... |
                       ^ 0                 ^ page boundary ^ num_computed
"""

from __future__ import annotations

from .pages import Runs
from .prefix import StateSlots, next_key, root_key
from .sequence import Sequence


class PrefixPlanner:
    """Owned by the scheduler. `state_slots` is set for hybrids with a prefix cache (build)."""

    def __init__(self, runs: Runs, *, cache_identity: bytes, recurrent: bool):
        self.runs = runs
        self.cache_identity = cache_identity  # what else makes a page's KV (prefix.root_key)
        self.recurrent = recurrent
        self.state_slots: StateSlots | None = None
        self.states_to_keep: list[tuple[int, int]] = []  # (lane, slot) since the last plan
        self.states_to_resume: list[tuple[int, int]] = []  # (slot, lane)
        self.page_copies: list[tuple[int, int, int]] = []  # (source, page, rows) this plan
        self._copy_sources: list[int] = []  # cached pages held until the copies have run

    def take_plan_parts(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...],
                                       tuple[tuple[int, int, int], ...]]:
        """(states to keep, states to resume, page copies) for the plan being built; cleared."""
        parts = (tuple(self.states_to_keep), tuple(self.states_to_resume),
                 tuple(self.page_copies))
        self.states_to_keep.clear()
        self.states_to_resume.clear()
        self.page_copies.clear()
        if self.state_slots is not None:
            self.state_slots.unpin_all()
        return parts

    def page_key(self, seq: Sequence, page_index: int) -> bytes:
        """Chain key of the stream's page `page_index` (keys are computed once a stream)."""
        while len(seq.page_keys) <= page_index:
            i = len(seq.page_keys)
            previous = seq.page_keys[-1] if seq.page_keys else root_key(self.cache_identity,
                                                                        seq.cache_salt)
            seq.page_keys.append(next_key(previous, self._page_tokens(seq, i)))
        return seq.page_keys[page_index]

    def _page_tokens(self, seq: Sequence, page_index: int) -> tuple[int, ...]:
        size = self.runs.page_size
        return tuple(seq.token_slice(page_index * size, (page_index + 1) * size))

    def _prev_key(self, seq: Sequence, page_index: int) -> bytes:
        """The key before the stream's page `page_index` (the root before the first page)."""
        if page_index == 0:
            return root_key(self.cache_identity, seq.cache_salt)
        return self.page_key(seq, page_index - 1)

    def reuse(self, seq: Sequence, pages_to_zero: list[int]) -> None:
        """Before a prompt cut whose run ends on a page boundary: take the cached pages that
        continue the stream's tokens (never its last token: its logits are needed). Hybrids
        take them only up to a kept state (the lane continues from that state); dense models
        then copy the rows of a cached page that continue further (_copy_rows)."""
        cache, lane, size = self.runs.cache, seq.lane, self.runs.page_size
        if cache is None or lane is None or len(self.runs.pages(lane)) * size != seq.num_computed:
            return
        first = seq.num_computed // size
        found: list[int] = []
        for i in range(first, (seq.num_tokens - 1) // size):
            page_id = cache.lookup(self.page_key(seq, i), self._page_tokens(seq, i))
            if page_id is None:
                break
            found.append(page_id)
        if self.recurrent:
            found = found[:self._resume_state(seq, first, len(found))]
        if found:
            self.runs.share(lane, found)
            cache.num_hit_pages += len(found)
            if seq.num_computed == 0:  # (a preempted stream counts its last admission)
                seq.num_cached_tokens = 0
            prompt_left = max(0, len(seq.prompt_ids) - seq.num_computed)
            seq.num_cached_tokens += min(len(found) * size, prompt_left)
            seq.num_computed += len(found) * size
            seq.num_published = len(self.runs.pages(lane))
        if not self.recurrent:
            self._copy_rows(seq, pages_to_zero)

    def _copy_rows(self, seq: Sequence, pages_to_zero: list[int]) -> None:
        """Dense models, run on a page boundary: rows of a cached page (a closed stream's
        partial last page, or a page that goes on differently) that continue the stream's
        tokens are copied into a new page of the run instead of computed (plan.page_copies).
        The source is held until the copy has run, so nothing evicts or zeroes it first."""
        cache, lane, size = self.runs.cache, seq.lane, self.runs.page_size
        assert cache is not None and lane is not None
        start = seq.num_computed
        stop = min(start + size, seq.num_tokens - 1)  # the last token is computed (its logits)
        if stop <= start:
            return
        found = cache.lookup_rows(self._prev_key(seq, start // size),
                                  tuple(seq.token_slice(start, stop)))
        if found is None:
            return
        source, num_rows = found
        cache.hold(source)  # before the reserve: it must not evict the source
        new_pages = self.runs.reserve(lane, start + num_rows)
        if not new_pages:
            cache.drop(source)
            return
        self._copy_sources.append(source)
        pages_to_zero.extend(new_pages)
        self.page_copies.append((source, new_pages[0], num_rows))
        cache.num_copied_rows += num_rows
        seq.num_cached_tokens += min(num_rows, max(0, len(seq.prompt_ids) - start))
        seq.num_computed += num_rows

    def drop_copy_sources(self) -> None:
        if self.runs.cache is not None:
            for page_id in self._copy_sources:
                self.runs.cache.drop(page_id)
        self._copy_sources.clear()

    def _resume_state(self, seq: Sequence, first: int, num_pages: int) -> int:
        """Hybrids: the most cached pages past the run's `first` pages (<= num_pages) after
        which a state is kept; the lane resumes from that state (plan.states_to_resume).
        0: none, the lane keeps its own state (zero at a stream's start)."""
        assert seq.lane is not None
        slots = self.state_slots
        if slots is None:
            return 0
        for count in range(num_pages, 0, -1):
            slot = slots.lookup(self.page_key(seq, first + count - 1))
            if slot is not None:
                slots.pin(slot)
                self.states_to_resume.append((slot, seq.lane))
                slots.num_resumed += 1
                return count
        return 0

    def _is_state_point(self, seq: Sequence, pos: int) -> bool:
        """Hybrids: boundaries whose state is kept for good: every N pages, and the last page
        boundary of the stream's prompt."""
        assert self.state_slots is not None
        size = self.runs.page_size
        every = self.state_slots.every_pages * size
        return pos % every == 0 or pos == len(seq.prompt_ids) // size * size

    def rows_to_next_state(self, seq: Sequence) -> int:
        """Hybrids with kept states: a prompt cut stops at the next state point, so the state
        there can be kept after the round (else the cut may take every pending row)."""
        if self.state_slots is None:
            return seq.num_pending
        size = self.runs.page_size
        every = self.state_slots.every_pages * size
        stop = (seq.num_computed // every + 1) * every
        prompt_end = len(seq.prompt_ids) // size * size
        if seq.num_computed < prompt_end:
            stop = min(stop, prompt_end)
        return stop - seq.num_computed

    def keep_state(self, seq: Sequence) -> None:
        """Hybrids: after a round that left the stream's state exactly at a page boundary,
        keep a copy of it for streams that resume from there: for good at a state point, else
        as the stream's one moving state. (The copy runs after the plan's state commits, so a
        lane that verified drafts is at num_computed by then.)"""
        lane, size, slots = seq.lane, self.runs.page_size, self.state_slots
        if (slots is None or lane is None or seq.num_computed == 0
                or seq.num_computed % size):
            return
        key = self.page_key(seq, seq.num_computed // size - 1)
        if self._is_state_point(seq, seq.num_computed):
            slot = slots.take(key)
        else:
            slot = slots.take(key, replacing=seq.moving_state_key)
            if slot is not None:
                seq.moving_state_key = key
        if slot is not None:
            self.states_to_keep.append((lane, slot))

    def state_stats(self) -> dict[str, int]:
        return self.state_slots.stats() if self.state_slots is not None else {}

    def publish_pages(self, seq: Sequence) -> None:
        """Offer the run's newly full pages (every row committed) to the prefix cache."""
        if self.runs.cache is None or seq.lane is None:
            return
        full = seq.num_computed // self.runs.page_size
        for i in range(seq.num_published, full):
            self.runs.publish(seq.lane, i, self.page_key(seq, i), self._page_tokens(seq, i),
                              self._prev_key(seq, i))
        seq.num_published = max(seq.num_published, full)

    def publish_partial(self, seq: Sequence) -> None:
        """Dense models, as the run closes: the committed rows of its partial last page."""
        size = self.runs.page_size
        if self.runs.cache is None or seq.lane is None or self.recurrent or not seq.num_computed % size:
            return
        page_index = seq.num_computed // size
        tokens = tuple(seq.token_slice(page_index * size, seq.num_computed))
        self.runs.publish_partial(seq.lane, page_index, tokens, self._prev_key(seq, page_index))

    def cache_stats(self) -> dict[str, int]:
        return self.runs.cache.stats() if self.runs.cache is not None else {}

    def drop_copies_into(self, released: list[int]) -> None:
        """A planned copy into a page of a released run runs only if the page stayed cached
        (it is then that page's content: held, like a source, until the copy has run); a page
        back in the pool may be anyone's next."""
        cache = self.runs.cache
        if cache is None or not self.page_copies:
            return
        kept = []
        for copy in self.page_copies:
            if copy[1] not in released:
                kept.append(copy)
            elif cache.is_cached(copy[1]):
                cache.hold(copy[1])
                self._copy_sources.append(copy[1])
                kept.append(copy)
        self.page_copies[:] = kept
