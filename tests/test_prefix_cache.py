"""Prefix cache (engine/prefix.py, pages.Runs): resumed == fresh, token for token.

A chat client sends the whole conversation every turn; the engine reuses the KV pages of the
prefix it has seen. Every test compares with the same request on an engine without the cache.
Allocator tests use tiny pools with exact page ids.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.engine_helpers import idle_stats, record_plans
from tf_async import BadInputError, Engine
from tf_async.engine.build import kv_identity
from tf_async.engine.pages import Runs
from tf_async.engine.prefix import next_key, root_key
from tf_async.engine.prefix_plan import PrefixPlanner
from tf_async.engine.sequence import RoundPlan

PAGE = 4
OPTIONS: dict[str, Any] = dict(device="cpu", parallel=4, ctx=256, page_size=PAGE, step_tokens=16)


def _tokens(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, num_tokens).tolist()


def _sampling(mode: str, index: int, max_tokens: int = 8) -> dict[str, Any]:
    if mode == "greedy":
        return {"max_tokens": max_tokens, "ignore_eos": True}
    return {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.9, "seed": 70 + index}


# ---- allocator: exact page ids ------------------------------------------------------------
def test_published_pages_outlive_their_run_and_are_shared_read_only() -> None:
    runs = Runs(paging=True, num_lanes=2, pages_per_lane=4, page_size=4, num_pages=6,
                prefix_cache=True)
    cache = runs.cache
    assert cache is not None
    runs.open(0)
    assert runs.reserve(0, 10) == [0, 1, 2]
    runs.publish(0, 0, b"k0", (1, 2, 3, 4), b"root")
    runs.publish(0, 1, b"k1", (5, 6, 7, 8), b"k0")
    assert runs.close(0) == [0, 1, 2]
    assert runs.pool.num_free == 4 and cache.num_idle == 2  # 0, 1 cached; 2 back to the pool
    assert runs.num_pages_in_use == 0 and runs.num_available == 6
    assert cache.lookup(b"k1", (5, 6, 7, 8)) == 1
    assert cache.lookup(b"k1", (5, 6, 7, 9)) is None  # a key whose tokens differ is a miss
    runs.open(1)
    runs.share(1, [0, 1])
    assert runs.pages(1) == [0, 1] and cache.num_idle == 0 and runs.num_available == 4
    assert runs.reserve(1, 12) == [3]  # the run grows on its own pages past the shared ones


def test_idle_cached_pages_are_evicted_least_recently_used_first() -> None:
    runs = Runs(paging=True, num_lanes=1, pages_per_lane=4, page_size=4, num_pages=4,
                prefix_cache=True)
    cache = runs.cache
    assert cache is not None
    runs.open(0)
    assert runs.reserve(0, 16) == [0, 1, 2, 3]
    for i in (2, 0, 3):
        runs.publish(0, i, bytes([i]), (i,), b"root")
    runs.close(0)  # idle last page first (a chain's head outlives its tail): 3, 2, 0
    runs.open(0)
    runs.share(0, [2])  # 2 is used again: no longer idle
    runs.close(0)  # idle order now 3, 0, 2
    runs.open(0)
    assert runs.reserve(0, 12) == [1, 3, 0]  # the free page first, then LRU evictions
    assert cache.num_evictions == 2 and cache.lookup(bytes([2]), (2,)) == 2
    assert cache.lookup(bytes([0]), (0,)) is None


def test_keys_chain_and_separate_salts_and_kv_settings(tiny_llama) -> None:
    root = root_key(b"model", None)
    assert root != root_key(b"model", "tenant-a") != root_key(b"model", "tenant-b")
    assert next_key(root, (1, 2)) != next_key(next_key(root, (9, 9)), (1, 2))
    identities = {kv_identity(tiny_llama, dtype, None) for dtype in ("f32", "bf16", "fp8")}
    assert len(identities) == 3
    scales = np.ones((2, 2), np.float32)
    assert kv_identity(tiny_llama, "fp8", scales) != kv_identity(tiny_llama, "fp8", 2 * scales)


# ---- resumed == fresh ---------------------------------------------------------------------
async def _chat(eng: Engine, turns: int, mode: str, seed: int = 0) -> list[tuple[list[int], int]]:
    """A chat of `turns` turns on token ids: each turn sends everything so far plus a new user
    part. Returns each turn's (output ids, cached prompt tokens)."""
    history = _tokens(seed, 23)
    out = []
    for turn in range(turns):
        prompt = history + _tokens(seed + 100 + turn, 5 + 3 * turn)
        done = await eng.complete(prompt, **_sampling(mode, turn))
        out.append((done.token_ids, done.usage.cached_tokens))
        history = prompt + done.token_ids
    return out


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("turns", [2, 5])
async def test_resumed_chat_equals_fresh(tiny_llama, mode, turns) -> None:
    """Turn k takes every row turn k-1 computed (its prompt and all but its last output
    token): full pages shared, the rows of its last partial page copied."""
    async with Engine(tiny_llama, **OPTIONS) as eng:
        resumed = await _chat_with_prompts(eng, turns, mode, 0, rewrite=False)
        stats = await idle_stats(eng)
    async with Engine(tiny_llama, **OPTIONS, prefix_cache=False) as eng:
        fresh = await _chat_with_prompts(eng, turns, mode, 0, rewrite=False)
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    assert resumed[0][1] == 0
    for k in range(1, turns):
        assert resumed[k][1] == resumed[k - 1][2] + len(resumed[k - 1][0]) - 1, resumed
    assert all(t[1] == 0 for t in fresh)
    assert stats["cached_pages"] > 0 and stats["prefix_cache_hit_pages"] > 0
    assert stats["prefix_cache_copied_rows"] > 0


async def _shared_prefix(eng: Engine, num_streams: int, mode: str) -> list[list[int]]:
    prefix = _tokens(1, 61)
    prompts = [prefix + _tokens(200 + i, 3 + i) for i in range(num_streams)]
    done = await asyncio.gather(*(eng.complete(p, **_sampling(mode, i))
                                  for i, p in enumerate(prompts)))
    return [d.token_ids for d in done]


@pytest.mark.parametrize("num_streams", [1, 2, 4, 8])
async def test_concurrent_streams_sharing_a_prefix_equal_fresh(tiny_llama, num_streams) -> None:
    for mode in ("greedy", "seeded"):
        async with Engine(tiny_llama, **{**OPTIONS, "parallel": 8}) as eng:
            shared = await _shared_prefix(eng, num_streams, mode)
            stats = await idle_stats(eng)
        async with Engine(tiny_llama, **{**OPTIONS, "parallel": 8}, prefix_cache=False) as eng:
            fresh = await _shared_prefix(eng, num_streams, mode)
        assert shared == fresh
        assert (stats["prefix_cache_hit_pages"] > 0) == (num_streams > 1)


async def test_eviction_under_pressure_never_changes_an_output(tiny_llama) -> None:
    options = {**OPTIONS, "parallel": 2, "ctx": 64, "kv_pages": 2 * 64 // PAGE}
    prompts = [_tokens(300 + i, 40) for i in range(6)] * 2  # the second pass hits or re-evicts

    async def run(eng: Engine) -> list[list[int]]:
        done = await asyncio.gather(*(eng.complete(p, **_sampling("greedy", i))
                                      for i, p in enumerate(prompts)))
        return [d.token_ids for d in done]

    async with Engine(tiny_llama, **options) as eng:
        cached = await run(eng)
        stats = await idle_stats(eng)
        preemptions = eng.parts.scheduler.num_preemptions
    async with Engine(tiny_llama, **options, prefix_cache=False) as eng:
        fresh = await run(eng)
        preemptions_fresh = eng.parts.scheduler.num_preemptions
    assert cached == fresh
    assert stats["prefix_cache_evictions"] > 0
    assert preemptions <= preemptions_fresh  # idle cached pages go before any running stream


async def test_a_cancel_mid_prompt_then_the_same_prompt_equals_fresh(tiny_llama) -> None:
    prompt = _tokens(5, 90)
    async with Engine(tiny_llama, **{**OPTIONS, "step_tokens": 8}) as eng:
        stream = eng.stream(prompt, **_sampling("greedy", 0))
        task = asyncio.create_task(stream.__anext__())
        for _ in range(200):  # until some of its prompt is computed (published pages)
            if eng.stats().get("cached_pages", 0) >= 4:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await idle_stats(eng)
        again = await eng.complete(prompt, **_sampling("greedy", 0))
    async with Engine(tiny_llama, **OPTIONS, prefix_cache=False) as eng:
        fresh = await eng.complete(prompt, **_sampling("greedy", 0))
    assert again.token_ids == fresh.token_ids
    assert again.usage.cached_tokens >= 4 * PAGE


async def test_resumed_equals_fresh_with_ngram_drafting(tiny_llama) -> None:
    drafted = dict(OPTIONS, drafter="ngram", draft_tokens=3)
    async with Engine(tiny_llama, **drafted) as eng:
        resumed = await _chat(eng, 3, "greedy", seed=9)
    async with Engine(tiny_llama, **OPTIONS, prefix_cache=False) as eng:
        fresh = await _chat(eng, 3, "greedy", seed=9)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in fresh]
    assert resumed[2][1] > 0


async def test_cache_salt_keeps_tenants_apart(tiny_llama) -> None:
    prompt = _tokens(8, 40)
    async with Engine(tiny_llama, **OPTIONS) as eng:
        await eng.complete(prompt, cache_salt="a", max_tokens=2)
        other = await eng.complete(prompt, cache_salt="b", max_tokens=2)
        same = await eng.complete(prompt, cache_salt="a", max_tokens=2)
        with pytest.raises(BadInputError, match="cache_salt"):
            eng.stream(prompt, cache_salt="")
    # all but the last prompt token: 9 full pages shared, 3 rows of the 10th copied
    assert other.usage.cached_tokens == 0 and same.usage.cached_tokens == 39


async def test_no_prefix_cache_without_paging(tiny_llama) -> None:
    async with Engine(tiny_llama, **OPTIONS, paging=False) as eng:
        first = await eng.complete(_tokens(2, 30), max_tokens=2)
        second = await eng.complete(_tokens(2, 30), max_tokens=2)
        assert "cached_pages" not in eng.stats()
    assert first.token_ids == second.token_ids and second.usage.cached_tokens == 0


# ---- no round writes a cached page (and a mutation that does is caught) ---------------------
def _writes_to_cached_pages(plans: list[tuple[RoundPlan, set[int]]]) -> list[tuple[int, int]]:
    """(lane, page) pairs where a round wrote KV rows into a page cached before the round."""
    bad = []
    for plan, cached in plans:
        for rows in plan.rows:
            table = plan.block_tables[rows.lane]
            written = {table[pos // PAGE] for pos in range(rows.start_pos,
                                                           rows.start_pos + len(rows.token_ids))}
            bad += [(rows.lane, page) for page in written & cached]
    return bad


async def _plans_of_a_shared_chat(eng: Engine) -> list[tuple[RoundPlan, set[int]]]:
    seen: list[tuple[RoundPlan, set[int]]] = []
    plans = record_plans(eng)
    cache = eng.parts.scheduler.runs.cache
    schedule = eng.parts.scheduler.schedule

    def spy() -> RoundPlan:
        plan = schedule()
        seen.append((plan, {p for p in range(eng.parts.scheduler.runs.num_pages_total)
                            if cache.is_cached(p)}))
        return plan

    eng.parts.scheduler.schedule = spy  # type: ignore[method-assign]
    await asyncio.gather(_chat(eng, 3, "greedy"), _shared_prefix(eng, 4, "greedy"))
    assert plans
    return seen


async def test_no_round_writes_a_cached_page(tiny_llama) -> None:
    async with Engine(tiny_llama, **OPTIONS) as eng:
        assert _writes_to_cached_pages(await _plans_of_a_shared_chat(eng)) == []


async def test_every_page_a_lane_gains_is_zeroed_unless_it_was_cached(tiny_llama) -> None:
    async with Engine(tiny_llama, **OPTIONS) as eng:
        seen = await _plans_of_a_shared_chat(eng)
    held: dict[int, set[int]] = {}
    shared = 0
    for plan, cached in seen:
        for lane, pages in plan.block_tables.items():
            gained = set(pages) - held.get(lane, set())
            assert gained <= set(plan.pages_to_zero) | cached, (lane, gained, plan.pages_to_zero)
            assert not set(plan.pages_to_zero) & cached  # a cached page is never zeroed
            shared += len(gained & cached)
            held[lane] = set(pages)
    assert shared > 0


async def test_publishing_a_page_before_it_is_full_is_caught(tiny_llama, monkeypatch) -> None:
    def publish_too_early(self: PrefixPlanner, seq: Any) -> None:  # a partial page offered as full
        if self.runs.cache is None or seq.lane is None:
            return
        upto = -(-seq.num_computed // PAGE)
        for i in range(seq.num_published, min(upto, len(self.runs.pages(seq.lane)))):
            self.runs.publish(seq.lane, i, self.page_key(seq, i), self._page_tokens(seq, i),
                              self._prev_key(seq, i))
        seq.num_published = max(seq.num_published, upto)

    monkeypatch.setattr(PrefixPlanner, "publish_pages", publish_too_early)
    async with Engine(tiny_llama, **OPTIONS) as eng:
        assert _writes_to_cached_pages(await _plans_of_a_shared_chat(eng)) != []


async def test_a_stream_that_ends_at_its_first_token_leaves_its_prompt_cached(tiny_llama) -> None:
    prompt = _tokens(4, 23)
    async with Engine(tiny_llama, **OPTIONS) as eng:
        await eng.complete(prompt, max_tokens=1)  # finishes in the round of its one prompt step
        again = await eng.complete(prompt, max_tokens=1)
    assert again.usage.cached_tokens == 22  # 5 pages shared, 2 rows of the partial one copied


# ---- hybrids: resume from a recurrent state kept at a page boundary -------------------------
@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.baseline_models import TINY_MODELS
    from tf_async.models.loader import load_checkpoint

    return {name: load_checkpoint(TINY_MODELS[name](tmp_path_factory.mktemp(name)))
            for name in ("qwen3_5-mlx4", "qwen3_5_moe-bf16")}


@pytest.mark.parametrize("name", ["qwen3_5-mlx4", "qwen3_5_moe-bf16"])
@pytest.mark.parametrize("drafter", [None, "ngram"])
async def test_hybrid_resumed_chat_equals_fresh(hybrids, name, drafter) -> None:
    options = {**OPTIONS, "drafter": drafter, "draft_tokens": 3}
    for mode in ("greedy", "seeded"):
        async with Engine(hybrids[name], **options) as eng:
            resumed = await _chat(eng, 3, mode, seed=4)
            stats = await idle_stats(eng)
        async with Engine(hybrids[name], **OPTIONS, prefix_cache=False) as eng:
            fresh = await _chat(eng, 3, mode, seed=4)
        assert [ids for ids, _ in resumed] == [ids for ids, _ in fresh]
        assert all(cached > 0 for _, cached in resumed[1:]), resumed
        assert stats["prefix_states_resumed"] >= 2 and stats["prefix_state_bytes"] > 0


async def test_hybrid_streams_sharing_a_prefix_equal_fresh(hybrids) -> None:
    ckpt = hybrids["qwen3_5-mlx4"]

    async def twice(eng: Engine) -> list[list[int]]:  # the second wave resumes the first's
        return await _shared_prefix(eng, 4, "seeded") + await _shared_prefix(eng, 4, "seeded")

    async with Engine(ckpt, **{**OPTIONS, "parallel": 4}) as eng:
        shared = await twice(eng)
        stats = await idle_stats(eng)
    async with Engine(ckpt, **{**OPTIONS, "parallel": 4}, prefix_cache=False) as eng:
        fresh = await twice(eng)
    assert shared == fresh and stats["prefix_states_resumed"] > 0


async def test_a_resumed_hybrid_lane_starts_from_the_kept_state_not_zero(hybrids, monkeypatch) -> None:
    """Mutation: resuming a lane from zero state instead of its kept state changes outputs."""
    from tf_async.models.qwen35 import RecurrentStates

    async with Engine(hybrids["qwen3_5-mlx4"], **OPTIONS, prefix_cache=False) as eng:
        fresh = await _chat(eng, 3, "greedy", seed=6)
    monkeypatch.setattr(RecurrentStates, "resume", lambda self, slot, lane: self.zero(lane))
    async with Engine(hybrids["qwen3_5-mlx4"], **OPTIONS) as eng:
        broken = await _chat(eng, 3, "greedy", seed=6)
    assert [ids for ids, _ in broken] != [ids for ids, _ in fresh]


def test_serve_turns_the_cache_off_with_no_prefix_cache() -> None:
    from tf_async.cli import _parser
    from tf_async.server.cli import engine_from_args

    for argv, want in (([], True), (["--no-prefix-cache"], False)):
        assert engine_from_args(_parser().parse_args(["serve", *argv])).options.prefix_cache is want


async def test_a_preempted_stream_resumes_from_its_own_cached_pages(tiny_llama) -> None:  # noqa: ANN001
    """Out of pages mid-stream: the preempted stream's committed pages stay cached, and its
    re-admission takes them back instead of recomputing (same outputs as without the cache)."""
    options = dict(device="cpu", parallel=3, ctx=96, page_size=PAGE, kv_pages=24, step_tokens=16)
    prompts = [_tokens(400 + i, 9) for i in range(6)]

    async def run(eng: Engine) -> list[list[int]]:
        done = await asyncio.gather(*(eng.complete(p, **_sampling("seeded", i, 30))
                                      for i, p in enumerate(prompts)))
        return [d.token_ids for d in done]

    async with Engine(tiny_llama, **options) as eng:
        cached = await run(eng)
        stats = await idle_stats(eng)
    async with Engine(tiny_llama, **options, prefix_cache=False) as eng:
        fresh = await run(eng)
    assert cached == fresh
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_pages"] > 0


# ---- hybrids: states every N pages, at each prompt's end, and at a stream's latest boundary --
async def _chat_with_prompts(eng: Engine, turns: int, mode: str, seed: int, rewrite: bool
                             ) -> list[tuple[list[int], int, int]]:
    """As _chat; each turn's (output ids, cached prompt tokens, prompt length). `rewrite`: the
    client sends each reply back changed (as chat templates that drop a reply's reasoning do),
    so the next prompt shares only the previous prompt."""
    history = _tokens(seed, 23)
    out = []
    for turn in range(turns):
        prompt = history + _tokens(seed + 100 + turn, 5 + 3 * turn)
        done = await eng.complete(prompt, **_sampling(mode, turn))
        out.append((done.token_ids, done.usage.cached_tokens, len(prompt)))
        reply = [(t + 1) % 300 for t in done.token_ids] if rewrite else done.token_ids
        history = prompt + reply
    return out


@pytest.mark.parametrize("rewrite", [False, True])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_a_five_turn_hybrid_chat_resumes_past_the_first_prompt(hybrids, mode, rewrite) -> None:
    """Turn k resumes at least from the last page boundary of turn k-1's prompt (a state is
    kept there; the prompt's cuts stop there), so from turn 3 on more than turn 1's whole
    prompt is reused; with replies sent back verbatim, also from the newest boundary the
    reply's decoding reached. Outputs equal a fresh engine's."""
    ckpt = hybrids["qwen3_5-mlx4"]
    async with Engine(ckpt, **OPTIONS) as eng:
        resumed = await _chat_with_prompts(eng, 5, mode, 12, rewrite)
        stats = await idle_stats(eng)
    async with Engine(ckpt, **OPTIONS, prefix_cache=False) as eng:
        fresh = await _chat_with_prompts(eng, 5, mode, 12, rewrite)
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    for k in range(1, 5):
        previous_prompt = resumed[k - 1][2] // PAGE * PAGE
        if rewrite:
            assert resumed[k][1] == previous_prompt, resumed
        else:
            assert resumed[k][1] > previous_prompt, resumed
    assert all(t[1] > resumed[0][2] for t in resumed[2:]), resumed
    assert stats["prefix_states_resumed"] >= 4


async def test_a_hybrid_stream_resumes_from_the_last_n_page_state_of_a_shared_prefix(hybrids) -> None:
    """States every 2 pages: a stream sharing 27 tokens with an earlier prompt of 40 resumes
    at 24 (the cuts of 16 rows stop at every 8th row), not at 16."""
    ckpt = hybrids["qwen3_5-mlx4"]
    first = _tokens(20, 40)
    second = first[:27] + _tokens(21, 9)
    options = {**OPTIONS, "prefix_state_pages": 2}

    async def run(eng: Engine) -> list[tuple[list[int], int]]:
        out = []
        for prompt in (first, second):
            done = await eng.complete(prompt, **_sampling("greedy", 0))
            out.append((done.token_ids, done.usage.cached_tokens))
        return out

    async with Engine(ckpt, **options) as eng:
        resumed = await run(eng)
        await idle_stats(eng)
    async with Engine(ckpt, **options, prefix_cache=False) as eng:
        fresh = await run(eng)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in fresh]
    assert resumed[1][1] == 24


async def test_hybrid_streams_resume_mid_prompt_from_a_state_another_stream_kept(hybrids) -> None:
    """Two streams with one long prefix admitted together, states every 8 rows, 12-row budget:
    the first's cuts stop at each state (8 rows), the second's first cut takes the other 4 rows
    (nothing is cached yet); from then on the second resumes mid-prompt from the states and
    pages the first keeps. Outputs equal a fresh engine's."""
    ckpt = hybrids["qwen3_5-mlx4"]
    prefix = _tokens(30, 70)
    prompts = [prefix + _tokens(31 + i, 6) for i in range(2)]
    options = {**OPTIONS, "prefix_state_pages": 2, "step_tokens": 12}

    async def run(eng: Engine) -> list[tuple[list[int], int]]:
        done = await asyncio.gather(*(eng.complete(p, **_sampling("seeded", i))
                                      for i, p in enumerate(prompts)))
        return [(d.token_ids, d.usage.cached_tokens) for d in done]

    async with Engine(ckpt, **options) as eng:
        resumed = await run(eng)
        stats = await idle_stats(eng)
    async with Engine(ckpt, **options, prefix_cache=False) as eng:
        fresh = await run(eng)
    assert [ids for ids, _ in resumed] == [ids for ids, _ in fresh]
    assert resumed[0][1] == 0 and resumed[1][1] >= 24, resumed  # 4 of every 8 rows: not computed
    assert stats["prefix_states_resumed"] > 0


# ---- dense models: the partial last page of a shared prefix is copied, not recomputed -------
async def test_a_chat_whose_replies_come_back_rewritten_copies_up_to_the_change(tiny_llama) -> None:
    async with Engine(tiny_llama, **OPTIONS) as eng:
        resumed = await _chat_with_prompts(eng, 4, "seeded", 7, rewrite=True)
        await idle_stats(eng)
    async with Engine(tiny_llama, **OPTIONS, prefix_cache=False) as eng:
        fresh = await _chat_with_prompts(eng, 4, "seeded", 7, rewrite=True)
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    assert [t[1] for t in resumed[1:]] == [t[2] for t in resumed[:-1]]  # the previous prompt


async def test_rows_not_copied_are_caught(tiny_llama, monkeypatch) -> None:
    """Mutation: a plan's page copies skipped (the rows stay zero) changes outputs."""
    from tf_async.engine.runner import Runner

    async with Engine(tiny_llama, **OPTIONS, prefix_cache=False) as eng:
        fresh = await _chat_with_prompts(eng, 4, "greedy", 8, rewrite=False)
    monkeypatch.setattr(Runner, "copy_rows", lambda self, copies: None)
    async with Engine(tiny_llama, **OPTIONS) as eng:
        broken = await _chat_with_prompts(eng, 4, "greedy", 8, rewrite=False)
    assert [t[0] for t in broken] != [t[0] for t in fresh]


async def test_copies_read_cached_pages_and_write_new_zeroed_pages_only(tiny_llama) -> None:
    """Each copy's source is cached and not zeroed in its round; its target is a page the run
    gains that round (zeroed first), never a cached one."""
    async with Engine(tiny_llama, **OPTIONS) as eng:
        seen = await _plans_of_a_shared_chat(eng)
    copies = 0
    for plan, cached in seen:
        for source, page, num_rows in plan.page_copies:
            assert source in cached and source not in plan.pages_to_zero
            assert page in plan.pages_to_zero and page not in cached
            assert 0 < num_rows < PAGE
            copies += 1
    assert copies > 0


@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_a_hybrid_stream_stopped_inside_a_round_keeps_no_state_past_its_end(
        hybrids, decode_steps) -> None:
    """A stop token at decode step 2 of 4: the lane's state has also taken the steps after it,
    so the finish must not keep it as the state of the stream's end (a page boundary in these
    cases; a stop inside accepted drafts takes the same path). Turn 2 equals a fresh engine's."""
    ckpt = hybrids["qwen3_5-mlx4"]
    options = {**OPTIONS, "parallel": 2, "decode_steps": decode_steps}

    async def chat(eng: Engine, prompt: list[int], stop: int) -> list[list[int]]:
        first = await eng.complete(prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
        second = await eng.complete(prompt + first.token_ids + _tokens(99, 7), max_tokens=8,
                                    ignore_eos=True)
        return [first.token_ids, second.token_ids]

    for length, stop_at in ((22, 2), (22, 6), (23, 1), (23, 5)):
        prompt = _tokens(length, length)
        async with Engine(ckpt, **options, prefix_cache=False) as eng:
            plain = (await eng.complete(prompt, max_tokens=12, ignore_eos=True)).token_ids
            fresh = await chat(eng, prompt, plain[stop_at])
        async with Engine(ckpt, **options) as eng:
            resumed = await chat(eng, prompt, plain[stop_at])
        assert resumed == fresh, (length, stop_at)
