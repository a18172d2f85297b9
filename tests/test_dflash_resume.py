"""DFlash drafters on streams resumed from cached prefix pages (issue 18's prefix cache): the
drafter's context rows of the cached positions are kept beside the pages
(engine/drafters/dflash_pages.py), so a resumed stream drafts exactly as on an engine without
the cache: same outputs, same proposals (keyed by the stream's tokens), same drafted and
accepted counts per request; 0 lanes / 0 areas at idle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests import tiny_qwen35 as tq
from tests.resume_helpers import (
    Proposals,
    Turn,
    chat,
    differing,
    resumed_and_fresh,
    sampling,
    shared_prefix_twice,
    tokens,
    turn_of,
)
from tests.tiny_dflash import dflash_config, dflash_weights, write_dflash
from tf_async import Engine
from tf_async.models.loader import load_checkpoint

pytestmark = pytest.mark.asyncio

PAGE = 4
# draft_backoff=0: every round drafts in full, so proposals on the same tokens compare (the
# pacing follows each stream's own history of rejected rounds)
OPTIONS: dict[str, Any] = dict(device="cpu", parallel=4, ctx=128, page_size=PAGE, step_tokens=16,
                               draft_tokens=3, draft_backoff=0)


@pytest.fixture(scope="module")
def targets(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str]]:
    """(target, dflash spec): DFlash on the dense target, DFlash2 on it and on the hybrid."""
    out: dict[str, tuple[Any, str]] = {}
    for generation in (1, 2):
        cfg = dflash_config(generation)
        path = write_dflash(tmp_path_factory.mktemp(f"d{generation}"), cfg,
                            dflash_weights(cfg, seed=generation))
        out[f"dense{generation}"] = (tiny_llama, f"dflash:{path}")
    hcfg = tq.tiny_qwen35_config(moe=False)
    hybrid = load_checkpoint(tq.write_qwen35_hf(tmp_path_factory.mktemp("hyb"), hcfg,
                                                tq.random_qwen35_weights(hcfg, seed=5), "bf16"))
    cfg = dflash_config(2, num_target_layers=4)
    cfg["dflash_config"]["target_layer_ids"] = [1, 3]
    path = write_dflash(tmp_path_factory.mktemp("dh"), cfg, dflash_weights(cfg, seed=9))
    out["hybrid2"] = (hybrid, f"dflash:{path}")
    return out


def _assert_same_drafting(resumed: list[Turn], fresh: list[Turn], seen: Proposals,
                          fresh_seen: Proposals, stats: dict[str, Any]) -> None:
    assert [t[0] for t in resumed] == [t[0] for t in fresh]  # drafted == plain (== fresh)
    assert sum(t[2] for t in resumed) > 0
    common, differ = differing(seen, fresh_seen)
    assert differ == 0 and common >= len(seen) // 2, (common, differ, len(seen))
    assert stats["prefix_cache_hit_pages"] > 0
    assert stats["draft_area_bytes_in_use"] == 0 and stats["draft_areas_in_use"] == 0


@pytest.mark.parametrize("kind", ["dense1", "dense2", "hybrid2"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_resumed_chat_drafts_as_fresh(targets, kind, mode) -> None:
    ckpt, spec = targets[kind]
    resumed, fresh, seen, fresh_seen, stats = await resumed_and_fresh(
        ckpt, {**OPTIONS, "drafter": spec}, lambda eng: chat(eng, 3, mode, seed=3))
    _assert_same_drafting(resumed, fresh, seen, fresh_seen, stats)
    assert [t[2:] for t in resumed] == [t[2:] for t in fresh]  # drafted, accepted a turn
    assert all(t[1] > 0 for t in resumed[1:]), resumed
    if kind.startswith("dense"):  # the closed turn's partial last page: rows copied
        assert stats["prefix_cache_copied_rows"] > 0


@pytest.mark.parametrize("kind", ["dense2", "hybrid2"])
async def test_concurrent_streams_sharing_a_prefix_draft_as_fresh(targets, kind) -> None:
    ckpt, spec = targets[kind]
    for mode in ("greedy", "seeded"):
        resumed, fresh, seen, fresh_seen, stats = await resumed_and_fresh(
            ckpt, {**OPTIONS, "drafter": spec},
            lambda eng, mode=mode: shared_prefix_twice(eng, 4, mode))
        _assert_same_drafting(resumed, fresh, seen, fresh_seen, stats)
        # (which wave-2 streams find a kept hybrid state is the cache's policy, not the drafter's)
        assert sum(t[1] > 0 for t in resumed[4:]) >= 3, resumed


async def test_eviction_under_pressure_keeps_outputs_and_drafts(targets) -> None:
    """A pool of 40 pages for 4 lanes of 32: the cache evicts while streams run; pages reused
    for other tokens are never read as the old rows (outputs and proposals stay as fresh)."""
    ckpt, spec = targets["dense2"]

    async def run(eng: Engine) -> list[Turn]:
        out: list[Turn] = []
        for wave in range(3):
            out += await shared_prefix_twice(eng, 4, "seeded" if wave % 2 else "greedy")
        return out

    resumed, fresh, seen, fresh_seen, stats = await resumed_and_fresh(
        ckpt, {**OPTIONS, "drafter": spec, "kv_pages": 40}, run)
    _assert_same_drafting(resumed, fresh, seen, fresh_seen, stats)
    assert stats["prefix_cache_evictions"] > 0, stats


async def test_a_context_not_rebuilt_from_the_kept_rows_is_caught(targets, monkeypatch) -> None:
    """Mutation: the kept rows read back as zeros: outputs stay equal, proposals differ."""
    from tf_async.engine.drafters.dflash_pages import ContextPages

    real = ContextPages.rows_of
    monkeypatch.setattr(ContextPages, "rows_of", lambda self, *a: real(self, *a) * 0)
    ckpt, spec = targets["dense1"]
    resumed, fresh, seen, fresh_seen, _ = await resumed_and_fresh(
        ckpt, {**OPTIONS, "drafter": spec}, lambda eng: chat(eng, 3, "greedy", seed=3))
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    assert differing(seen, fresh_seen)[1] > 0


async def test_kept_rows_cost_is_counted_in_the_arena(targets) -> None:
    """H f32 a cached position: page_size * H * 4 bytes a page, allocated once at start."""
    ckpt, spec = targets["dense2"]
    async with Engine(ckpt, **OPTIONS, drafter=spec, kv_pages=40) as eng:
        arena = eng.parts.arena
        assert arena.drafter_page_bytes == 40 * PAGE * 64 * 4
    async with Engine(ckpt, **OPTIONS, drafter=spec, prefix_cache=False) as eng:
        assert eng.parts.arena.drafter_page_bytes == 0


async def test_a_hybrid_resuming_mid_prompt_rebuilds_its_ring(targets) -> None:
    """Two streams with one long prefix admitted together (states every 8 rows, 12-row
    budget): the second computes its first rows itself, then resumes mid-prompt from the
    first's pages and states; its ring is rebuilt from its own kept rows and the first's."""
    ckpt, spec = targets["hybrid2"]
    prefix = tokens(30, 70)
    prompts = [prefix + tokens(31 + i, 6) for i in range(2)]
    options = {**OPTIONS, "drafter": spec, "prefix_state_pages": 2, "step_tokens": 12}

    async def run(eng: Engine) -> list[Turn]:
        done = await asyncio.gather(*(eng.complete(p, **sampling("seeded", i))
                                      for i, p in enumerate(prompts)))
        return [turn_of(d) for d in done]

    resumed, fresh, seen, fresh_seen, stats = await resumed_and_fresh(ckpt, options, run)
    _assert_same_drafting(resumed, fresh, seen, fresh_seen, stats)
    assert resumed[1][1] >= 24 and stats["prefix_states_resumed"] > 0
