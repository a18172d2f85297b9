"""Scheduler: admission, prompt cuts, decode rounds, preemption, and the update after a round.

It holds integers and lists only; arrays live in the runner. Out of pages mid-stream, the
most recently admitted other stream is preempted (lane released, KV recomputed later from
its prompt + output so far), so the engine never deadlocks and never corrupts a run.

Recurrent models (hybrids): a lane's state is zeroed when it opens (plan.lanes_to_zero);
a verify round that rejects a draft rolls the lane back (plan.lanes_to_restore, the state
saved before the round) and the accepted rows are fed again with the next decode rows.
"""

from __future__ import annotations

from collections import deque

from ..api_types import SamplingParams
from .choice import token_choices
from .drafting import Drafter, zero_stats
from .grammar import TokenMask
from .lanes import Lanes
from .prefix import StateSlots, next_key, root_key
from .sampling import adjust_logits, sample_token, top_logprobs
from .sequence import RoundPlan, RoundResult, SeqRows, Sequence, TokenEvent


class Scheduler:
    def __init__(self, lanes: Lanes, *, step_tokens: int, ctx: int, recurrent: bool = False,
                 decode_steps: int = 1, cache_identity: bytes = b""):
        self.lanes = lanes
        self.decode_steps = decode_steps  # forwards a pure decode round may run in a row
        self.recurrent = recurrent  # the model keeps per-lane recurrent state (hybrids)
        self.runs = lanes.runs
        self.step_tokens = step_tokens
        self.ctx = ctx
        self.cache_identity = cache_identity  # what else makes a page's KV (prefix.root_key)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.round_index = 0
        self._num_admissions = 0
        self.num_preemptions = 0
        self.drafter: Drafter | None = None  # set by attach_drafter (engine/drafters/registry.py)
        self._lanes_to_zero: list[int] = []  # opened since the last plan
        self._lanes_to_restore: set[int] = set()  # rolled back since the last plan
        self.state_slots: StateSlots | None = None  # hybrids with a prefix cache (build)
        self._states_to_keep: list[tuple[int, int]] = []  # (lane, slot) since the last plan
        self._states_to_resume: list[tuple[int, int]] = []  # (slot, lane)
        self._page_copies: list[tuple[int, int, int]] = []  # (source, page, rows) this plan
        self._copy_sources: list[int] = []  # cached pages held until the copies have run

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
        self._drop_copy_sources()  # the last plan's copies have run (or it failed)
        pages_to_zero: list[int] = []
        while True:
            self._admit(pages_to_zero)
            rows = self._round_rows(pages_to_zero)
            if rows or not self.running:
                break
            self._preempt(self.running[-1])  # pages exhausted by partial prompts: make room
        steps = self._steps_for(rows, pages_to_zero)
        tables = {r.lane: tuple(self.runs.pages(r.lane)) for r in rows}
        plan = RoundPlan(tuple(rows), tables, tuple(pages_to_zero), tuple(self._lanes_to_zero),
                         tuple(sorted(self._lanes_to_restore)), tuple(self._states_to_keep),
                         tuple(self._states_to_resume), steps, tuple(self._page_copies))
        self._page_copies.clear()
        self._lanes_to_zero.clear()
        self._lanes_to_restore.clear()
        self._states_to_keep.clear()
        self._states_to_resume.clear()
        if self.state_slots is not None:
            self.state_slots.unpin_all()
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
        drafts = self.drafter.propose(seq, room) if self.drafter is not None else ()
        drafts = tuple(drafts[:room])
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
        # the last token, after any rows to redo (rollback), then the drafts
        tokens = (*seq.token_slice(seq.num_computed, seq.num_tokens), *drafts)
        return SeqRows(seq.request_id, lane, seq.num_computed, tokens, 1 + len(drafts),
                       tuple(drafts), token_choices(seq, 1 + len(drafts)))

    def _steps_for(self, rows: list[SeqRows], pages_to_zero: list[int]) -> int:
        """Decode steps of this round (RoundPlan.steps): up to `decode_steps` when every row is
        one plain decode row whose token may be chosen where the logits are (no drafter, no
        recurrent state, no prompt rows); no more than any stream may still take (max_tokens,
        ctx), and each stream's run holds every step's position (else one step)."""
        if (self.decode_steps < 2 or not rows or self.drafter is not None or self.recurrent
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
        self._reuse_prefix(seq, pages_to_zero)
        num_rows = min(seq.num_pending, budget, self._rows_to_next_state(seq))
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

    # ---- prefix cache -----------------------------------------------------------------
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

    def _reuse_prefix(self, seq: Sequence, pages_to_zero: list[int]) -> None:
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
        self._page_copies.append((source, new_pages[0], num_rows))
        cache.num_copied_rows += num_rows
        seq.num_cached_tokens += min(num_rows, max(0, len(seq.prompt_ids) - start))
        seq.num_computed += num_rows

    def _drop_copy_sources(self) -> None:
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
                self._states_to_resume.append((slot, seq.lane))
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

    def _rows_to_next_state(self, seq: Sequence) -> int:
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

    def _keep_state(self, seq: Sequence) -> None:
        """Hybrids: after a round that left the stream's state exactly at a page boundary
        (no rollback pending), keep a copy of it for streams that resume from there: for good
        at a state point, else as the stream's one moving state."""
        lane, size, slots = seq.lane, self.runs.page_size, self.state_slots
        if (slots is None or lane is None or seq.num_computed == 0
                or seq.num_computed % size or seq.num_redo or lane in self._lanes_to_restore):
            return
        key = self.page_key(seq, seq.num_computed // size - 1)
        if self._is_state_point(seq, seq.num_computed):
            slot = slots.take(key)
        else:
            slot = slots.take(key, replacing=seq.moving_state_key)
            if slot is not None:
                seq.moving_state_key = key
        if slot is not None:
            self._states_to_keep.append((lane, slot))

    def prefix_state_stats(self) -> dict[str, int]:
        return self.state_slots.stats() if self.state_slots is not None else {}

    def _publish_pages(self, seq: Sequence) -> None:
        """Offer the run's newly full pages (every row committed) to the prefix cache."""
        if self.runs.cache is None or seq.lane is None:
            return
        full = seq.num_computed // self.runs.page_size
        for i in range(seq.num_published, full):
            self.runs.publish(seq.lane, i, self.page_key(seq, i), self._page_tokens(seq, i),
                              self._prev_key(seq, i))
        seq.num_published = max(seq.num_published, full)

    def _publish_partial(self, seq: Sequence) -> None:
        """Dense models, as the run closes: the committed rows of its partial last page."""
        size = self.runs.page_size
        if self.runs.cache is None or seq.lane is None or self.recurrent or not seq.num_computed % size:
            return
        page_index = seq.num_computed // size
        tokens = tuple(seq.token_slice(page_index * size, seq.num_computed))
        self.runs.publish_partial(seq.lane, page_index, tokens, self._prev_key(seq, page_index))

    def prefix_cache_stats(self) -> dict[str, int]:
        return self.runs.cache.stats() if self.runs.cache is not None else {}

    def _preempt(self, seq: Sequence) -> None:
        """Release the lane; the stream recomputes its KV when admitted again (front of queue)."""
        self._release(seq)
        seq.num_computed = seq.num_redo = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence, *, failed: bool = False) -> None:
        if seq.lane is not None:
            if not failed:  # its committed rows stay useful to later streams
                self._publish_pages(seq)
                self._publish_partial(seq)
                self._keep_state(seq)
            self._lanes_to_restore.discard(seq.lane)  # the next open zeroes it instead
            released = self.runs.pages(seq.lane)
            self.lanes.release(seq.lane)
            self._drop_copies_into(released)
            seq.lane = None
            seq.num_published = 0

    def _drop_copies_into(self, released: list[int]) -> None:
        """A planned copy into a page of a released run runs only if the page stayed cached
        (it is then that page's content: held, like a source, until the copy has run); a page
        back in the pool may be anyone's next."""
        cache = self.runs.cache
        if cache is None or not self._page_copies:
            return
        kept = []
        for copy in self._page_copies:
            if copy[1] not in released:
                kept.append(copy)
            elif cache.is_cached(copy[1]):
                cache.hold(copy[1])
                self._copy_sources.append(copy[1])
                kept.append(copy)
        self._page_copies[:] = kept

    # ---- update -------------------------------------------------------------------------
    def update(self, plan: RoundPlan, result: RoundResult) -> list[TokenEvent]:
        self._drop_copy_sources()
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
            self._publish_pages(seq)
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
        # KV rows of rejected drafts stay in the run but beyond num_computed: overwritten later.
        # Rows before the first logit row are all kept; of the logit rows, those of accepted tokens.
        seq.num_computed = rows.start_pos + len(rows.token_ids) - rows.num_logit_rows + len(new_ids)
        seq.num_redo = 0
        if self.recurrent and len(new_ids) - 1 < len(rows.draft_ids) and not finish:
            self._roll_back(seq, rows)
        if self.drafter is not None:
            self.drafter.absorb(seq, rows, len(new_ids), result.hidden.get(seq.request_id))
        lp = tuple(logprobs) if seq.params.logprobs is not None else None
        if finish:
            return self.finish(seq, finish, new_ids=new_ids, logprobs=lp)
        return TokenEvent(seq.request_id, tuple(new_ids), lp)

    def _roll_back(self, seq: Sequence, rows: SeqRows) -> None:
        """A draft was rejected: the lane's state goes back to before the round (the runner
        saved it) and the accepted rows are fed again next round; the KV rows stay."""
        assert seq.lane is not None
        seq.num_redo = seq.num_computed - rows.start_pos
        seq.num_computed = rows.start_pos
        self._lanes_to_restore.add(seq.lane)

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
               new_ids: list[int] | None = None, logprobs=None) -> TokenEvent:
        """End a stream: release its lane (the one release path) and drop it."""
        seq.finished = True
        self._release(seq, failed=error is not None)
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
