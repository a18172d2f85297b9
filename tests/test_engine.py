"""Engine lifecycle on a tiny model: gates, cancel, failures, preemption, queueing, sampling."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.engine_helpers import idle_stats, run_with_cancels
from tf_async import BadInputError, Engine, QueueFullError, RequestFailedError
from tf_async.gate import PROMPTS, generate, run_gates, sampling

pytestmark = pytest.mark.asyncio


def engine(ckpt, **kw) -> Engine:
    opts = dict(device="cpu", parallel=4, ctx=256, page_size=4, step_tokens=32)
    opts.update(kw)
    return Engine(ckpt, **opts)


async def test_all_gates_pass_on_tiny_model(tiny_llama):
    rows, idle = await run_gates(tiny_llama, device="cpu", max_tokens=12, ctx=256)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert len(rows) == 2 * (4 + 1 + 3 + 1 + 1) + 1
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())


async def solo_outputs(ckpt, mode: str, max_tokens: int) -> list[list[int]]:
    async with engine(ckpt, parallel=1, step_tokens=512) as eng:
        return await generate(eng, list(PROMPTS), mode, max_tokens, concurrent=False)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_cancels_at_random_points_leave_others_intact_and_idle_empty(tiny_llama, mode):
    solo = await solo_outputs(tiny_llama, mode, 20)
    rng = random.Random(7)
    async with engine(tiny_llama, parallel=3, step_tokens=5) as eng:
        plan = [rng.choice([None, 0, 1, 3, 8]) for _ in PROMPTS]
        results = await run_with_cancels(eng, PROMPTS, lambda i: sampling(mode, i, 20), plan,
                                         cancel_task=5)
        for i, (cancel_after, got) in enumerate(zip(plan, results, strict=True)):
            if i == 5 or cancel_after is not None:
                continue
            assert got == solo[i], i
        stats = await idle_stats(eng)
        assert stats["pages_in_use"] == 0 and stats["lanes_in_use"] == 0


async def test_failed_step_fails_only_that_request(tiny_llama):
    solo = await solo_outputs(tiny_llama, "greedy", 10)
    async with engine(tiny_llama) as eng:
        bad_ids = eng.tokenizer.encode(PROMPTS[2])

        def inject(rows):
            if rows.token_ids[:3] == tuple(bad_ids[:3]) and rows.start_pos == 0:
                raise RuntimeError("injected fault")

        eng.parts.runner.fault_injector = inject
        outs = await asyncio.gather(*(eng.complete(p, max_tokens=10) for p in PROMPTS[:4]),
                                    return_exceptions=True)
        assert isinstance(outs[2], RequestFailedError) and "injected fault" in str(outs[2])
        assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [solo[i] for i in (0, 1, 3)]
        stats = await idle_stats(eng)
        assert stats["pages_in_use"] == 0 and stats["lanes_in_use"] == 0
        eng.parts.runner.fault_injector = None
        assert (await eng.complete(PROMPTS[2], max_tokens=10)).token_ids == solo[2]


async def test_out_of_pages_preempts_and_recomputes_without_changing_tokens(tiny_llama):
    solo = await solo_outputs(tiny_llama, "greedy", 40)
    # 4 lanes but pages for barely more than one full stream: forces preemption
    async with engine(tiny_llama, parallel=4, ctx=128, kv_pages=34, step_tokens=8) as eng:
        outs = await asyncio.gather(*(eng.complete(p, max_tokens=40) for p in PROMPTS))
        assert [o.token_ids for o in outs] == solo
        assert eng.parts.scheduler.num_preemptions > 0
        stats = await idle_stats(eng)
        assert stats["pages_in_use"] == 0
        assert stats["preemptions"] == eng.parts.scheduler.num_preemptions


async def test_preemptions_are_a_counter_in_metrics():
    from tf_async.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"preemptions": 3, "lanes_in_use": 0,
                                  "draft_paused_rounds": 5}).render().decode()
    assert "# TYPE tf_preemptions_total counter" in text
    assert "tf_preemptions_total 3.0" in text
    assert "tf_draft_paused_rounds_total 5.0" in text


async def test_queue_is_fcfs_bounded_and_refuses_what_never_fits(tiny_llama):
    async with engine(tiny_llama, parallel=1, max_queue=2, ctx=64) as eng:
        with pytest.raises(BadInputError) as err:
            await eng.complete("hello", max_tokens=64)
        assert err.value.param == "max_tokens"
        streams = [eng.stream(p, max_tokens=40, ignore_eos=True) for p in PROMPTS[:3]]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]  # each submits at once
        assert (await firsts[0]).token_ids  # 1 running + 2 queued (the engine holds all 3)
        with pytest.raises(QueueFullError):
            await eng.complete("x", max_tokens=2)
        for first, s in zip(firsts, streams, strict=True):
            first.cancel()
            await s.aclose()
        await idle_stats(eng)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0),
                                 dict(top_k=-2), dict(min_p=2.0), dict(logprobs=99), dict(nope=1)])
async def test_bad_sampling_arguments_are_clear_errors(tiny_llama, bad):
    async with engine(tiny_llama) as eng:
        with pytest.raises(BadInputError):
            await eng.complete("hi", **bad)
        with pytest.raises(BadInputError):
            await eng.complete([eng.parts.vocab_size + 5], max_tokens=2)
        with pytest.raises(BadInputError):
            await eng.complete("", max_tokens=2)


async def test_stop_strings_never_emitted_and_logprobs_include_chosen(tiny_llama):
    async with engine(tiny_llama) as eng:
        greedy = await eng.complete(PROMPTS[3], max_tokens=30, logprobs=3)
        assert greedy.finish_reason == "length" and len(greedy.token_ids) == 30
        assert len(greedy.logprobs) == 30
        for tok, lp in zip(greedy.token_ids, greedy.logprobs, strict=True):
            assert tok in lp and len(lp) >= 3 and all(v <= 0.0 for v in lp.values())
            assert lp[tok] == max(lp.values())  # greedy picks the top log-prob
        kw = dict(max_tokens=40, temperature=8.0, seed=5)
        full = await eng.complete(PROMPTS[3], **kw)
        at = next(p for p in range(4, len(full.text) - 2) if full.text.find(full.text[p:p + 2]) == p)
        stop = full.text[at:at + 2]
        for stops in ([stop], ["never-there", stop]):
            cut = await eng.complete(PROMPTS[3], **kw, stop=stops)
            assert cut.finish_reason == "stop" and cut.text == full.text[:at], (stop, cut.text)
        stop_id = full.token_ids[4]
        by_id = await eng.complete(PROMPTS[3], **kw, stop_token_ids=[stop_id])
        assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == stop_id
        assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


async def test_seeded_sampling_is_reproducible_and_penalties_change_output(tiny_llama):
    async with engine(tiny_llama) as eng:
        kw = dict(max_tokens=20, temperature=8.0, top_k=50, top_p=0.9, min_p=0.01, seed=42)
        a = await eng.complete(PROMPTS[1], **kw)
        b = await eng.complete(PROMPTS[1], **kw)
        c = await eng.complete(PROMPTS[1], **{**kw, "seed": 43})
        assert a.token_ids == b.token_ids != c.token_ids
        greedy = await eng.complete(PROMPTS[6], max_tokens=30)
        pen = await eng.complete(PROMPTS[6], max_tokens=30, repetition_penalty=1.5,
                                 presence_penalty=1.0, frequency_penalty=1.0)
        assert pen.token_ids != greedy.token_ids
        assert len(set(pen.token_ids)) >= len(set(greedy.token_ids))


async def test_stream_deltas_concatenate_to_complete_and_stats_shape(tiny_llama):
    async with engine(tiny_llama) as eng:
        whole = await eng.complete(PROMPTS[0], max_tokens=16)
        text, ids, last = "", [], None
        async for d in eng.stream(PROMPTS[0], max_tokens=16):
            text += d.text
            ids += d.token_ids
            last = d
        assert (text, ids) == (whole.text, whole.token_ids)
        assert last.finish_reason == whole.finish_reason and last.usage.completion_tokens == len(ids)
        chat = await eng.chat_complete([{"role": "user", "content": "hi"}], max_tokens=5)
        assert chat.usage.prompt_tokens > 2
        stats = eng.stats()
        for key in ("lanes_in_use", "pages_in_use", "pages_total", "queued", "running"):
            assert key in stats
        assert len(eng.lanes()) == 4


async def test_waiting_requests_are_admitted_first_come_first_served(tiny_llama):
    async with engine(tiny_llama, parallel=1) as eng:
        order: list[int] = []

        async def one(i: int) -> None:
            async for delta in eng.stream(PROMPTS[i], max_tokens=3):
                if delta.token_ids and i not in order:
                    order.append(i)

        # submitted in the order 3, 0, 2, 1 (each stream submits on its first __anext__)
        tasks = []
        for i in (3, 0, 2, 1):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == [3, 0, 2, 1]
        await idle_stats(eng)
