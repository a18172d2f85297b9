"""Scheduler: admission, prompt cuts, decode rounds, preemption, and the update after a round.

It holds integers and lists only; arrays live in the runner. Out of pages mid-stream, the
most recently admitted other stream is preempted (lane released, KV recomputed later from
its prompt + output so far), so the engine never deadlocks and never corrupts a run.

Recurrent models (hybrids): a lane's state is zeroed when it opens (plan.lanes_to_zero); a
verify round leaves the verifying lanes' state as it was (frozen), and the next plan commits
each of them over its accepted rows (plan.state_commits): no copy of a state, no rows fed
twice.
"""

from __future__ import annotations

from collections import deque

from ..api_types import SamplingParams
from .choice import token_choices
from .drafting import Drafter, zero_stats
from .grammar import TokenMask
from .lanes import Lanes
from .prefix_plan import PrefixPlanner
from .sampling import adjust_logits, sample_token, top_logprobs
from .sequence import RoundPlan, RoundResult, SeqRows, Sequence, TokenEvent


class Scheduler:
    def __init__(self, lanes: Lanes, *, step_tokens: int, ctx: int, recurrent: bool = False,
                 decode_steps: int = 1, draft_backoff: int = 0, cache_identity: bytes = b""):
        self.lanes = lanes
        self.decode_steps = decode_steps  # forwards a pure decode round may run in a row
        # most rounds a stream skips drafting after rounds of rejected drafts (0: never skips)
        self.draft_backoff = draft_backoff
        self.recurrent = recurrent  # the model keeps per-lane recurrent state (hybrids)
        self.runs = lanes.runs
        self.step_tokens = step_tokens
        self.ctx = ctx
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.round_index = 0
        self._num_admissions = 0
        self.num_preemptions = 0
        self.num_draft_pauses = 0  # decode rows that skipped drafting (draft pacing)
        self.drafter: Drafter | None = None  # set by attach_drafter (engine/drafters/registry.py)
        self._lanes_to_zero: list[int] = []  # opened since the last plan
        self._state_commits: list[tuple[int, int]] = []  # (lane, accepted rows) since the last plan
        self.prefix = PrefixPlanner(lanes.runs, cache_identity=cache_identity, recurrent=recurrent)

    # ---- inbox --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def cancel(self, request_id: int) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.request_id == request_id and not seq.finished:
                seq.cancelled = True
                return seq
        return None

    def sweep_cancelled(self) -> list[TokenEvent]:
        """Between rounds: release every cancelled stream's lane."""
        events = []
        for seq in [s for s in [*self.running, *self.waiting] if s.cancelled and not s.finished]:
            events.append(self.finish(seq, "cancelled"))
        return events

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> RoundPlan:
        self.round_index += 1
        self.prefix.drop_copy_sources()  # the last plan's copies have run (or it failed)
        pages_to_zero: list[int] = []
        while True:
            self._admit(pages_to_zero)
            rows = self._round_rows(pages_to_zero)
            if rows or not self.running:
                break
            self._preempt(self.running[-1])  # pages exhausted by partial prompts: make room
        steps = self._steps_for(rows, pages_to_zero)
        tables = {r.lane: tuple(self.runs.pages(r.lane)) for r in rows}
        keep, resume, copies = self.prefix.take_plan_parts()
        plan = RoundPlan(tuple(rows), tables, tuple(pages_to_zero), tuple(self._lanes_to_zero),
                         tuple(self._state_commits), keep, resume, steps, copies)
        self._lanes_to_zero.clear()
        self._state_commits.clear()
        return plan

    def _round_rows(self, pages_to_zero: list[int]) -> list[SeqRows]:
        """Decode rows of running streams first, then prompt cuts up to the token budget."""
        rows: list[SeqRows] = []
        budget = self.step_tokens
        for seq in [s for s in self.running if not s.is_prefilling]:
            decode = self._decode_rows(seq, pages_to_zero) if seq.lane is not None else None
            if decode is not None:
                rows.append(decode)
                budget -= len(decode.token_ids)
        for seq in [s for s in self.running if s.is_prefilling]:
            if budget <= 0:
                break
            if seq.lane is None:
                continue
            cut = self._prompt_cut(seq, budget, pages_to_zero)
            if cut is not None:
                rows.append(cut)
                budget -= len(cut.token_ids)
        return rows

    def _admit(self, pages_to_zero: list[int]) -> None:
        while self.waiting:
            seq = self.waiting[0]
            first_rows = min(seq.num_pending, self.step_tokens)
            if self.runs.paging and not self.runs.can_take(-(-first_rows // self.runs.page_size)):
                return  # first come, first served: later requests wait behind the head
            opened = self.lanes.try_open(seq.request_id)
            if opened is None:
                return
            seq.lane, new_pages = opened
            pages_to_zero.extend(new_pages)
            self._lanes_to_zero.append(seq.lane)  # a stream starts from zero recurrent state
            self._num_admissions += 1
            seq.admitted_round = self._num_admissions
            self.waiting.popleft()
            self.running.append(seq)

    def _decode_rows(self, seq: Sequence, pages_to_zero: list[int]) -> SeqRows | None:
        lane = seq.lane
        assert lane is not None
        room = max(0, self._room_for_drafts(seq))
        drafts = tuple(self._propose(seq, room)[:room])
        new_pages = self.runs.reserve(lane, seq.num_tokens + len(drafts))
        if new_pages is None and drafts:  # out of pages: drop the drafts first
            drafts = ()
            new_pages = self.runs.reserve(lane, seq.num_tokens)
        while new_pages is None:
            victim = max(self.running, key=lambda s: s.admitted_round)  # latest admitted
            self._preempt(victim)
            if victim is seq:
                return None
            new_pages = self.runs.reserve(lane, seq.num_tokens)
        pages_to_zero.extend(new_pages)
        # the last token, then the drafts
        tokens = (*seq.token_slice(seq.num_computed, seq.num_tokens), *drafts)
        return SeqRows(seq.request_id, lane, seq.num_computed, tokens, 1 + len(drafts),
                       tuple(drafts), token_choices(seq, 1 + len(drafts)))

    def _propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """The drafter's proposal, or none while the stream's draft pause lasts; after two
        or more rejected rounds in a row a probe of one draft (a cheaper verify round)."""
        if self.drafter is None:
            return ()
        if seq.draft_pause > 0:
            seq.draft_pause -= 1
            self.num_draft_pauses += 1
            return ()
        if self.draft_backoff and seq.draft_misses >= 2:
            room = min(room, 1)
        return self.drafter.propose(seq, room)

    def _pace_drafts(self, seq: Sequence, drafts: tuple[int, ...], num_new_tokens: int) -> None:
        """After a drafted round: every draft rejected -> draft_misses += 1 and a pause of
        2**(misses - 1) - 1 rounds (none after one miss, at most draft_backoff); one accepted
        -> misses back to 0. Drafts only change speed, so this changes no output: a drafter
        that keeps failing costs little more than plain decode, one that comes right again
        is probed soon."""
        if not drafts or not self.draft_backoff:
            return
        if num_new_tokens > 1:
            seq.draft_misses = 0
            return
        seq.draft_misses += 1
        seq.draft_pause = min(self.draft_backoff, (1 << min(seq.draft_misses - 1, 30)) - 1)

    def _steps_for(self, rows: list[SeqRows], pages_to_zero: list[int]) -> int:
        """Decode steps of this round (RoundPlan.steps): up to `decode_steps` when every row is
        one plain decode row whose token may be chosen where the logits are (no drafter, no
        prompt rows; a hybrid's recurrent state advances one token a step, as in plain rounds);
        no more than any stream may still take (max_tokens, ctx), and each stream's run holds
        every step's position (else one step)."""
        if (self.decode_steps < 2 or not rows or self.drafter is not None
                or any(len(r.token_ids) != 1 or r.num_logit_rows != 1 or not r.choices for r in rows)):
            return 1
        by_id = {s.request_id: s for s in self.running}
        seqs = [by_id[r.request_id] for r in rows]
        steps = min(self.decode_steps, *(1 + self._room_for_drafts(s) for s in seqs))
        if steps < 2:
            return 1
        for seq in seqs:  # positions num_tokens - 1 .. num_tokens + steps - 2
            assert seq.lane is not None
            new_pages = self.runs.reserve(seq.lane, seq.num_tokens + steps - 1)
            if new_pages is None:
                return 1  # pages already taken stay with their run (its next rounds use them)
            pages_to_zero.extend(new_pages)
        return steps

    def _room_for_drafts(self, seq: Sequence) -> int:
        left = seq.params.max_tokens - len(seq.output_ids) - 1
        return min(left, self.ctx - seq.num_tokens - 1)

    def _prompt_cut(self, seq: Sequence, budget: int, pages_to_zero: list[int]) -> SeqRows | None:
        lane = seq.lane
        assert lane is not None
        self.prefix.reuse(seq, pages_to_zero)
        num_rows = min(seq.num_pending, budget, self.prefix.rows_to_next_state(seq))
        if self.runs.paging:
            room = (len(self.runs.pages(lane)) + self.runs.num_available) * self.runs.page_size
            num_rows = min(num_rows, room - seq.num_computed)
        if num_rows <= 0:
            return None
        new_pages = self.runs.reserve(lane, seq.num_computed + num_rows)
        assert new_pages is not None
        pages_to_zero.extend(new_pages)
        stop = seq.num_computed + num_rows
        tokens = tuple(seq.token_slice(seq.num_computed, stop))
        samples = 1 if stop == seq.num_tokens else 0
        return SeqRows(seq.request_id, lane, seq.num_computed, tokens, samples, (),
                       token_choices(seq, samples))

    def _keep_state(self, seq: Sequence) -> None:
        self.prefix.keep_state(seq)

    def prefix_cache_stats(self) -> dict[str, int]:
        return {**self.prefix.cache_stats(), **self.prefix.state_stats()}

    def _preempt(self, seq: Sequence) -> None:
        """Release the lane; the stream recomputes its KV when admitted again (front of queue)."""
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence, *, failed: bool = False, state_past_end: bool = False
                 ) -> None:
        if seq.lane is not None:
            if not failed:  # its committed rows stay useful to later streams
                self.prefix.publish_pages(seq)
                self.prefix.publish_partial(seq)
                if not state_past_end:
                    self._keep_state(seq)
            released = self.runs.pages(seq.lane)
            self.lanes.release(seq.lane)
            self.prefix.drop_copies_into(released)
            seq.lane = None
            seq.num_published = 0

    # ---- update -------------------------------------------------------------------------
    def update(self, plan: RoundPlan, result: RoundResult) -> list[TokenEvent]:
        self.prefix.drop_copy_sources()
        events: list[TokenEvent] = []
        by_id = {s.request_id: s for s in self.running}
        for rows in plan.rows:
            seq = by_id.get(rows.request_id)
            if seq is None or seq.finished:
                continue
            if rows.request_id in result.failed:
                events.append(self.finish(seq, None, error=result.failed[rows.request_id]))
                continue  # the drafter is not open yet after a failed first step
            if self.drafter is not None and not self.drafter.is_open(seq):  # first step
                error = self._open_drafter(seq)
                if error is not None:  # releases the lane, and with it the drafter
                    events.append(self.finish(seq, None, error=error))
                    continue
            seq.num_computed += len(rows.token_ids)
            if rows.num_logit_rows:
                events.append(self._accept(seq, rows, result))
            elif self.drafter is not None:  # a mid-prompt step: ring drafters sync its rows
                self.drafter.absorb(seq, rows, 0, result.hidden.get(seq.request_id))
            self.prefix.publish_pages(seq)
            self._keep_state(seq)
        return events

    def _open_drafter(self, seq: Sequence) -> str | None:
        """After the target's first step (its lane's run exists), before its rows are taken."""
        assert self.drafter is not None
        try:
            self.drafter.open(seq)
        except Exception as exc:  # noqa: BLE001 - a failed open fails this request only
            return f"drafter open failed: {type(exc).__name__}: {exc}"
        return None

    def drafter_stats(self) -> dict[str, int]:
        return self.drafter.stats() if self.drafter is not None else zero_stats()

    def _accept(self, seq: Sequence, rows: SeqRows, result: RoundResult) -> TokenEvent:
        """Sample at each logit row (or take the token the runner chose on the device); keep
        drafts while they equal the target's own choice. A round of decode steps chose one
        token a step: they are kept up to the first that finishes the stream."""
        chosen = result.tokens.get(seq.request_id)
        logits = result.logits[seq.request_id] if chosen is None else None
        new_ids: list[int] = []
        logprobs: list[dict[int, float]] = []
        finish = None
        # decode steps: one chosen token a step, more than the row's logit rows (a failed
        # round's isolated retry ran one step and chose one)
        stepped = chosen is not None and len(chosen) > rows.num_logit_rows
        for i in range(len(chosen) if chosen is not None and stepped else rows.num_logit_rows):
            if chosen is not None:
                token = chosen[i]
            else:
                assert logits is not None
                token = self._sample(seq, logits[i])
            if seq.params.logprobs is not None:  # never chosen on the device (token_choices)
                assert logits is not None
                logprobs.append(top_logprobs(logits[i], token, seq.params.logprobs))
            seq.output_ids.append(token)
            new_ids.append(token)
            if seq.mask is not None:  # the next row's mask follows this token
                seq.mask.consume(token)
            finish = self._finish_reason(seq, token)
            if finish or (not stepped and (i >= len(rows.draft_ids) or rows.draft_ids[i] != token)):
                break
        seq.num_drafted += len(rows.draft_ids)
        seq.num_accepted += len(new_ids) - 1 if rows.draft_ids else 0
        self._pace_drafts(seq, rows.draft_ids, len(new_ids))
        # KV rows of rejected drafts stay in the run but beyond num_computed: overwritten later.
        # Rows before the first logit row are all kept; of the logit rows, those of accepted tokens.
        seq.num_computed = rows.committed_end(len(new_ids))
        if self.recurrent and rows.draft_ids:  # the lane's state was frozen for the round
            self._state_commits.append((rows.lane, seq.num_computed - rows.start_pos))
        if self.drafter is not None:
            self.drafter.absorb(seq, rows, len(new_ids), result.hidden.get(seq.request_id))
        lp = tuple(logprobs) if seq.params.logprobs is not None else None
        if finish:
            # a stop inside the round's drafts or decode steps: the lane's recurrent state has
            # taken the rows after it too, so it is no state of num_computed to keep
            return self.finish(seq, finish, new_ids=new_ids, logprobs=lp, state_past_end=True)
        return TokenEvent(seq.request_id, tuple(new_ids), lp)

    def _sample(self, seq: Sequence, row_logits) -> int:
        x = adjust_logits(row_logits, seq.params, seq.prompt_ids, seq.output_ids, seq.stop_ids)
        if seq.mask is not None:
            x = seq.mask.apply(x)
        return sample_token(x, seq.params, seq.seed, seq.num_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.ctx:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str | None, *, error: str | None = None,
               new_ids: list[int] | None = None, logprobs=None,
               state_past_end: bool = False) -> TokenEvent:
        """End a stream: release its lane (the one release path) and drop it."""
        seq.finished = True
        self._release(seq, failed=error is not None, state_past_end=state_past_end)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        return TokenEvent(seq.request_id, tuple(new_ids or ()), logprobs, reason, error,
                          len(seq.prompt_ids), seq.num_drafted, seq.num_accepted,
                          seq.num_cached_tokens)


def make_sequence(request_id: int, prompt_ids: list[int], params: SamplingParams, seed: int,
                  eos_ids: tuple[int, ...], cache_salt: str | None = None,
                  mask: TokenMask | None = None) -> Sequence:
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop |= set(eos_ids)
    return Sequence(request_id, list(prompt_ids), params, seed, frozenset(stop),
                    cache_salt=cache_salt, mask=mask)
