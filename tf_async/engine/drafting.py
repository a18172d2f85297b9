"""Speculative decoding: the drafter interface, drafter contexts, and `attach_drafter`.

The scheduler drives a drafter through four calls, all on the engine thread:

    open(seq)            after the target's first prompt step, before its rows are taken
    propose(seq, limit)  while building a round: up to min(limit, k) draft token ids
    absorb(seq, rows, num_new_tokens, hidden)   after every step of the stream: after
                         verification (sched._accept), and with 0 new tokens mid-prompt
    release(lane)        from the lane's one release path (Lanes release hook)

Verification lives in sched._accept: a draft is kept while it equals what the target itself
samples at that position, so drafted output == plain output by construction.

Ring drafters (draft model, MTP) keep K/V rows in a context whose buffers are an area
borrowed from the lane's run (area.py); when the arena's region is full the context owns
its buffers and comes from a pool. Borrowed contexts are destroyed on release, never pooled.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import BadInputError
from .area import AreaLayout, AreaPool, AreaViews, alloc_region, area_views, owned_views

if TYPE_CHECKING:
    from ..models.checkpoint import Checkpoint
    from .lanes import Lanes
    from .runner import Runner
    from .sched import Scheduler
    from .sequence import SeqRows, Sequence

log = logging.getLogger("tf_async.drafting")


class Drafter(Protocol):
    name: str
    num_drafted: int
    num_accepted: int

    def is_open(self, seq: Sequence) -> bool: ...
    def open(self, seq: Sequence) -> None: ...
    def release(self, lane: int) -> None: ...
    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]: ...
    def absorb(self, seq: Sequence, rows: SeqRows, num_new_tokens: int, hidden: Any) -> None: ...
    def stats(self) -> dict[str, int]: ...


def count_accepted(drafter: Drafter, rows: SeqRows, num_new_tokens: int) -> None:
    """Drafted and accepted counts of a round's rows (mid-prompt steps sample nothing)."""
    if num_new_tokens > 0:
        drafter.num_drafted += len(rows.draft_ids)
        drafter.num_accepted += num_new_tokens - 1


def zero_stats() -> dict[str, int]:
    return {"drafted_tokens": 0, "accepted_tokens": 0, "draft_areas_in_use": 0,
            "draft_areas_bytes": 0, "draft_area_bytes_in_use": 0, "draft_contexts_owned": 0}


# ---- contexts ------------------------------------------------------------------------------
@dataclass(slots=True)
class DraftContext:
    """One stream's drafter state. `views` is None once a borrowed context is destroyed."""

    views: AreaViews | None
    area_offset: int | None  # byte offset in the arena region when borrowed
    lane: int = -1
    request_id: int = -1
    num_valid: int = 0  # ring rows [0, num_valid) hold committed tokens
    base_pos: int = 0  # position of the first draft fed in the last propose
    num_fed: int = 0  # drafts whose ring rows were written in the last propose
    has_state: bool = False  # views.state holds the hidden of position num_valid (MTP)

    @property
    def borrowed(self) -> bool:
        return self.views is not None and self.views.borrowed

    def reset(self, lane: int, request_id: int) -> None:
        self.lane, self.request_id = lane, request_id
        self.num_valid = self.base_pos = self.num_fed = 0
        self.has_state = False


class DraftContexts:
    """Open contexts by lane; areas from the arena region; a pool of owned fallbacks."""

    def __init__(self, xp: Any, layout: AreaLayout, region: Any, areas: AreaPool):
        self.xp = xp
        self.layout = layout
        self.region = region
        self.areas = areas
        self.open_by_lane: dict[int, DraftContext] = {}
        self.pool: list[DraftContext] = []  # owned contexts only
        self.num_owned = 0

    def open(self, lane: int, request_id: int) -> DraftContext:
        """Borrow an area of the run (or take an owned context); a second open is refused."""
        if lane in self.open_by_lane:
            raise BadInputError(f"drafter already open for lane {lane} "
                                f"(request {self.open_by_lane[lane].request_id})")
        offset = self.areas.allocate(self.layout.num_bytes)
        if offset is not None:
            ctx = DraftContext(area_views(self.region, offset, self.layout), offset)
        else:
            ctx = self.pool.pop() if self.pool else self._new_owned()
        ctx.reset(lane, request_id)
        self.open_by_lane[lane] = ctx
        assert ctx.views is not None
        ctx.views.ring.fill(0)  # a run is zeroed when it opens
        ctx.views.state.fill(0)
        return ctx

    def _new_owned(self) -> DraftContext:
        self.num_owned += 1
        return DraftContext(owned_views(self.xp, self.layout), None)

    def release(self, lane: int) -> None:
        """Borrowed: destroy and give the area back. Owned: back to the pool. Twice: no-op."""
        ctx = self.open_by_lane.pop(lane, None)
        if ctx is None:
            return
        if should_pool(ctx):
            self.pool.append(ctx)
        else:
            self._destroy(ctx)

    def _destroy(self, ctx: DraftContext) -> None:
        assert ctx.area_offset is not None
        self.areas.free(ctx.area_offset)
        ctx.views, ctx.area_offset = None, None

    def get(self, seq: Sequence) -> DraftContext | None:
        ctx = self.open_by_lane.get(seq.lane) if seq.lane is not None else None
        return ctx if ctx is not None and ctx.request_id == seq.request_id else None


def should_pool(ctx: DraftContext) -> bool:
    """Only contexts that own their buffers go back to the pool (DESIGN invariant 4)."""
    return not ctx.borrowed


# ---- ngram --------------------------------------------------------------------------------
class NgramDrafter:
    """Prompt lookup: find the longest suffix n-gram (n = 3..2) earlier in the stream's own
    tokens and propose the tokens that followed its most recent earlier occurrence. A single
    matching token predicts too little: drafting on it costs more than it wins on free text.

    Adaptive length: each stream proposes at most `cap` tokens, where cap starts at
    draft_tokens, drops to (accepted + 1) after a round that rejected a draft and doubles
    (up to draft_tokens) after a round that accepted every draft. Free text, whose matches
    rarely continue, then verifies one draft row instead of draft_tokens; quoted text climbs
    back to the full length in a few rounds. Outputs never depend on it (drafted == plain)."""

    name = "ngram"

    def __init__(self, draft_tokens: int, max_ngram: int = 3, min_ngram: int = 2):
        self.draft_tokens = draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_drafted = 0
        self.num_accepted = 0
        self._open: dict[int, int] = {}  # lane -> request id
        self._cap: dict[int, int] = {}  # lane -> most tokens its next proposal may have

    def is_open(self, seq: Sequence) -> bool:
        return seq.lane is not None and self._open.get(seq.lane) == seq.request_id

    def open(self, seq: Sequence) -> None:
        assert seq.lane is not None
        if seq.lane in self._open:
            raise BadInputError(f"drafter already open for lane {seq.lane}")
        self._open[seq.lane] = seq.request_id
        self._cap[seq.lane] = self.draft_tokens

    def release(self, lane: int) -> None:
        self._open.pop(lane, None)
        self._cap.pop(lane, None)

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        if not self.is_open(seq):
            return ()
        assert seq.lane is not None
        limit = min(limit, self.draft_tokens, self._cap[seq.lane])
        if limit <= 0:
            return ()
        drafts = ngram_lookup(np.asarray([*seq.prompt_ids, *seq.output_ids], np.int64),
                              self.max_ngram, limit, self.min_ngram)
        return tuple(t for t in _until_stop(drafts, seq.stop_ids))

    def absorb(self, seq: Sequence, rows: SeqRows, num_new_tokens: int, hidden: Any) -> None:
        count_accepted(self, rows, num_new_tokens)
        drafted = len(rows.draft_ids)
        if num_new_tokens > 0 and drafted and self.is_open(seq):
            assert seq.lane is not None
            accepted = num_new_tokens - 1
            cap = self._cap[seq.lane]
            self._cap[seq.lane] = (min(self.draft_tokens, 2 * cap) if accepted >= drafted
                                   else accepted + 1)

    def stats(self) -> dict[str, int]:
        return {**zero_stats(), "drafted_tokens": self.num_drafted,
                "accepted_tokens": self.num_accepted}


def ngram_lookup(tokens: np.ndarray, max_ngram: int, limit: int, min_ngram: int = 1) -> list[int]:
    """Up to `limit` tokens that followed the most recent earlier match of the longest suffix
    of min_ngram..max_ngram tokens."""
    length = tokens.shape[0]
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - size:]
        starts = length - size  # candidate starts 0..starts-1 (not the suffix itself)
        match = np.ones(starts, bool)
        for j in range(size):
            match &= tokens[j: j + starts] == suffix[j]
        found = np.flatnonzero(match)
        if found.size:
            first = int(found[-1]) + size
            return tokens[first: first + limit].tolist()
    return []


def _until_stop(drafts: list[int], stop_ids: frozenset[int]) -> list[int]:
    """Drafts up to (not including) a stop token: the target emits stops itself."""
    for i, token in enumerate(drafts):
        if token in stop_ids:
            return drafts[:i]
    return drafts


# ---- attach ------------------------------------------------------------------------------
def parse_drafter(spec: str) -> tuple[str, str | None]:
    """`ngram` | `mtp` | `draft:PATH` -> (kind, path)."""
    if spec in ("ngram", "mtp"):
        return spec, None
    if spec.startswith("draft:") and len(spec) > len("draft:"):
        return "draft", spec[len("draft:"):]
    raise BadInputError(f"unknown drafter {spec!r}: expected ngram, mtp or draft:PATH",
                        param="drafter")


def attach_drafter(options: dict[str, Any], ckpt: Checkpoint, scheduler: Scheduler,
                   runner: Runner, lanes: Lanes) -> Drafter:
    """Build the drafter of options["drafter"], give ring drafters their arena region, and
    hook its release into the lane's one release path."""
    kind, path = parse_drafter(options["drafter"])
    drafter: Drafter
    if kind == "ngram":
        drafter = NgramDrafter(options["draft_tokens"], min_ngram=int(options.get("ngram_min", 2)))
    else:
        from .drafters.model import make_ring_drafter

        drafter = make_ring_drafter(kind, path, options, ckpt, runner, lanes.num_lanes,
                                    make_contexts=_make_contexts)
    scheduler.drafter = drafter
    lanes.add_release_hook(drafter.release)
    return drafter


def _make_contexts(runner: Runner, layout: AreaLayout, num_areas: int) -> DraftContexts:
    """Allocate the arena's drafter region (once, at start) for `num_areas` areas."""
    stride = -(-layout.num_bytes // 256) * 256
    region = runner.arena.add_drafter_region(alloc_region(runner.ops.xp, num_areas * stride))
    return DraftContexts(runner.ops.xp, layout, region, AreaPool(num_areas * stride))


def num_areas_option(options: dict[str, Any], num_lanes: int) -> int:
    """Areas in the region: options["draft_areas"] or env TF_DRAFT_AREAS, default one a lane."""
    value = options.get("draft_areas")
    if value is None and os.environ.get("TF_DRAFT_AREAS"):
        value = int(os.environ["TF_DRAFT_AREAS"])
    value = num_lanes if value is None else value
    if not isinstance(value, int) or value < 0:
        raise BadInputError("draft_areas must be an integer >= 0", param="draft_areas")
    return value
