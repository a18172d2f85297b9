"""Prefix cache: full KV pages shared read-only between runs, keyed by a chain of page keys.
Integers only, like pages.py.

A page's key hashes (the key of the page before it, the page's tokens); the first page's
"before" is the cache's root, which hashes everything else that changes a page's KV (model,
KV dtype and scales) and the request's cache salt. A page is published once every row of it
holds committed KV; from then on no run writes it (a run writes rows >= num_computed, on pages
past its shared prefix), so any run whose tokens give the same keys may read it.

    page:     | held by runs (holders > 0) | idle: cached, no run (LRU order) | free |
    publish:  run page  -> cached (held); a closing run's partial last page too (rows copied)
    close:    held -> idle when its last holder closes (or free when never published)
    evict:    idle (least recently used first) -> free, only when the pool runs short
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def root_key(engine_salt: bytes, cache_salt: str | None) -> bytes:
    """The key before a stream's first page: the engine's KV identity and the request's salt."""
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return hashlib.sha256(engine_salt + b"\x00" + salt).digest()[:16]


def next_key(previous: bytes, tokens: tuple[int, ...]) -> bytes:
    digest = hashlib.sha256(previous)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return digest.digest()[:16]


@dataclass(slots=True)
class _Entry:
    page_id: int
    tokens: tuple[int, ...]  # checked on every match: a hash collision is a miss, not a mix-up
    key: bytes | None  # None: a partial page (found only through `previous`, rows copied)
    previous: bytes  # the key before the page (of the page before it, or the root)


class PrefixCache:
    """Cached pages by key; how many runs hold each; LRU order of the idle ones.

    Full pages are shared. Every cached page, full or partial (a closed run's last page, its
    committed rows only), is also found by the key before it, for the rows a stream may copy
    from it: the longest common start of its tokens and the stream's (`lookup_rows`)."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, _Entry] = {}
        self._entries: dict[int, _Entry] = {}  # page id -> entry
        self._after: dict[bytes, dict[int, None]] = {}  # previous key -> page ids after it
        self._holders: dict[int, int] = {}  # cached page id -> runs holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.num_hit_pages = 0
        self.num_missed_pages = 0
        self.num_evictions = 0
        self.num_copied_rows = 0

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._entries

    def lookup(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        entry = self._by_key.get(key)
        return entry.page_id if entry is not None and entry.tokens == tokens else None

    def lookup_rows(self, previous: bytes, tokens: tuple[int, ...]) -> tuple[int, int] | None:
        """(page id, rows) of the cached page after `previous` whose tokens start the most
        like `tokens` (>= 1 row in common), or None."""
        best: tuple[int, int] | None = None
        for page_id in self._after.get(previous, {}):
            num_rows = _common_start(self._entries[page_id].tokens, tokens)
            if num_rows and (best is None or num_rows > best[1]):
                best = (page_id, num_rows)
        return best

    def hold(self, page_id: int) -> None:
        """A run takes a cached page (from idle, or already held by another run)."""
        self._holders[page_id] += 1
        self._idle.pop(page_id, None)

    def drop(self, page_id: int) -> None:
        """A run that held a cached page closes; the page goes idle with its last holder."""
        self._holders[page_id] -= 1
        if self._holders[page_id] == 0:
            self._idle[page_id] = None

    def publish(self, page_id: int, key: bytes, tokens: tuple[int, ...], previous: bytes) -> bool:
        """Cache a run's full page (held by that run). False when the key is cached already
        (the run's copy stays its own and is freed on close)."""
        if key in self._by_key or page_id in self._entries:
            return False
        self._by_key[key] = self._add(_Entry(page_id, tokens, key, previous))
        return True

    def publish_partial(self, page_id: int, tokens: tuple[int, ...], previous: bytes) -> bool:
        """Cache the committed rows of a closing run's last page (held by that run until it
        closes). False when a cached page after `previous` starts with those tokens already."""
        if page_id in self._entries:
            return False
        found = self.lookup_rows(previous, tokens)
        if found is not None and found[1] == len(tokens):
            return False
        self._add(_Entry(page_id, tokens, None, previous))
        return True

    def _add(self, entry: _Entry) -> _Entry:
        self._entries[entry.page_id] = entry
        self._after.setdefault(entry.previous, {})[entry.page_id] = None
        self._holders[entry.page_id] = 1
        return entry

    def evict(self, num_pages: int) -> list[int]:
        """Forget up to `num_pages` idle pages, least recently used first; return their ids."""
        evicted: list[int] = []
        while self._idle and len(evicted) < num_pages:
            page_id, _ = self._idle.popitem(last=False)
            entry = self._entries.pop(page_id)
            if entry.key is not None:
                del self._by_key[entry.key]
            after = self._after[entry.previous]
            del after[page_id]
            if not after:
                del self._after[entry.previous]
            del self._holders[page_id]
            evicted.append(page_id)
        self.num_evictions += len(evicted)
        return evicted

    def stats(self) -> dict[str, int]:
        return {"cached_pages": self.num_cached, "cached_pages_idle": self.num_idle,
                "prefix_cache_hit_pages": self.num_hit_pages,
                "prefix_cache_missed_pages": self.num_missed_pages,
                "prefix_cache_evictions": self.num_evictions,
                "prefix_cache_copied_rows": self.num_copied_rows}


def _common_start(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    num = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        num += 1
    return num


class StateSlots:
    """Hybrids: recurrent states kept at page boundaries, by the key of the page they follow.
    Integers only: slot ids; the runner copies lane state <-> slot (RoundPlan.states_to_keep,
    states_to_resume). A resumed stream needs its pages cached and the state after the last
    of them. Slots are reused least recently used first; a slot a plan resumes from is pinned
    until that plan is built (a keep in the same plan would overwrite it first).

    Which boundaries (prefix_plan.keep_state): every `every_pages` pages and each prompt's last page
    boundary (prompt cuts stop there), plus one moving state a stream: the newest other
    boundary it reached (a decode round's), which replaces that stream's previous one."""

    def __init__(self, num_slots: int, every_pages: int) -> None:
        self.num_slots = num_slots
        self.every_pages = every_pages
        self._slot_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._pinned: set[int] = set()
        self.num_kept = 0
        self.num_resumed = 0

    def lookup(self, key: bytes) -> int | None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._lru.move_to_end(slot)
        return slot

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def take(self, key: bytes, replacing: bytes | None = None) -> int | None:
        """A slot for the state after the page of `key`, or None when that state is kept
        already (or every slot is pinned). The slot of `replacing` when it is still kept (a
        stream's moving state), else the least recently used one; its old state is forgotten."""
        if key in self._slot_of:
            return None
        slot = self._slot_of.get(replacing) if replacing is not None else None
        if slot is None or slot in self._pinned:
            slot = next((s for s in self._lru if s not in self._pinned), None)
            if slot is None:
                return None
        del self._lru[slot]
        old = self._key_of.pop(slot, None)
        if old is not None:
            del self._slot_of[old]
        self._slot_of[key], self._key_of[slot] = slot, key
        self._lru[slot] = None
        self.num_kept += 1
        return slot

    def stats(self) -> dict[str, int]:
        return {"prefix_state_slots": self.num_slots, "prefix_states_kept": self.num_kept,
                "prefix_states_resumed": self.num_resumed}
