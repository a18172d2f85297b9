"""`ngram`: prompt lookup in the stream's own tokens; no model, no memory in the run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BadInputError
from ..drafting import count_accepted, zero_stats

if TYPE_CHECKING:
    from ...models.checkpoint import Checkpoint
    from ..drafting import DrafterSpec
    from ..options import EngineOptions
    from ..runner import Runner
    from ..sched import Scheduler
    from ..sequence import SeqRows, Sequence


def make_ngram_drafter(spec: DrafterSpec, options: EngineOptions, ckpt: Checkpoint,
                       runner: Runner, scheduler: Scheduler) -> NgramDrafter:
    return NgramDrafter(options.draft_tokens, min_ngram=options.ngram_min)


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
