"""`draft:PATH`: a smaller model with the target's tokenizer drafts k tokens autoregressively.

It runs its own Decoder on the target's Ops; its K/V rows live in the context's ring
(row of position p at p % capacity), read through the ordinary paged kernels with one page
of `capacity` rows. Drafts are chosen with the stream's own sampling (greedy, or the seeded
sample drawn from (seed, position)), so the target as its own drafter accepts every draft.
A proposal attends positions [0, num_tokens + k - 1), all inside the ring: with a smaller
`--draft-ring` than the stream, drafts end where the ring does (no position is read from a
row that a later position wrote).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BadInputError
from ...models.batch_io import ForwardBatch
from ...models.decoder import Decoder
from ...models.loader import load_checkpoint
from ...models.protocol import DecoderProtocol
from ...models.qwen35 import HybridWeights
from ...models.tp_decoder import TPDecoder
from ...models.tp_shard import shard_config
from ..area import AreaLayout
from ..calibrate import kv_scales_for
from ..drafting import count_accepted
from .base import ContextDrafter
from .contexts import DraftContext, DraftContexts, make_contexts, room_in_ring

if TYPE_CHECKING:
    from ...models.checkpoint import Checkpoint
    from ..drafting import DrafterSpec
    from ..options import EngineOptions
    from ..runner import Runner
    from ..sched import Scheduler
    from ..sequence import SeqRows, Sequence

log = logging.getLogger("tf_async.drafting")


class ModelDrafter(ContextDrafter):
    name = "draft"

    def __init__(self, decoder: DecoderProtocol, kv_scales: Any, contexts: DraftContexts,
                 draft_tokens: int):
        super().__init__(decoder.ops, kv_scales, contexts, draft_tokens)
        self.decoder = decoder

    def _reset(self, ctx: DraftContext) -> None:
        ctx.num_valid = ctx.num_fed = 0

    def _ready(self, ctx: DraftContext, seq: Sequence) -> bool:
        return room_in_ring(ctx, seq.num_tokens - 1) > 0

    def _draft(self, ctx: DraftContext, seq: Sequence, limit: int) -> tuple[int, ...]:
        num_tokens = seq.num_tokens
        limit = min(limit, room_in_ring(ctx, num_tokens - 1))  # last row: num_tokens + limit - 2
        start = min(ctx.num_valid, num_tokens - 1)
        logits = self._forward(ctx, seq.token_slice(start, num_tokens), start)
        ctx.num_valid = ctx.base_pos = num_tokens
        ctx.num_fed = 0
        drafts: list[int] = []
        outputs = list(seq.output_ids)
        while True:
            token = self.choose(seq, logits, outputs, num_tokens + len(drafts))
            if token in seq.stop_ids:
                break  # the target emits stop tokens itself
            drafts.append(token)
            outputs.append(token)
            if len(drafts) >= limit:
                break
            logits = self._forward(ctx, [token], num_tokens + len(drafts) - 1)
            ctx.num_fed += 1
        return tuple(drafts)

    def _forward(self, ctx: DraftContext, tokens: list[int], start_pos: int) -> Any:
        """Rows at positions start_pos.. into the ring; logits [1, V] of the last row (device)."""
        assert ctx.views is not None
        num_rows = len(tokens)
        capacity = ctx.views.ring.shape[2]
        pos = np.arange(start_pos, start_pos + num_rows, dtype=np.int64)
        num_pages = int(pos[-1]) // capacity + 1  # every page of the ring is page 0
        put = self.ops.asarray
        batch = ForwardBatch(put(np.asarray(tokens, np.int64)), put(pos), put(pos % capacity),
                             put(np.zeros(num_rows, np.int32)), put(np.zeros((1, num_pages), np.int32)),
                             put(np.asarray([num_rows - 1], np.int64)), capacity)
        logits, hidden = self.decoder.forward(batch, ctx.views.ring, self.kv_scales)
        ctx.views.state[...] = hidden[0]  # the newest row's hidden state
        return logits

    def absorb(self, seq: Sequence, rows: SeqRows, num_new_tokens: int, hidden: Any) -> None:
        """Accepted drafts whose ring rows were written stay valid; the rest is redone."""
        count_accepted(self, rows, num_new_tokens)
        ctx = self.contexts.get(seq)
        first_draft_pos = rows.start_pos + len(rows.token_ids) - len(rows.draft_ids)
        if ctx is not None and rows.draft_ids and ctx.base_pos == first_draft_pos:
            ctx.num_valid = ctx.base_pos + min(num_new_tokens - 1, ctx.num_fed)

# ---- construction -------------------------------------------------------------------------
def make_model_drafter(spec: DrafterSpec, options: EngineOptions, ckpt: Checkpoint,
                       runner: Runner, scheduler: Scheduler) -> ModelDrafter:
    """`draft:PATH`: the draft model's decoder on the target's Ops, its ring in the run."""
    capacity, num_areas = options.ring_capacity, options.num_draft_areas(scheduler.lanes.num_lanes)
    assert spec.path is not None
    draft, decoder, kv_scales = _load_draft(spec.path, ckpt, runner, options.kv_dtype)
    split = runner.arena.split  # tensor parallel: each rank's area holds its KV heads' ring
    ring_config = draft.config if split is None else shard_config(draft.config, split.size)
    layout = AreaLayout.for_model(ring_config, capacity, options.kv_dtype)
    return ModelDrafter(decoder, kv_scales, make_contexts(runner, layout, num_areas),
                        options.draft_tokens)


def _load_draft(path: str, ckpt: Checkpoint, runner: Runner, kv_dtype: str):
    """The draft checkpoint, its decoder and KV scales (the target's own when it drafts itself)."""
    if _same_file(path, str(ckpt.path)):
        refuse_recurrent_draft(ckpt)
        return ckpt, runner.decoder, runner.arena.kv_scales
    draft = load_checkpoint(path)
    refuse_recurrent_draft(draft)
    check_same_vocab(ckpt, draft)
    split = runner.arena.split
    decoder: DecoderProtocol = (Decoder(draft, runner.ops) if split is None
                                else TPDecoder(draft, split.rank_ops, split.comm))
    scales = kv_scales_for(decoder, draft, kv_dtype)
    if scales is None:
        scales = np.ones((draft.config.num_layers, 2), np.float32)
    return draft, decoder, runner.ops.asarray(scales)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_recurrent_draft(draft: Checkpoint) -> None:
    """A draft model's ring holds K/V rows only: a hybrid (recurrent state) cannot draft."""
    if isinstance(draft.weights, HybridWeights):
        raise BadInputError(f"draft model {draft.path}: {draft.config.arch} keeps recurrent "
                            f"state that a drafter ring cannot hold; use --drafter mtp "
                            f"(its own MTP layer) or ngram", param="drafter")


def check_same_vocab(target: Checkpoint, draft: Checkpoint) -> None:
    """A draft model must share the target's vocabulary: same size and the same token texts."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise BadInputError(f"draft model {draft.path}: vocab size {dv} differs from the target's "
                            f"{tv} ({target.path})", param="drafter")
    t_vocab = target.tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True)
    d_vocab = draft.tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True)
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:3]
        raise BadInputError(f"draft model {draft.path}: token texts differ from the target's "
                            f"({target.path}), e.g. {differ}", param="drafter")
