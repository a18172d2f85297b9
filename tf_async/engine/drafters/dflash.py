"""`dflash:PATH`: a DFlash / DFlash2 block-diffusion drafter (docs/DFLASH.md).

The target returns, for every row of its steps, the outputs of the drafter's
target_layer_ids side by side (Runner.capture_layers; no extra target pass). `absorb`
projects the committed rows into the context ring (K/V of every drafter layer at row
p % capacity) in the context's area, borrowed from the lane's run:

    ring: positions [0, num_valid) of committed tokens    pending: the last token (anchor)
    ready when num_valid == num_tokens - 1

`propose` runs one forward over the block [anchor, mask, ...] at position num_valid and
returns its drafts (DFlash2: through its candidate selector): greedy, or with temperature drawn
as the target draws each position (seed, position). Verification keeps a draft only when the
target emits it, so drafted == plain whatever the drafter proposes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...backend.base import Array
from ...models.dflash import DFlashCheckpoint, check_against_target, load_dflash
from ...models.dflash_model import DFlashModel
from ...models.graph_decoder import GraphDecoder
from ...models.qwen35 import HybridWeights
from ..area import AreaLayout
from ..drafting import count_accepted
from .base import ContextDrafter, until_stop
from .contexts import DraftContext, DraftContexts, make_contexts, sync_or_stop_drafting
from .dflash_pages import ContextPages, make_context_pages

if TYPE_CHECKING:
    from ...models.checkpoint import Checkpoint
    from ..drafting import DrafterSpec
    from ..options import EngineOptions
    from ..runner import Runner
    from ..sched import Scheduler
    from ..sequence import SeqRows, Sequence



class DFlashDrafter(ContextDrafter):
    name = "dflash"

    def __init__(self, model: DFlashModel, contexts: DraftContexts, draft_tokens: int):
        super().__init__(model.ops, None, contexts, draft_tokens)
        self.model = model
        self.pages: ContextPages | None = None  # with a prefix cache (make_dflash_drafter)

    def _ready(self, ctx: DraftContext, seq: Sequence) -> bool:
        """Every committed row is in the ring, and the ring holds all the block attends
        (a --draft-ring smaller than a full-attention drafter's context: no more drafts)."""
        assert ctx.views is not None
        capacity = int(ctx.views.ring.shape[2])
        return (ctx.num_valid == seq.num_tokens - 1
                and capacity >= self.model.context_rows_needed(ctx.num_valid))

    def _reset(self, ctx: DraftContext) -> None:
        ctx.num_valid = -1  # this stream decodes without drafts from now on

    def _draft(self, ctx: DraftContext, seq: Sequence, limit: int) -> tuple[int, ...]:
        assert ctx.views is not None
        if samples(seq):
            return self._sampled(ctx, seq, limit)
        proposed = self.model.propose(ctx.views.ring, ctx.num_valid, seq.last_token())
        return until_stop(seq, proposed[:limit].tolist())

    def _sampled(self, ctx: DraftContext, seq: Sequence, limit: int) -> tuple[int, ...]:
        """With temperature: draft t is drawn as the target draws position num_tokens + t
        (TargetChooser: the same sampler, seed and position), from the row's logits (DFlash)
        or from softmax(score / T) over the selector's candidates (DFlash2), so a draft that
        matches the target's distribution is the token the target samples."""
        assert ctx.views is not None
        ring, start, anchor = ctx.views.ring, ctx.num_valid, seq.last_token()
        vocab = int(self.model.lm_head.out_features)
        logits, top, host_projected = None, None, None
        if self.model.hidden_projection is None:  # DFlash: draw from each row's logits
            logits, _ = self.model.block_logits(ring, start, anchor)
        else:  # DFlash2: the selector's candidates (from the greedy block's graph on CUDA)
            ids, values, host_projected = self.model.block_candidates(ring, start, anchor)
            top = (ids, values)
        outputs, drafts, previous = list(seq.output_ids), [], seq.last_token()
        for t in range(limit):
            if top is None or host_projected is None:
                assert logits is not None
                row = logits[t:t + 1]
            else:
                scores = self.model.candidate_scores(top[0][t], top[1][t], host_projected[t], previous)
                row = self.ops.asarray(_score_row(vocab, top[0][t], scores))
            token = self.choose(seq, row, outputs, seq.num_tokens + t)
            if token in seq.stop_ids:
                break  # the target emits stop tokens itself
            drafts.append(token)
            outputs.append(token)
            previous = token
        return tuple(drafts)

    def absorb(self, seq: Sequence, rows: SeqRows, num_new_tokens: int, hidden: Any) -> None:
        """Project the rows this step committed (hidden: [rows, len(target_layer_ids) * H],
        every row of the step) into the ring."""
        count_accepted(self, rows, num_new_tokens)
        ctx = self.contexts.get(seq)
        valid_end = rows.committed_end(num_new_tokens)
        if ctx is not None and ctx.num_valid >= 0 and hidden is not None:
            sync_or_stop_drafting(
                ctx, seq, lambda: self._sync(ctx, seq, rows.start_pos, valid_end, hidden), "DFlash")
        if self.pages is not None and (ctx is None or ctx.num_valid < 0):
            self.pages.forget(seq, rows.start_pos, valid_end)  # its KV, without ctx rows

    def _sync(self, ctx: DraftContext, seq: Sequence, start_pos: int, valid_end: int,
              hidden: Array) -> None:
        """Positions [num_valid, valid_end) into the ring from the step's rows at start_pos.."""
        assert ctx.views is not None
        if 0 <= ctx.num_valid < start_pos:
            self._rebuild(ctx, seq, start_pos)  # the stream resumed from cached prefix pages
        lo = ctx.num_valid
        if lo < start_pos or valid_end < lo:
            ctx.num_valid = -1  # a gap no kept rows fill: this stream decodes without drafts
            return
        if valid_end > lo:
            positions = np.arange(lo, valid_end, dtype=np.int64)
            features = self.ops.xp.ascontiguousarray(hidden[lo - start_pos: valid_end - start_pos])
            rows = self.model.write_context(ctx.views.ring, features, positions)
            if self.pages is not None:
                self.pages.keep(seq, rows, lo, valid_end)
        ctx.num_valid = valid_end

    def _rebuild(self, ctx: DraftContext, seq: Sequence, start_pos: int) -> None:
        """The ring rows a block at start_pos attends, from the ctx rows kept on the pages."""
        assert ctx.views is not None
        first = max(0, start_pos - int(ctx.views.ring.shape[2]))
        if self.pages is None or not self.pages.can_rebuild(seq, first, start_pos):
            return  # _sync then finds the gap
        positions = self.ops.asarray(np.arange(first, start_pos, dtype=np.int64))
        self.model.write_kv(ctx.views.ring, self.pages.rows_of(seq, first, start_pos), positions)
        ctx.num_valid = start_pos


def _score_row(vocab: int, candidates: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """[1, V] f32: the selector's scores at its candidates, -inf elsewhere."""
    row = np.full((1, vocab), -np.inf, np.float32)
    row[0, candidates] = scores
    return row


def samples(seq: Sequence) -> bool:
    """Whether the target samples this stream's tokens (as sample_token's greedy test)."""
    return not (seq.params.temperature == 0.0 or seq.params.top_k == 1)


# ---- construction -------------------------------------------------------------------------
def ring_capacity(ckpt: DFlashCheckpoint, options: EngineOptions) -> int:
    """Rows the ring needs: the widest sliding window when every layer slides (DFlash2),
    else the context (--draft-ring, default ctx)."""
    windows = ckpt.config.layer_windows
    if all(w is not None for w in windows):
        return min(options.ring_capacity, max(w for w in windows if w is not None))
    return options.ring_capacity


def dflash_layout(ckpt: DFlashCheckpoint, capacity: int) -> AreaLayout:
    """Every drafter layer's K/V, float32 (the block attention reads them as they are)."""
    c = ckpt.config
    return AreaLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, capacity, "f32")


def make_dflash_drafter(spec: DrafterSpec, options: EngineOptions, ckpt: Checkpoint,
                        runner: Runner, scheduler: Scheduler) -> DFlashDrafter:
    """Load and check the drafter against the target; the runner then returns every row's
    target_layer_ids outputs."""
    assert spec.path is not None
    drafter_ckpt = load_dflash(spec.path)
    trunk = ckpt.weights.hybrid.num_trunk_layers if isinstance(ckpt.weights, HybridWeights) else None
    check_against_target(drafter_ckpt.config, ckpt.config, trunk, where=f"drafter {spec.path}")
    weights = runner.decoder.weights
    # The target's rounds replay graphs: so do the drafter's greedy blocks and context writes
    # (a few shapes a lane: keys padded to powers of two, 1..block_size context rows).
    graphs = isinstance(runner.decoder, GraphDecoder)
    model = DFlashModel(drafter_ckpt, runner.ops, weights.embed, weights.lm_head, graphs=graphs,
                        max_graphs=32 * max(1, scheduler.lanes.num_lanes))
    layout = dflash_layout(drafter_ckpt, ring_capacity(drafter_ckpt, options))
    contexts = make_contexts(runner, layout, options.num_draft_areas(scheduler.lanes.num_lanes))
    runner.all_hidden = True
    runner.capture_layers = drafter_ckpt.config.target_layer_ids
    draft_tokens = min(options.draft_tokens, drafter_ckpt.config.block_size - 1)
    drafter = DFlashDrafter(model, contexts, draft_tokens)
    if scheduler.runs.cache is not None:  # resumed streams rebuild their rings from the pages
        drafter.pages = make_context_pages(runner.ops, scheduler.runs, scheduler.prefix.page_key,
                                           drafter_ckpt.config.hidden_size)
        runner.arena.add_drafter_pages(drafter.pages.num_bytes)
        runner.on_page_copies = drafter.pages.copy
    return drafter
