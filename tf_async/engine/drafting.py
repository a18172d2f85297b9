"""Speculative decoding: the drafter interface the scheduler drives (the drafters themselves
and their registry of kinds live in engine/drafters/).

The scheduler drives a drafter through four calls, all on the engine thread:

    open(seq)            after the target's first prompt step, before its rows are taken
    propose(seq, limit)  while building a round: up to min(limit, k) draft token ids
    absorb(seq, rows, num_new_tokens, hidden)   after every step of the stream: after
                         verification (sched._accept), and with 0 new tokens mid-prompt
    release(lane)        from the lane's one release path (Lanes release hook)

Verification lives in sched._accept: a draft is kept while it equals what the target itself
samples at that position, so drafted output == plain output by construction.

Ring drafters (draft model, MTP) keep K/V rows in a context whose buffers are an area
borrowed from the lane's run (area.py, drafters/contexts.py); when the arena's region is
full the context owns its buffers and comes from a pool. Borrowed contexts are destroyed on
release, never pooled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .sequence import SeqRows, Sequence


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


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    """A parsed `--drafter` value (drafters/registry.py: parse_drafter)."""

    kind: str  # a name of drafters/registry.py's KINDS
    path: str | None = None  # the checkpoint of a kind that takes one (`draft:PATH`)
