"""`mtp`: the checkpoint's own MTP layer drafts (Qwen3.5 / Qwen3.6, MODELS.md 6.3-6.6).

MTP slot s pairs (token x_{s+1}, the target's final-normed hidden h_s); its K/V go to ring
row s % capacity of the context's area, and its output predicts x_{s+2}. The area (borrowed
from the lane's run) holds that ring (one attention layer) and the newest row's hidden:

    ring: slots [0, num_valid) of committed tokens     state: h_{num_valid} (has_state)
    pending slot num_valid = (the stream's last token, state): the first draft step

After every step of the target (prompt steps and verify rounds) `absorb` feeds the slots of
the committed rows from the target's hidden rows (the runner returns every row's hidden), so
the ring never holds a rejected draft's slot. `propose` runs the pending slot, then one slot a
draft (d_i, the previous step's normed output); drafts are chosen with the stream's own
sampling at their positions, so a draft is accepted when it is what the target emits.
A proposal's steps attend slots [0, num_valid + step]; they stay inside the ring (a smaller
`--draft-ring` than the stream: drafts end where the ring does, and the stream decodes on
without them), so no slot is read from a row that a later slot or a draft wrote.

Slots are written lazily: `absorb` keeps the newest slots' hidden rows in the area's
`pending` rows (a device copy) and writes them to the ring in one call only when the ring is
next read (`propose`), when the rows are full, or (with a prefix cache) when a page's last
slot is among them, so the page is kept complete as soon as before. While a stream's drafts
are paused (draft pacing) a round therefore costs no MTP launch; a slot's K/V depend on its
own row only, so the ring's bits are those of slot-by-slot writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...backend.base import Array
from ...errors import BadInputError
from ...models.batch_io import ForwardBatch
from ...models.mtp import MtpHead, make_mtp_head
from ...models.qwen35 import HybridWeights, MtpWeights
from ..area import KV_NP_DTYPE, AreaLayout
from ..calibrate import CALIBRATION_TEXT, E4M3_MAX, HEADROOM
from ..drafting import count_accepted
from .base import ContextDrafter, until_stop
from .contexts import (
    DraftContext,
    DraftContexts,
    make_contexts,
    room_in_ring,
    sync_or_stop_drafting,
)
from .page_slots import PageSlots, make_page_slots

if TYPE_CHECKING:
    from ...models.checkpoint import Checkpoint
    from ..drafting import DrafterSpec
    from ..options import EngineOptions
    from ..runner import Runner
    from ..sched import Scheduler
    from ..sequence import SeqRows, Sequence



class MtpDrafter(ContextDrafter):
    name = "mtp"

    def __init__(self, head: MtpHead, kv_scales: Array, contexts: DraftContexts,
                 draft_tokens: int):
        super().__init__(head.ops, kv_scales, contexts, draft_tokens)  # kv_scales: [1, 2]
        self.head = head
        self.page_slots: PageSlots | None = None  # with a prefix cache (make_mtp_drafter)

    def _ready(self, ctx: DraftContext, seq: Sequence) -> bool:
        return ready(ctx, seq) and room_in_ring(ctx, ctx.num_valid) > 0

    def _reset(self, ctx: DraftContext) -> None:
        ctx.num_valid = -1

    def _draft(self, ctx: DraftContext, seq: Sequence, limit: int) -> tuple[int, ...]:
        self._flush(ctx, seq)  # the ring is read from here on
        limit = min(limit, room_in_ring(ctx, ctx.num_valid))
        if self.choose.chooses_on_device(seq):
            return self._draft_on_device(ctx, seq, limit)
        assert ctx.views is not None
        num_tokens = seq.num_tokens
        token, hidden = seq.last_token(), ctx.views.state[None]
        outputs, drafts, slot = list(seq.output_ids), [], ctx.num_valid
        for step in range(limit):
            logits, hidden = self._step(ctx, np.asarray([token], np.int64), slot + step, hidden)
            if step == 0:  # the pending slot holds committed values: it stays in the ring
                ctx.num_valid, ctx.has_state = ctx.num_valid + 1, False
            token = self.choose(seq, logits, outputs, num_tokens + step)
            if token in seq.stop_ids:
                break  # the target emits stop tokens itself
            drafts.append(token)
            outputs.append(token)
        return tuple(drafts)

    def _draft_on_device(self, ctx: DraftContext, seq: Sequence, limit: int) -> tuple[int, ...]:
        """The same k steps with each draft chosen where the logits are and fed to the next
        step there: one copy of the k ids at the end instead of a host read a step (the steps
        after a stop token are wasted work, their ring slots rewritten before they are read)."""
        assert ctx.views is not None
        num_tokens, slot = seq.num_tokens, ctx.num_valid
        token: Array = np.asarray([seq.last_token()], np.int64)
        hidden, picks = ctx.views.state[None], []
        for step in range(limit):
            logits, hidden = self._step(ctx, token, slot + step, hidden)
            if step == 0:  # the pending slot holds committed values: it stays in the ring
                ctx.num_valid, ctx.has_state = ctx.num_valid + 1, False
            token = self.choose.on_device(seq, logits, num_tokens + step)
            picks.append(token)
        ids = self.ops.to_host(self.ops.xp.concatenate(picks))
        return until_stop(seq, [int(t) for t in ids])

    def _step(self, ctx: DraftContext, token: Array, pos: int, hidden: Array
              ) -> tuple[Array, Array]:
        """One MTP slot at `pos` (token: [1] int64, host or device); (logits [1, V] and normed
        output [1, H], on the device)."""
        assert ctx.views is not None
        logits, out = self.head.rows(token, np.asarray([pos], np.int64), hidden, ctx.views.ring,
                                     self.kv_scales)
        return logits, out

    def absorb(self, seq: Sequence, rows: SeqRows, num_new_tokens: int, hidden: Any) -> None:
        """Feed the slots of the rows this step committed (hidden: [rows, H], every row)."""
        count_accepted(self, rows, num_new_tokens)
        ctx = self.contexts.get(seq)
        if ctx is None or ctx.num_valid < 0 or hidden is None:
            return
        valid_end = rows.committed_end(num_new_tokens)
        sync_or_stop_drafting(ctx, seq, lambda: self._sync(ctx, seq, rows.start_pos, valid_end, hidden),
                              "MTP")

    def _sync(self, ctx: DraftContext, seq: Sequence, start_pos: int, valid_end: int,
              hidden: Array) -> None:
        """Slots [num_valid, valid_end - 1) into the ring; h_{valid_end - 1} becomes the state.
        hidden: the target's rows at positions start_pos.. (those < valid_end are committed)."""
        assert ctx.views is not None
        if (ctx.num_valid + 1 if ctx.has_state else ctx.num_valid) < start_pos:
            self._rebuild(ctx, seq, start_pos)  # the stream resumed from cached pages
        lo, hi = ctx.num_valid, valid_end - 1
        first = lo + 1 if ctx.has_state else lo  # first slot whose hidden is a row of this step
        if first < start_pos or hi < lo:
            ctx.num_valid = -1  # a gap (no slots kept for the prefix): no drafts for this stream
            return
        if hi > lo:
            rows_h = hidden[first - start_pos: hi - start_pos]
            if not self._defer(ctx, rows_h, hi - lo):
                self._flush(ctx, seq)
                if ctx.has_state:
                    rows_h = self.ops.xp.concatenate([ctx.views.state[None], rows_h])
                # only the newest `capacity` slots: older ones would share their ring rows
                # with newer ones in this one write (which lands first is not defined)
                skip = max(0, hi - lo - int(ctx.views.ring.shape[2]))
                self.head.write_slots(list(seq.token_slice(lo + 1 + skip, hi + 1)), lo + skip,
                                      rows_h[skip:], ctx.views.ring, self.kv_scales)
        ctx.views.state[...] = hidden[hi - start_pos]
        ctx.num_valid, ctx.has_state = hi, True
        if self._must_flush(ctx):
            self._flush(ctx, seq)
        self._keep(ctx, seq, hidden, start_pos, valid_end)
        if room_in_ring(ctx, ctx.num_valid) <= 0:  # past the ring, which is never read again;
            ctx.num_valid = -1  # complete pages have their slots (_must_flush): stop writing

    def _defer(self, ctx: DraftContext, rows_h: Array, count: int) -> bool:
        """Slots [num_valid, num_valid + count) into the pending rows (their hidden rows: the
        state, if any, then rows_h), if they fit; False (nothing done) if not."""
        assert ctx.views is not None
        pending = ctx.views.pending
        if pending is None or ctx.num_pending + count > pending.shape[0]:
            return False
        at = ctx.num_pending
        if ctx.has_state:
            pending[at] = ctx.views.state
            at += 1
        if at < ctx.num_pending + count:
            pending[at: ctx.num_pending + count] = rows_h
        ctx.num_pending += count
        return True

    def _must_flush(self, ctx: DraftContext) -> bool:
        """Pending rows full, or (with a prefix cache) a page's last slot among them: slot s
        is position s + 1's, the page complete once its last position's slot is kept."""
        if not ctx.num_pending:  # always so without pending rows
            return False
        assert ctx.views is not None and ctx.views.pending is not None
        if ctx.num_pending >= ctx.views.pending.shape[0]:
            return True
        if self.page_slots is None:
            return False
        size = self.page_slots.page_size
        first_pos, last_pos = ctx.num_valid - ctx.num_pending + 1, ctx.num_valid
        return (last_pos + 1) // size > first_pos // size  # a position size - 1 mod size

    def _flush(self, ctx: DraftContext, seq: Sequence) -> None:
        """The pending slots' K/V into the ring, in one call."""
        assert ctx.views is not None
        count = ctx.num_pending
        if not count:
            return
        first = ctx.num_valid - count
        ctx.num_pending = 0
        self.head.write_slots(list(seq.token_slice(first + 1, first + count + 1)), first,
                              ctx.views.pending[:count], ctx.views.ring, self.kv_scales)
        self._keep_slots(ctx, seq)  # before a proposal's draft steps reuse ring rows

    def _rebuild(self, ctx: DraftContext, seq: Sequence, start_pos: int) -> None:
        """The ring's slots of a reused prefix [0, start_pos), copied from its cached pages."""
        assert ctx.views is not None
        slots = self.page_slots
        if slots is None or not slots.can_rebuild(seq, start_pos):
            return  # _sync then finds the gap and this stream decodes without drafts
        slots.copy_to_ring(seq, ctx.views.ring, ctx.views.state, start_pos)
        ctx.num_valid, ctx.has_state, ctx.num_kept = start_pos - 1, True, start_pos
        ctx.num_pending = 0

    def _keep(self, ctx: DraftContext, seq: Sequence, hidden: Array, start_pos: int,
              valid_end: int) -> None:
        """With a prefix cache: the ring's new committed slots and last hiddens onto the pages."""
        if self.page_slots is None or ctx.views is None:
            return
        self._keep_slots(ctx, seq)
        self.page_slots.keep_hidden(seq, hidden, start_pos, valid_end)

    def _keep_slots(self, ctx: DraftContext, seq: Sequence) -> None:
        """With a prefix cache: the slots the ring got since the last keep, onto the pages
        (right after the ring got them, as page_slots.py requires)."""
        if self.page_slots is None or ctx.views is None:
            return
        capacity = int(ctx.views.ring.shape[2])  # slots older than that are gone from the ring
        written = ctx.num_valid - ctx.num_pending  # slots [0, written) are in the ring
        first = max(ctx.num_kept, written - capacity + 1, 1)
        self.page_slots.keep(seq, ctx.views.ring, first, written + 1)
        ctx.num_kept = max(ctx.num_kept, written + 1)


def ready(ctx: DraftContext, seq: Sequence) -> bool:
    """The ring holds every committed slot and the state the newest hidden (pending slot =
    (last token, state))."""
    return ctx.has_state and ctx.num_valid == seq.num_tokens - 2


# ---- construction -------------------------------------------------------------------------
def find_mtp_head(ckpt: Checkpoint) -> MtpWeights | None:
    """The checkpoint's MTP weights, detected by tensor presence (`mtp.fc.weight`) at load."""
    return ckpt.weights.mtp if isinstance(ckpt.weights, HybridWeights) else None


PENDING_ROWS = 32  # slots a context keeps unwritten at most (MtpDrafter._defer)


def mtp_layout(ckpt: Checkpoint, capacity: int, kv_dtype: str) -> AreaLayout:
    """One attention layer of the target's K/V shape, plus the target's hidden size and the
    pending slots' hidden rows (no more than the ring holds: a flush writes each row once)."""
    return AreaLayout.for_model(ckpt.config, capacity, kv_dtype, num_layers=1,
                                pending_rows=min(PENDING_ROWS, capacity))


def require_mtp_head(ckpt: Checkpoint) -> MtpWeights:
    """The MTP weights, or a BadInputError saying why there are none (not a hybrid; a config
    that declares MTP but files without mtp.* tensors; unsupported)."""
    head = find_mtp_head(ckpt)
    if head is None:
        why = ckpt.meta.get("mtp") or "no mtp.fc.weight tensor"
        raise BadInputError(
            f"--drafter mtp: model {ckpt.path} ({ckpt.config.arch}) has no MTP layer to draft "
            f"with ({why}); use --drafter ngram or --drafter draft:PATH", param="drafter")
    return head


def make_mtp_drafter(spec: DrafterSpec, options: EngineOptions, ckpt: Checkpoint,
                     runner: Runner, scheduler: Scheduler) -> MtpDrafter:
    """The MTP drafter on the runner's hybrid decoder; the runner then returns every row's
    hidden state (the ring is synced from them)."""
    capacity, num_areas = options.ring_capacity, options.num_draft_areas(scheduler.lanes.num_lanes)
    require_mtp_head(ckpt)
    head = make_mtp_head(runner.decoder)
    scales = ring_kv_scales(head, ckpt, options.kv_dtype)
    layout = mtp_layout(ckpt, capacity, options.kv_dtype)
    contexts = make_contexts(runner, layout, num_areas)
    runner.all_hidden = True
    drafter = MtpDrafter(head, runner.ops.asarray(scales), contexts, options.draft_tokens)
    if scheduler.runs.cache is not None:  # resumed streams rebuild their rings from the pages
        drafter.page_slots = make_page_slots(
            runner.ops, scheduler.runs, scheduler.prefix.page_key, num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim, hidden_size=layout.hidden_size,
            ring_dtype=KV_NP_DTYPE[options.kv_dtype])
        runner.arena.add_drafter_pages(drafter.page_slots.num_bytes)
    return drafter


def ring_kv_scales(head: MtpHead, ckpt: Checkpoint, kv_dtype: str) -> np.ndarray:
    """[1, 2] K/V scales of the MTP ring: ones, or for fp8 calibrated like the trunk's."""
    if kv_dtype != "fp8":
        return np.ones((1, 2), np.float32)
    ids = ckpt.tokenizer.encode(CALIBRATION_TEXT)
    ring = mtp_calibration_ring(head, ids)
    amax = np.abs(head.ops.to_host(ring)).reshape(2, -1).max(axis=-1)[None]
    return (np.maximum(amax, 1e-6) * HEADROOM / E4M3_MAX).astype(np.float32)


def mtp_calibration_ring(head: MtpHead, token_ids: list[int]) -> Array:
    """The MTP layer's f32 K/V over a calibration text (the target run on a fresh state)."""
    ops, cfg, decoder = head.ops, head.config, head.decoder
    rows = len(token_ids)
    pos = np.arange(rows, dtype=np.int64)
    put = ops.asarray
    batch = ForwardBatch(put(np.asarray(token_ids, np.int64)), put(pos), put(pos),
                         put(np.zeros(rows, np.int32)), put(np.zeros((1, 1), np.int32)),
                         put(np.asarray([rows - 1], np.int64)), rows, put(np.zeros(1, np.int32)))
    kv = ops.alloc_kv(cfg.num_layers, rows, cfg.num_kv_heads, cfg.head_dim, "f32")
    _, hidden = decoder.forward(batch, kv, put(np.ones((cfg.num_layers, 2), np.float32)),
                                states=decoder.new_states(1),
                                all_hidden=True)
    ring = ops.alloc_kv(1, rows, cfg.num_kv_heads, cfg.head_dim, "f32")
    head.write_slots(token_ids[1:], 0, hidden[:-1], ring, put(np.ones((1, 2), np.float32)))
    return ring
