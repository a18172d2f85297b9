"""`--drafter dflash:PATH`: drafted == plain on a tiny dense and a tiny hybrid target (greedy
and seeded, paging on/off, 1/2/4 streams, owned fallbacks, cancels mid-draft), the gate, the
context ring in the lane's area, and a mismatched drafter refused at start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests import tiny_qwen35 as tq
from tests.engine_helpers import idle_stats, run_with_cancels
from tests.tiny import random_hf_weights, tiny_config
from tests.tiny_dflash import dflash_config, dflash_weights, write_dflash
from tests.tiny_hf import write_hf
from tf_async import Engine
from tf_async.engine.drafters.dflash import DFlashDrafter
from tf_async.errors import BadInputError
from tf_async.gate import PROMPTS, run_gates
from tf_async.models.loader import load_checkpoint

pytestmark = pytest.mark.asyncio

MAX_TOKENS = 16
# (draft tokens k, concurrent streams, paging, drafter areas: None = one a lane, 1 = fallback)
SWEEP = [(3, 1, True, None), (2, 2, False, None), (3, 4, True, 1)]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny DFlash (target layers 0, 1) and DFlash2 drafters for 2-layer targets."""
    out = {}
    for generation in (1, 2):
        cfg = dflash_config(generation)
        out[generation] = write_dflash(tmp_path_factory.mktemp(f"dflash{generation}"), cfg,
                                       dflash_weights(cfg, seed=generation))
    return out


@pytest.fixture(scope="module")
def hybrid_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFlash2 drafter reading layers 1 and 3 of the 4-layer tiny hybrid."""
    cfg = dflash_config(2, num_target_layers=4)
    cfg["dflash_config"]["target_layer_ids"] = [1, 3]
    return write_dflash(tmp_path_factory.mktemp("dflash_hybrid"), cfg, dflash_weights(cfg, seed=9))


def sampling(mode: str, index: int) -> dict:
    if mode == "greedy":
        return {"max_tokens": MAX_TOKENS}
    return {"max_tokens": MAX_TOKENS, "temperature": 8.0, "top_k": 40, "seed": 700 + index}


def make_engine(ckpt, **kw) -> Engine:
    opts = dict(device="cpu", parallel=4, ctx=128, page_size=4, step_tokens=16)
    return Engine(ckpt, **{**opts, **kw})


async def run_all(eng: Engine, prompts: list[str], mode: str) -> list[list[int]]:
    outs = await asyncio.gather(*(eng.complete(p, **sampling(mode, i)) for i, p in enumerate(prompts)))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama) -> dict[str, list[list[int]]]:
    async def solo(mode: str) -> list[list[int]]:
        async with make_engine(tiny_llama, parallel=1) as eng:
            return [(await eng.complete(p, **sampling(mode, i))).token_ids
                    for i, p in enumerate(PROMPTS[:4])]

    return {mode: asyncio.run(solo(mode)) for mode in ("greedy", "seeded")}


@pytest.mark.parametrize("generation", [1, 2])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_drafted_equals_plain_on_tiny_dense_target(tiny_llama, drafters, plain, generation, mode):
    for k, streams, paging, areas in SWEEP:
        async with make_engine(tiny_llama, parallel=min(streams, 4), paging=paging,
                               drafter=f"dflash:{drafters[generation]}", draft_tokens=k,
                               draft_areas=areas) as eng:
            got = await run_all(eng, list(PROMPTS[:streams]), mode)
            assert got == plain[mode][:streams], (k, streams, paging)
            stats = await idle_stats(eng)
        assert stats["drafted_tokens"] > 0, (k, streams)
        assert stats["draft_area_bytes_in_use"] == 0
        if areas == 1:
            assert stats["draft_contexts_owned"] >= 1  # the fallback path ran


async def test_cancels_mid_draft_leave_others_equal_to_plain(tiny_llama, drafters, plain):
    cancel_after = [None, 1, None, 5, 2, None, 9, None]
    prompts = list(PROMPTS[:4]) * 2
    async with make_engine(tiny_llama, parallel=3, step_tokens=5, drafter=f"dflash:{drafters[2]}",
                           draft_tokens=3) as eng:
        results = await run_with_cancels(eng, prompts, lambda i: sampling("seeded", i % 4),
                                         cancel_after, cancel_task=7)
        for i, got in enumerate(results):
            if cancel_after[i] is None and i != 7:
                assert got == plain["seeded"][i % 4], i
        stats = await idle_stats(eng)
        assert stats["draft_area_bytes_in_use"] == 0


async def test_gate_passes_on_dense_and_hybrid_targets(tiny_llama, drafters, hybrid_drafter, tmp_path):
    cfg = tq.tiny_qwen35_config(moe=False)
    hybrid = load_checkpoint(tq.write_qwen35_hf(tmp_path / "hybrid", cfg, tq.random_qwen35_weights(cfg, seed=5), "bf16"))
    for ckpt, path in ((tiny_llama, drafters[1]), (hybrid, hybrid_drafter)):
        rows, idle = await run_gates(ckpt, device="cpu", max_tokens=10, ctx=128,
                                     prompts=PROMPTS[:6], drafters=(f"dflash:{path}",),
                                     temperature=8.0)
        failed = [r for r in rows if not r.ok]
        assert not failed, failed
        assert idle[f"drafted-dflash:{path}-seeded"]["drafted_tokens"] > 0, sorted(idle)


async def test_ring_follows_the_committed_rows_in_the_lanes_area(tiny_llama, drafters):
    """While a stream decodes, its ring holds exactly positions [0, num_tokens - 1): the rows
    projected from the target's captured layers, in the area borrowed from its run."""
    async with make_engine(tiny_llama, parallel=1, drafter=f"dflash:{drafters[1]}",
                           draft_tokens=3) as eng:
        drafter = eng.parts.scheduler.drafter
        assert isinstance(drafter, DFlashDrafter)
        seen: list[tuple[int, int, bool]] = []
        propose = drafter.propose

        def spy(seq, limit):
            ctx = drafter.contexts.get(seq)
            assert ctx is not None and ctx.views is not None
            seen.append((ctx.num_valid, seq.num_tokens, ctx.borrowed))
            return propose(seq, limit)

        drafter.propose = spy  # type: ignore[method-assign]
        await eng.complete(PROMPTS[0], max_tokens=MAX_TOKENS)
        await idle_stats(eng)
    assert seen and all(valid == num_tokens - 1 and borrowed for valid, num_tokens, borrowed in seen), seen


async def test_mismatched_drafter_is_refused_at_start(tmp_path):
    cfg = tiny_config("llama", hidden_size=32, intermediate_size=48)
    target = load_checkpoint(write_hf(tmp_path / "target", cfg, random_hf_weights(cfg)))
    draft_cfg = dflash_config(1)
    path = write_dflash(tmp_path / "dflash", draft_cfg, dflash_weights(draft_cfg))
    with pytest.raises(BadInputError, match="hidden_size 64 != the target's 32"):
        async with make_engine(target, drafter=f"dflash:{path}"):
            pass


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_forced_full_acceptance_keeps_the_ring_in_sync(tiny_llama, drafters, plain, mode,
                                                             monkeypatch):
    """Drafts forced to the target's own continuation (the real block forward still runs on
    the ring): every draft is accepted, several rows a round enter the ring, output == plain.
    (Seeded too through `propose`: sampled drafts are tests/test_dflash_sampled.py's.)"""
    from tf_async.engine.drafters import dflash as dflash_drafter

    monkeypatch.setattr(dflash_drafter, "samples", lambda seq: False)
    async with make_engine(tiny_llama, parallel=1, drafter=f"dflash:{drafters[2]}",
                           draft_tokens=3) as eng:
        drafter = eng.parts.scheduler.drafter
        assert isinstance(drafter, DFlashDrafter)
        want = plain[mode][0]
        real_propose, real_draft = drafter.model.propose, drafter._draft
        seen: list[tuple[int, int]] = []

        def oracle(seq, limit):
            ctx = drafter.contexts.get(seq)
            seen.append((ctx.num_valid, seq.num_tokens))
            done = len(seq.output_ids)
            drafter.model.propose = lambda ring, start, anchor: (
                real_propose(ring, start, anchor), np.asarray(want[done:done + 3], np.int64))[1]
            return real_draft(ctx, seq, limit)

        drafter._draft = lambda ctx, seq, limit: oracle(seq, limit)  # type: ignore[method-assign]
        got = (await eng.complete(PROMPTS[0], **sampling(mode, 0))).token_ids
        stats = await idle_stats(eng)
    assert got == want
    assert stats["accepted_tokens"] == stats["drafted_tokens"] > 2 * len(seen) > 0
    assert all(valid == num_tokens - 1 for valid, num_tokens in seen), seen


async def test_a_failed_draft_is_isolated_to_its_stream(tiny_llama, drafters, plain, caplog):
    """A drafter failure for one stream: that stream decodes without drafts, output == plain,
    the other streams keep drafting."""
    async with make_engine(tiny_llama, parallel=4, drafter=f"dflash:{drafters[2]}",
                           draft_tokens=3) as eng:
        drafter = eng.parts.scheduler.drafter
        assert isinstance(drafter, DFlashDrafter)
        real_draft, failed = drafter._draft, set()

        def flaky(ctx, seq, limit):
            if seq.prompt_ids == eng.tokenizer.encode(PROMPTS[1], add_special_tokens=eng.tokenizer.add_bos):
                failed.add(seq.request_id)
                raise RuntimeError("injected drafter failure")
            return real_draft(ctx, seq, limit)

        drafter._draft = flaky  # type: ignore[method-assign]
        got = await run_all(eng, list(PROMPTS[:4]), "greedy")
        stats = await idle_stats(eng)
    assert got == plain["greedy"][:4]
    assert len(failed) == 1 and "injected drafter failure" in caplog.text
    assert stats["drafted_tokens"] > 0


@pytest.mark.parametrize("capacity", [1, 3, 4096])
async def test_ring_capacity_and_area_layout(tiny_llama, drafters, plain, capacity):
    """The area holds [layers, 2, capacity, nkv, hd] f32 (DFlash2: at most its window of 6
    rows); a ring too small for what a block attends stops drafting, never changes output."""
    for generation in (1, 2):
        async with make_engine(tiny_llama, parallel=2, drafter=f"dflash:{drafters[generation]}",
                               draft_tokens=3, draft_ring=capacity) as eng:
            drafter = eng.parts.scheduler.drafter
            assert isinstance(drafter, DFlashDrafter)
            rows = min(capacity, 6) if generation == 2 else capacity
            assert drafter.contexts.layout.ring_shape == (2, 2, rows, 2, 16)
            assert drafter.contexts.layout.ring_bytes == 2 * 2 * rows * 2 * 16 * 4
            got = await run_all(eng, list(PROMPTS[:2]), "greedy")
            stats = await idle_stats(eng)
        assert got == plain["greedy"][:2]
        assert (stats["drafted_tokens"] > 0) == (rows >= 5), (generation, capacity, stats)
