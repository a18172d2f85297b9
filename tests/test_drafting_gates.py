"""drafted == plain: token for token, greedy and seeded, k = 1/2/4/8, paging on and off,
1/2/4/8 concurrent streams, cancels mid-draft; ngram, a different tiny draft model, and the
target as its own drafter (which must accept every draft). Idle is empty after each."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.engine_helpers import idle_stats, run_with_cancels
from tests.tiny import random_hf_weights, tiny_config
from tf_async import Engine
from tf_async.gate import PROMPTS

pytestmark = pytest.mark.asyncio

MAX_TOKENS = 24
# (draft tokens k, concurrent streams, paging, drafter areas: None = one a lane, 1 = fallback)
SWEEP = [(1, 1, True, None), (2, 2, False, None), (4, 4, True, 1), (8, 8, False, None),
         (4, 8, True, None)]


def sampling(mode: str, index: int) -> dict:
    if mode == "greedy":
        return {"max_tokens": MAX_TOKENS}
    # temperature 8 on a tiny random model: sampling is far from greedy, drafts often differ
    return {"max_tokens": MAX_TOKENS, "temperature": 8.0, "top_k": 40, "seed": 500 + index}


def make_engine(ckpt, *, draft_areas: int | None = None, **kw) -> Engine:
    # ngram_min 1: random tiny-model text rarely repeats 2-grams; draft_areas: fewer areas
    # than lanes make owned fallbacks
    opts = dict(device="cpu", parallel=4, ctx=256, page_size=4, step_tokens=16, ngram_min=1,
                draft_areas=draft_areas)
    return Engine(ckpt, **{**opts, **kw})


async def run_all(eng: Engine, prompts: list[str], mode: str) -> list[list[int]]:
    outs = await asyncio.gather(*(eng.complete(p, **sampling(mode, i)) for i, p in enumerate(prompts)))
    return [o.token_ids for o in outs]


def record_draft_sizes(eng: Engine) -> list[int]:
    """Drafts per verify round, recorded as the scheduler builds rows."""
    sizes: list[int] = [0]
    sched = eng.parts.scheduler
    build_rows = sched._decode_rows

    def decode_rows(seq, pages_to_zero):
        rows = build_rows(seq, pages_to_zero)
        sizes.append(len(rows.draft_ids) if rows is not None else 0)
        return rows

    sched._decode_rows = decode_rows
    return sizes


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different tiny random model (1 layer, H=32) with the same tokenizer."""
    from tests.tiny_hf import write_hf

    cfg = tiny_config("llama", hidden_size=32, num_hidden_layers=1, intermediate_size=48)
    return write_hf(tmp_path_factory.mktemp("draft_small"), cfg, random_hf_weights(cfg, seed=7))


@pytest.fixture(scope="module")
def plain(tiny_llama) -> dict[str, list[list[int]]]:
    async def solo(mode: str) -> list[list[int]]:
        async with make_engine(tiny_llama, parallel=1) as eng:
            return [(await eng.complete(p, **sampling(mode, i))).token_ids
                    for i, p in enumerate(PROMPTS)]

    return {mode: asyncio.run(solo(mode)) for mode in ("greedy", "seeded")}


def drafter_spec(kind: str, tiny_llama_dir: Path, other: Path) -> str:
    return {"ngram": "ngram", "self": f"draft:{tiny_llama_dir}", "other": f"draft:{other}"}[kind]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["ngram", "other", "self"])
async def test_drafted_equals_plain_on_tiny_model(tiny_llama, tiny_llama_dir, other_draft_dir,
                                                  plain, kind, mode):
    spec = drafter_spec(kind, tiny_llama_dir, other_draft_dir)
    for k, streams, paging, areas in SWEEP:
        async with make_engine(tiny_llama, parallel=min(streams, 4), paging=paging, drafter=spec,
                               draft_tokens=k, draft_areas=areas) as eng:
            sizes = record_draft_sizes(eng)
            got = await run_all(eng, list(PROMPTS[:streams]), mode)
            assert got == plain[mode][:streams], (k, streams, paging)
            stats = await idle_stats(eng)
        assert max(sizes) <= k and (kind != "self" or max(sizes) == k), (sizes, k)
        assert stats["drafted_tokens"] > 0, (k, streams)
        if kind == "self":  # same kernels, same sampling: every draft is what the target emits
            assert stats["accepted_tokens"] == stats["drafted_tokens"]
        if areas == 1 and kind != "ngram":
            assert stats["draft_contexts_owned"] >= 1  # the fallback path ran


@pytest.mark.parametrize("kind", ["ngram", "other", "self"])
async def test_cancels_mid_draft_leave_others_equal_to_plain(tiny_llama, tiny_llama_dir,
                                                             other_draft_dir, plain, kind):
    spec = drafter_spec(kind, tiny_llama_dir, other_draft_dir)
    cancel_after = [None, 1, None, 5, 2, None, 9, None]
    async with make_engine(tiny_llama, parallel=3, step_tokens=5, drafter=spec,
                           draft_tokens=4) as eng:
        results = await run_with_cancels(eng, PROMPTS, lambda i: sampling("seeded", i),
                                         cancel_after, cancel_task=7)
        for i, got in enumerate(results):
            if cancel_after[i] is None and i != 7:
                assert got == plain["seeded"][i], i
        stats = await idle_stats(eng)
        assert stats["draft_area_bytes_in_use"] == 0


# ---- the default model (short: ~0.1 s per token per stream on this CPU) -------------------
QUOTE = ("Repeat the following text exactly: The river flows to the sea, and the sea returns "
         "the rain to the hills.")


async def test_drafted_equals_plain_on_default_model(default_checkpoint):
    prompts = [QUOTE, PROMPTS[0]]
    base = dict(device="cpu", parallel=2, ctx=256, step_tokens=64)
    results = {}
    for name, extra in (("plain", {}), ("ngram", dict(drafter="ngram", draft_tokens=4)),
                        ("self", dict(drafter=f"draft:{default_checkpoint.path}", draft_tokens=2))):
        async with Engine(default_checkpoint, **base, **extra) as eng:
            for mode in ("greedy", "seeded"):
                outs = await asyncio.gather(*(eng.complete(p, max_tokens=10, **_default_mode(mode, i))
                                              for i, p in enumerate(prompts)))
                results[name, mode] = [o.token_ids for o in outs]
            results[name, "stats"] = await idle_stats(eng)
    for mode in ("greedy", "seeded"):
        assert results["ngram", mode] == results["plain", mode]
        assert results["self", mode] == results["plain", mode]
    self_stats = results["self", "stats"]
    assert self_stats["drafted_tokens"] > 0
    assert self_stats["accepted_tokens"] == self_stats["drafted_tokens"]


def _default_mode(mode: str, index: int) -> dict:
    return {} if mode == "greedy" else {"temperature": 1.5, "top_p": 0.95, "seed": 77 + index}
