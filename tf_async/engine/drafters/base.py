"""What the drafters with a context in the lane's run share: open / release, the propose
template (a failed draft only costs speed) and the stats."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...backend.base import Array, Ops
from ..choice import TargetChooser
from ..drafting import zero_stats
from .contexts import DraftContext, DraftContexts

if TYPE_CHECKING:
    from ..sequence import Sequence

log = logging.getLogger("tf_async.drafting")


class ContextDrafter:
    """Base of `draft:PATH` and `mtp`: one DraftContext (borrowed area or owned) a stream."""

    name = "context"

    def __init__(self, ops: Ops, kv_scales: Array, contexts: DraftContexts, draft_tokens: int):
        self.ops = ops  # the target's Ops: the drafter's arrays live in the target's run
        self.kv_scales = kv_scales  # of the drafter's K/V rows (fp8), else None / ones
        self.choose = TargetChooser(ops)  # each draft as the target will pick it
        self.contexts = contexts
        self.draft_tokens = draft_tokens
        self.num_drafted = 0
        self.num_accepted = 0

    # ---- lifecycle ----------------------------------------------------------------------
    def is_open(self, seq: Sequence) -> bool:
        return self.contexts.get(seq) is not None

    def open(self, seq: Sequence) -> None:
        assert seq.lane is not None
        self.contexts.open(seq.lane, seq.request_id)

    def release(self, lane: int) -> None:
        self.contexts.release(lane)

    # ---- drafting -----------------------------------------------------------------------
    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """Up to `limit` drafts; on any failure this stream decodes without drafts."""
        ctx = self.contexts.get(seq)
        limit = min(limit, self.draft_tokens)
        if ctx is None or limit <= 0 or not self._ready(ctx, seq):
            return ()
        try:
            return self._draft(ctx, seq, limit)
        except Exception:  # noqa: BLE001 - drafts only change speed; plain decode goes on
            log.exception("%s drafting failed for request %d; decoding without drafts",
                          self.name, seq.request_id)
            self._reset(ctx)
            return ()

    def _ready(self, ctx: DraftContext, seq: Sequence) -> bool:
        return True

    def _draft(self, ctx: DraftContext, seq: Sequence, limit: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _reset(self, ctx: DraftContext) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        areas = self.contexts.areas
        return {**zero_stats(), "drafted_tokens": self.num_drafted,
                "accepted_tokens": self.num_accepted, "draft_areas_in_use": areas.num_in_use,
                "draft_areas_bytes": areas.num_bytes, "draft_area_bytes_in_use": areas.bytes_in_use,
                "draft_contexts_owned": self.contexts.num_owned}


def until_stop(seq: Sequence, proposed: list[int]) -> tuple[int, ...]:
    """The proposed tokens before the first of seq's stop tokens (the target emits those)."""
    drafts: list[int] = []
    for token in proposed:
        if token in seq.stop_ids:
            break
        drafts.append(int(token))
    return tuple(drafts)
