"""Sampled (non-greedy) DFlash drafts: with temperature each draft is drawn as the target draws
its position (the request's seed and the position; DFlash2: softmax(score / T) over the
selector's candidates), so drafts are reproducible and, where the drafter's distribution is
the target's, every draft is accepted; drafted == plain still holds (verification keeps a draft
only when the target samples it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine_helpers import idle_stats
from tests.resume_helpers import record_proposals
from tests.tiny_dflash import dflash_config, dflash_weights, write_dflash
from tf_async import Engine
from tf_async.engine.drafters import dflash as dflash_drafter
from tf_async.engine.drafters.dflash import DFlashDrafter
from tf_async.gate import PROMPTS

OPTIONS: dict[str, Any] = dict(device="cpu", parallel=4, ctx=128, page_size=4, step_tokens=16)
SAMPLINGS = [{"temperature": 0.9}, {"temperature": 8.0, "top_k": 40},
             {"temperature": 1.5, "top_p": 0.9}]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DFlash, DFlash2, and DFlash2 with zeroed codebooks (its scores are its logits)."""
    out = {}
    for name, generation in (("dflash", 1), ("dflash2", 2), ("dflash2-flat", 2)):
        cfg = dflash_config(generation)
        weights = dflash_weights(cfg, seed=generation)
        if name.endswith("flat"):
            weights["candidate_selector.predecessor_codebook"] *= 0
        out[name] = write_dflash(tmp_path_factory.mktemp(name), cfg, weights)
    return out


def _params(index: int) -> dict[str, Any]:
    return {"max_tokens": 14, "ignore_eos": True, "seed": 40 + index, **SAMPLINGS[index % 3]}


async def _run(eng: Engine, prompts: list[str]) -> list[list[int]]:
    done = await asyncio.gather(*(eng.complete(p, **_params(i)) for i, p in enumerate(prompts)))
    return [d.token_ids for d in done]


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["dflash", "dflash2"])
async def test_seeded_sampled_drafts_keep_drafted_equal_to_plain(tiny_llama, drafters, name):
    prompts = list(PROMPTS[:4])
    async with Engine(tiny_llama, **OPTIONS) as eng:
        plain = await _run(eng, prompts)
    proposals = []
    for _ in range(2):  # drafts are a function of the request (seed, positions): reproducible
        async with Engine(tiny_llama, **OPTIONS, drafter=f"dflash:{drafters[name]}",
                          draft_tokens=3) as eng:
            seen = record_proposals(eng)
            assert await _run(eng, prompts) == plain
            stats = await idle_stats(eng)
        assert stats["drafted_tokens"] > 0 and stats["draft_areas_in_use"] == 0
        proposals.append(seen)
    assert proposals[0] == proposals[1]


async def _forced_acceptance(ckpt: Any, path: Path, sampled: bool, monkeypatch: Any
                             ) -> tuple[list[int], dict[str, Any]]:
    """One seeded stream whose draft rows' logits are forced to the target's own (recorded on
    a plain run): with sampled drafts every draft is the target's draw. top_k 4 = the tiny
    DFlash2's selector_top_k, so the target draws among the selector's candidates."""
    prompt, params = PROMPTS[0], {"max_tokens": 24, "ignore_eos": True, "seed": 5,
                                  "temperature": 1.0, "top_k": 4}
    target_rows: dict[int, np.ndarray] = {}
    async with Engine(ckpt, **OPTIONS) as eng:
        runner, execute = eng.parts.runner, eng.parts.runner.execute

        def record(plan: Any) -> Any:
            result = execute(plan)
            for rows in plan.rows:
                first = rows.start_pos + len(rows.token_ids) - rows.num_logit_rows + 1
                for i, row in enumerate(result.logits.get(rows.request_id, ())):
                    target_rows[first + i] = np.array(row)
            return result

        runner.execute = record  # type: ignore[method-assign]
        plain = (await eng.complete(prompt, **params)).token_ids
    if not sampled:
        monkeypatch.setattr(dflash_drafter, "samples", lambda seq: False)
    async with Engine(ckpt, **OPTIONS, drafter=f"dflash:{path}", draft_tokens=3) as eng:
        drafter = eng.parts.scheduler.drafter
        assert isinstance(drafter, DFlashDrafter)
        model, block_logits = drafter.model, drafter.model.block_logits

        def forced(ring: Any, start: int, anchor: int) -> tuple[Any, Any]:
            logits, projected = block_logits(ring, start, anchor)  # the real forward still runs
            vocab = int(logits.shape[1])
            rows = [target_rows.get(start + 1 + t, np.zeros(vocab, np.float32))
                    for t in range(int(logits.shape[0]))]
            return drafter.ops.asarray(np.stack(rows)), projected

        model.block_logits = forced  # type: ignore[method-assign]
        model.propose = lambda ring, start, anchor: np.argmax(  # type: ignore[method-assign]
            drafter.ops.to_host(forced(ring, start, anchor)[0]), axis=-1)
        got = (await eng.complete(prompt, **params)).token_ids
        stats = await idle_stats(eng)
    assert got == plain
    return got, stats


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["dflash", "dflash2-flat"])
async def test_sampled_drafts_from_the_targets_distribution_are_all_accepted(
        tiny_llama, drafters, name, monkeypatch):
    _, sampled = await _forced_acceptance(tiny_llama, drafters[name], True, monkeypatch)
    _, greedy = await _forced_acceptance(tiny_llama, drafters[name], False, monkeypatch)
    assert sampled["accepted_tokens"] == sampled["drafted_tokens"] > 0, sampled
    assert greedy["accepted_tokens"] < sampled["accepted_tokens"], (greedy, sampled)
    print(f"{name}: T=1 forced target logits: sampled drafts {sampled['accepted_tokens']}/"
          f"{sampled['drafted_tokens']} accepted, greedy drafts {greedy['accepted_tokens']}/"
          f"{greedy['drafted_tokens']}")


def test_a_greedy_request_never_takes_the_sampled_path() -> None:
    from types import SimpleNamespace

    def seq(**params: Any) -> Any:
        return SimpleNamespace(params=SimpleNamespace(**{"temperature": 0.0, "top_k": 0, **params}))

    assert not dflash_drafter.samples(seq())
    assert not dflash_drafter.samples(seq(temperature=0.7, top_k=1))
    assert dflash_drafter.samples(seq(temperature=0.7))
