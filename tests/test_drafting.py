"""Drafter memory and lifecycle: area layout in the run, borrowed vs owned contexts, the
order of events, refusals. Drives the real drafters through their interface (no GPU)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tests.engine_helpers import idle_stats
from tests.tiny import random_hf_weights, tiny_config
from tf_async import BadInputError, Engine, RequestFailedError
from tf_async.api_types import SamplingParams
from tf_async.engine.area import ALIGN_BYTES, AreaLayout, AreaPool, address, align_up
from tf_async.engine.build import build_engine
from tf_async.engine.drafters import contexts as drafter_contexts
from tf_async.engine.drafters.contexts import DraftContexts
from tf_async.engine.drafters.ngram import NgramDrafter, ngram_lookup
from tf_async.engine.sched import make_sequence
from tf_async.gate import PROMPTS


def build(ckpt, drafter: str, **kw):
    """Engine parts (no engine thread) with a drafter attached."""
    base = dict(device="cpu", parallel=2, ctx=64, page_size=4, drafter=drafter)
    return build_engine(Engine(ckpt, **{**base, **kw}).options, lambda events: None)


def open_stream(parts, request_id: int):
    """Admit a stream the way the scheduler does: a lane (its run), then the drafter."""
    seq = make_sequence(request_id, [5, 6, 7], SamplingParams(max_tokens=8), 0, ())
    seq.lane, _ = parts.lanes.try_open(request_id)
    parts.scheduler.drafter.open(seq)
    return seq


def contexts(parts) -> DraftContexts:
    return parts.scheduler.drafter.contexts


def check_contexts(ctxs: DraftContexts) -> None:
    """Invariant 4: only owned contexts in the pool; areas in use == open borrowed contexts;
    no two open contexts share memory."""
    assert all(not c.borrowed and c.area_offset is None for c in ctxs.pool)
    open_ctxs = list(ctxs.open_by_lane.values())
    assert ctxs.areas.num_in_use == sum(c.borrowed for c in open_ctxs)
    for i, a in enumerate(open_ctxs):
        for b in open_ctxs[i + 1:]:
            assert not np.shares_memory(a.views.ring, b.views.ring)
            assert not np.shares_memory(a.views.state, b.views.state)


# ---- layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [1, 3, 4096, 32768])
def test_ring_and_state_layout_in_the_runs_area(tiny_llama, tiny_llama_dir, capacity):
    parts = build(tiny_llama, f"draft:{tiny_llama_dir}", draft_ring=capacity, parallel=1)
    cfg = tiny_llama.config
    seq = open_stream(parts, 1)
    ctx = contexts(parts).open_by_lane[seq.lane]
    region = parts.arena.drafter_region
    ring_bytes = cfg.num_layers * 2 * capacity * cfg.num_kv_heads * cfg.head_dim * 4
    area_start = address(region) + ctx.area_offset
    assert ctx.borrowed and ctx.views.borrowed
    assert address(ctx.views.ring) == area_start and ctx.views.ring.nbytes == ring_bytes
    assert ctx.views.ring.shape == (cfg.num_layers, 2, capacity, cfg.num_kv_heads, cfg.head_dim)
    state_start = address(ctx.views.state)
    assert state_start == area_start + align_up(ring_bytes) and state_start % ALIGN_BYTES == 0
    assert state_start - (area_start + ring_bytes) < ALIGN_BYTES
    assert state_start + ctx.views.state.nbytes == area_start + contexts(parts).layout.num_bytes
    assert ctx.views.state.shape == (cfg.hidden_size,) and ctx.views.state.dtype == np.float32
    assert np.shares_memory(ctx.views.ring, region) and np.shares_memory(ctx.views.state, region)
    # the MTP layout: one attention layer of the target's K/V shape + the target's hidden
    mtp = AreaLayout.for_model(cfg, capacity, "bf16", num_layers=1)
    assert mtp.ring_bytes == 2 * capacity * cfg.num_kv_heads * cfg.head_dim * 2
    assert mtp.num_bytes == align_up(mtp.ring_bytes) + 4 * cfg.hidden_size


def test_area_pool_first_fit_and_merge():
    pool = AreaPool(4 * 256)
    assert [pool.allocate(200), pool.allocate(256), pool.allocate(300)] == [0, 256, 512]
    assert pool.allocate(256) is None  # 300 B took two 256-byte units
    pool.free(256)
    pool.free(0)
    assert pool.allocate(512) == 0 and pool.num_in_use == 2 and pool.bytes_in_use == 1024


# ---- open / release / pool -----------------------------------------------------------------
def test_second_open_refused_release_twice_is_noop(tiny_llama, tiny_llama_dir):
    for spec in ("ngram", f"draft:{tiny_llama_dir}"):
        parts = build(tiny_llama, spec)
        seq = open_stream(parts, 1)
        with pytest.raises(BadInputError, match="already open"):
            parts.scheduler.drafter.open(seq)
        parts.scheduler.drafter.release(seq.lane)
        parts.scheduler.drafter.release(seq.lane)
        assert not parts.scheduler.drafter.is_open(seq)
        parts.scheduler.drafter.open(seq)  # open again after release (e.g. after preemption)


def test_release_destroys_borrowed_context_and_leaves_the_run_alone(tiny_llama, tiny_llama_dir):
    parts = build(tiny_llama, f"draft:{tiny_llama_dir}")
    seq = open_stream(parts, 1)
    parts.scheduler.runs.reserve(seq.lane, 9)
    pages = list(parts.scheduler.runs.pages(seq.lane))
    ctx = contexts(parts).open_by_lane[seq.lane]
    parts.scheduler.drafter.release(seq.lane)
    assert ctx.views is None and ctx.area_offset is None  # destroyed
    assert ctx not in contexts(parts).pool and contexts(parts).areas.num_in_use == 0
    assert parts.lanes.owner(seq.lane) == 1 and parts.scheduler.runs.pages(seq.lane) == pages
    parts.lanes.release(seq.lane)  # the lane's release path: drafter already gone, no-op
    assert parts.scheduler.runs.num_pages_in_use == 0 and parts.lanes.num_in_use == 0


def cycle_with_one_area(parts) -> None:
    """A borrows the one area; B falls back to an owned context; A and B go; C borrows the
    freed area; D must get B's owned context back from the pool, not A's old views."""
    drafter, ctxs = parts.scheduler.drafter, contexts(parts)
    a, b = open_stream(parts, 1), open_stream(parts, 2)
    ctx_b = ctxs.open_by_lane[b.lane]
    assert ctxs.open_by_lane[a.lane].borrowed and not ctx_b.borrowed
    check_contexts(ctxs)
    parts.lanes.release(a.lane)
    parts.lanes.release(b.lane)
    assert ctxs.pool == [ctx_b]  # the owned context went back to the pool
    check_contexts(ctxs)
    c, d = open_stream(parts, 3), open_stream(parts, 4)
    assert ctxs.open_by_lane[d.lane] is ctx_b and ctxs.num_owned == 1
    check_contexts(ctxs)
    for s in (c, d):
        drafter.release(s.lane)
    check_contexts(ctxs)
    assert ctxs.areas.num_in_use == 0


def test_owned_context_goes_back_to_the_pool(tiny_llama, tiny_llama_dir):
    cycle_with_one_area(build(tiny_llama, f"draft:{tiny_llama_dir}", draft_areas=1))


def test_mutation_pooling_a_borrowed_context_turns_red(tiny_llama, tiny_llama_dir, monkeypatch):
    """The check above must catch the bug it guards against: pool every context."""
    monkeypatch.setattr(drafter_contexts, "should_pool", lambda ctx: True)
    with pytest.raises(AssertionError):
        cycle_with_one_area(build(tiny_llama, f"draft:{tiny_llama_dir}", draft_areas=1))


# ---- refusals -----------------------------------------------------------------------------
def _write_model(folder: Path, **overrides) -> Path:
    from tests.tiny_hf import write_hf

    cfg = tiny_config("llama", **overrides)
    return write_hf(folder, cfg, random_hf_weights(cfg, seed=3))


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    bigger = _write_model(tmp_path / "v", vocab_size=384)
    with pytest.raises(BadInputError, match="vocab size 384"):
        build(tiny_llama, f"draft:{bigger}")
    swapped = _write_model(tmp_path / "t")
    tok = json.loads((swapped / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    with pytest.raises(BadInputError, match="token texts differ"):
        build(tiny_llama, f"draft:{swapped}")


def test_mtp_on_a_model_without_mtp_layer_and_unknown_drafter_are_clear_errors(tiny_llama):
    with pytest.raises(BadInputError, match="no MTP layer"):
        build(tiny_llama, "mtp")
    with pytest.raises(BadInputError, match="unknown drafter"):
        build(tiny_llama, "medusa")


def test_drafter_specs_parse_against_the_one_table_of_kinds():
    from tf_async.engine.drafters.registry import KINDS, parse_drafter
    from tf_async.engine.drafting import DrafterSpec

    assert set(KINDS) == {"ngram", "mtp", "draft", "dflash"}
    assert parse_drafter("ngram") == DrafterSpec("ngram")
    assert parse_drafter("mtp") == DrafterSpec("mtp")
    assert parse_drafter("draft:/m/a:b") == DrafterSpec("draft", "/m/a:b")
    assert parse_drafter("dflash:/m/d") == DrafterSpec("dflash", "/m/d")
    for bad in ("draft", "draft:", "ngram:x", "mtp:", "medusa", "", "dflash", "dflash:"):
        with pytest.raises(BadInputError, match="expected one of ngram, mtp, draft:PATH, dflash:PATH"):
            parse_drafter(bad)


def test_ngram_proposals_shrink_after_a_rejection_and_grow_back_after_full_acceptance():
    from tf_async.engine.sequence import SeqRows

    drafter = NgramDrafter(draft_tokens=8)
    seq = make_sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2], SamplingParams(), 0, ())
    seq.lane = 0
    drafter.open(seq)

    def round_with(accepted: int) -> int:
        drafts = drafter.propose(seq, 16)
        rows = SeqRows(1, 0, 13, (2, *drafts), 1 + len(drafts), drafts)
        drafter.absorb(seq, rows, accepted + 1, None)
        return len(drafts)

    assert round_with(accepted=0) == 8  # full length at first, then one draft after a miss
    assert round_with(accepted=1) == 1
    assert [round_with(accepted=99) for _ in range(4)] == [2, 4, 8, 8]  # doubling back
    assert round_with(accepted=3) == 8 and len(drafter.propose(seq, 16)) == 4  # partial: 3 + 1
    drafter.release(0)
    drafter.open(seq)
    assert len(drafter.propose(seq, 16)) == 8  # a new stream starts at the full length


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    t = np.asarray
    assert ngram_lookup(t([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]), 3, 4) == [8, 5, 1, 2]
    assert ngram_lookup(t([7, 2, 3, 4, 5, 6, 1, 3]), 3, 2) == [4, 5]  # falls back to n = 1
    assert ngram_lookup(t([4, 4, 4]), 3, 8) == [4]  # the suffix itself is never a match
    assert ngram_lookup(t([1, 2, 3]), 3, 4) == []
    assert ngram_lookup(t([7, 2, 3, 4, 5, 6, 1, 3]), 3, 2, min_ngram=2) == []  # no 1-token match


# ---- order of events ----------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("spec", ["ngram", "draft"])
async def test_stepped_prompt_opens_the_drafter_on_the_targets_lane(tiny_llama, tiny_llama_dir, spec):
    drafter = "ngram" if spec == "ngram" else f"draft:{tiny_llama_dir}"
    async with Engine(tiny_llama, device="cpu", parallel=3, ctx=128, page_size=4, step_tokens=5,
                      drafter=drafter, draft_tokens=3) as eng:
        sched, lanes = eng.parts.scheduler, eng.parts.lanes
        seen: list[tuple] = []
        real_open = sched.drafter.open
        bad_first = eng.tokenizer.encode(PROMPTS[2])[0]  # prompts differ in their first token

        def open_(seq):  # record what the drafter sees when it opens
            seen.append((seq.request_id, lanes.owner(seq.lane) == seq.request_id,
                         len(sched.runs.pages(seq.lane)) > 0,
                         seq.num_computed - seq.num_cached_tokens))  # rows it computed so far
            if seq.prompt_ids[:3] == eng.tokenizer.encode(PROMPTS[4])[:3]:
                raise RuntimeError("injected open failure")
            real_open(seq)

        def inject(rows):
            if rows.start_pos == 0 and rows.token_ids[0] == bad_first:
                raise RuntimeError("injected step failure")

        sched.drafter.open = open_
        eng.parts.runner.fault_injector = inject
        outs = await asyncio.gather(*(eng.complete(p, max_tokens=6) for p in PROMPTS[:6]),
                                    return_exceptions=True)
        assert "injected step failure" in str(outs[2]) and "injected open failure" in str(outs[4])
        assert isinstance(outs[2], RequestFailedError) and isinstance(outs[4], RequestFailedError)
        assert all(len(o.token_ids) == 6 for i, o in enumerate(outs) if i not in (2, 4))
        # one open per stream that passed its first step (not the failed step's), each on the
        # target's own lane with its run already holding the first step's pages
        assert len(seen) == 5 and all(owner and pages and done == 0 for _, owner, pages, done in seen)
        await idle_stats(eng)




# ---- pacing: a stream whose drafts keep failing drafts less -----------------------------------
class _Scripted:
    """The engine's ngram drafter behind drafts of the target's own next tokens, made wrong
    while `wrong(output_len)` holds; records the output length of every proposal it makes."""

    def __init__(self, inner, truth: list[int], vocab: int, wrong):
        self.inner, self.truth, self.vocab, self.wrong = inner, truth, vocab, wrong
        self.at: list[int] = []
        self.limits: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, seq, limit: int) -> tuple[int, ...]:
        done = len(seq.output_ids)
        right = self.truth[done:done + min(limit, 2)]
        if not right:
            return ()
        self.at.append(done)
        self.limits.append(limit)
        return tuple((t + 1) % self.vocab if self.wrong(done) else t for t in right)


@pytest.mark.parametrize("backoff", [0, 4, 32])
async def test_rejected_drafts_pause_drafting_and_an_accepted_one_resumes_it(tiny_llama, backoff):
    """draft_backoff: after n drafted rounds in a row with every draft rejected a stream skips
    drafting for min(2**(n-1) - 1, backoff) rounds and then probes with one draft (n >= 2);
    an accepted draft resets n (drafting every round, all drafts, again). 0: every round
    drafts in full. Outputs equal plain decode whatever the pacing."""
    prompt, max_tokens = PROMPTS[1], 60
    async with Engine(tiny_llama, device="cpu", parallel=1, ctx=128) as eng:
        truth = (await eng.complete(prompt, max_tokens=max_tokens, ignore_eos=True)).token_ids
    async with Engine(tiny_llama, device="cpu", parallel=1, ctx=128, drafter="ngram",
                      draft_backoff=backoff) as eng:
        sched = eng.parts.scheduler
        sched.drafter = scripted = _Scripted(sched.drafter, truth, tiny_llama.config.vocab_size,
                                             lambda done: done < 20)
        out = await eng.complete(prompt, max_tokens=max_tokens, ignore_eos=True)
        stats = eng.stats()
    assert out.token_ids == truth
    expected, done, misses, paused = [], 1, 0, 0  # the first decode round has one output token
    while done < 20:  # every proposal rejected: one token a round
        expected.append(done)
        misses += 1
        pause = min((1 << (misses - 1)) - 1, backoff) if backoff else 0
        done, paused = done + 1 + pause, paused + pause
    assert stats["draft_paused_rounds"] == paused
    assert scripted.at[:len(expected)] == expected
    probes = [1 if backoff and i >= 2 else None for i in range(len(expected))]
    assert [lim if p is None else 1 for lim, p in zip(scripted.limits, probes, strict=False)] \
        == scripted.limits[:len(expected)]
    assert all(lim > 1 for lim, p in zip(scripted.limits, probes, strict=False) if p is None)
    tail = scripted.at[len(expected) + 1:]  # after the accepted probe (one draft): all drafts
    assert tail and all(b - a in (2, 3) for a, b in zip(tail, tail[1:], strict=False))
    assert stats["drafted_tokens"] > 0


def test_draft_backoff_is_checked() -> None:
    with pytest.raises(BadInputError, match="draft_backoff"):
        Engine(None, draft_backoff=-1)
