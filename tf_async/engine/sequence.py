"""A request's state inside the engine thread, and the plan/result/event dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..api_types import SamplingParams

if TYPE_CHECKING:
    from .grammar import TokenMask


@dataclass(slots=True)
class Sequence:
    """Owned by the engine thread. KV rows [0, num_computed) of `tokens` are in the run
    (hybrids: and in the lane's recurrent state once the round's state commits have run)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    lane: int | None = None
    num_computed: int = 0
    admitted_round: int = -1
    cancelled: bool = False
    finished: bool = False
    num_preemptions: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    draft_misses: int = 0  # drafted rounds in a row with every draft rejected
    draft_pause: int = 0  # decode rounds left without drafting (Scheduler.draft_backoff)
    cache_salt: str | None = None  # prefix cache: streams share pages only with equal salts
    page_keys: list[bytes] = field(default_factory=list)  # chain keys of full token pages
    num_published: int = 0  # pages of the current run offered to the prefix cache
    num_cached_tokens: int = 0  # prompt rows taken from the prefix cache
    moving_state_key: bytes | None = None  # hybrids: the key of the stream's moving kept state
    mask: TokenMask | None = None  # the grammar state of a constrained request (its outputs so far)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending > 1

    def token_slice(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt: stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]

    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


@dataclass(frozen=True, slots=True)
class TokenChoice:
    """How to choose the token of one logit row without the host (integers and floats only):
    the arguments of the device sampler (Ops.sample / Ops.argmax, backend/base.py) for that
    row. Set only for requests that need nothing host-only (no logprobs, no penalties, no
    min_p); the others keep the host sampler (engine/sampling.py)."""

    temperature: float  # 0.0: greedy (argmax, ties: lowest id), as sample_token
    top_k: int
    top_p: float
    seed: int  # the sequence's seed mod 2**64 (the device takes it as uint64)
    position: int  # the position the token is drawn for: seq.num_tokens at that row

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True, slots=True)
class SeqRows:
    """The rows one stream contributes to a round: tokens at positions start_pos.."""

    request_id: int
    lane: int
    start_pos: int
    token_ids: tuple[int, ...]
    num_logit_rows: int  # 0 mid-prompt; 1 to sample the next token; 1 + k to verify k drafts
    draft_ids: tuple[int, ...] = ()
    # one per logit row when the token may be chosen on the device, else () (host path)
    choices: tuple[TokenChoice, ...] = ()

    def committed_end(self, num_new_tokens: int) -> int:
        """The stream's computed rows after the round, when it kept `num_new_tokens` tokens:
        every row before the logit rows, then one a kept token (a rejected draft's row and
        those after it are not committed)."""
        return self.start_pos + len(self.token_ids) - self.num_logit_rows + num_new_tokens


@dataclass(frozen=True, slots=True)
class RoundPlan:
    rows: tuple[SeqRows, ...]
    block_tables: dict[int, tuple[int, ...]]  # lane -> its run's page ids
    pages_to_zero: tuple[int, ...]
    lanes_to_zero: tuple[int, ...] = ()  # lanes opened this round: recurrent state zeroed
    # hybrids: (lane, rows) lanes that verified drafts last round (their state frozen) advance
    # over their accepted rows first (HybridDecoder.commit_states), before keeps and zeroes
    state_commits: tuple[tuple[int, int], ...] = ()
    # hybrids' prefix cache: (lane, slot) copies of a lane's state kept at a page boundary,
    # run first; (slot, lane): a resumed stream's lane starts from a kept state, run last
    states_to_keep: tuple[tuple[int, int], ...] = ()
    states_to_resume: tuple[tuple[int, int], ...] = ()
    # Decode steps (--decode-steps): every row is one decode row with a choice, and the round
    # runs `steps` forwards in a row, step k at start_pos + k on the token chosen at step
    # k - 1 (fed where it was chosen: on the device, no host round trip between steps).
    steps: int = 1
    # Prefix cache (dense): (source page, page, rows): rows [0, rows) of a cached page copied
    # into the same rows of a run's new page, after pages_to_zero and before the forward
    page_copies: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass(frozen=True, slots=True)
class RoundResult:
    # request id -> [num_logit_rows, V] float32 (host), for requests sampled on the host
    logits: dict[int, np.ndarray]
    # request id -> final-normed hidden [num_logit_rows, H] on the host, or of every row of
    # the request on the device when the drafter asks for all rows (MTP)
    hidden: dict[int, Any]
    failed: dict[int, str]  # request id -> error message
    # request id -> the token chosen on the device at each logit row (rows with `choices`,
    # when the ops can choose tokens); such requests have no entry in `logits`
    tokens: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Engine -> loop: new tokens of one request, and its end."""

    request_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
