"""Drafter contexts: one stream's ring and hidden state, in an area borrowed from the lane's
run (engine/area.py) or, when the arena's region is full, in owned buffers from a pool."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import BadInputError
from ..area import AreaLayout, AreaPool, AreaViews, alloc_region, area_views, owned_views

if TYPE_CHECKING:
    from ..runner import Runner
    from ..sequence import Sequence

log = logging.getLogger("tf_async.drafting")

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
    num_kept: int = 0  # MTP with a prefix cache: slots of positions < num_kept are on pages
    num_pending: int = 0  # MTP: slots [num_valid - num_pending, num_valid) not yet in the ring

    @property
    def borrowed(self) -> bool:
        return self.views is not None and self.views.borrowed

    def reset(self, lane: int, request_id: int) -> None:
        self.lane, self.request_id = lane, request_id
        self.num_valid = self.base_pos = self.num_fed = 0
        self.has_state = False
        self.num_kept = self.num_pending = 0


def room_in_ring(ctx: DraftContext, first_pos: int) -> int:
    """Positions from first_pos on that a call may attend with every position before them in
    its own ring row (the ring holds positions [0, capacity) unwrapped)."""
    assert ctx.views is not None
    return int(ctx.views.ring.shape[2]) - first_pos


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


def sync_or_stop_drafting(ctx: DraftContext, seq: Sequence, sync: Callable[[], None],
                          drafter_name: str) -> None:
    """Run a ring drafter's sync of the rows a step committed; if it fails, the stream goes on
    without drafts (its outputs never depend on them) and the failure is logged."""
    try:
        sync()
    except Exception:  # noqa: BLE001 - a drafter failure must not fail the stream
        log.exception("%s sync failed for request %d; decoding without drafts", drafter_name,
                      seq.request_id)
        ctx.num_valid = -1


def should_pool(ctx: DraftContext) -> bool:
    """Only contexts that own their buffers go back to the pool (DESIGN invariant 4)."""
    return not ctx.borrowed


def make_contexts(runner: Runner, layout: AreaLayout, num_areas: int) -> DraftContexts:
    """Allocate the arena's drafter region (once, at start) for `num_areas` areas."""
    stride = -(-layout.num_bytes // 256) * 256
    split = runner.arena.split  # tensor parallel: a region a rank, the layout a rank's heads
    region = runner.arena.add_drafter_region(
        alloc_region(runner.ops.xp, num_areas * stride) if split is None
        else split.alloc_region(num_areas * stride, alloc_region))
    return DraftContexts(runner.ops.xp, layout, region, AreaPool(num_areas * stride))
