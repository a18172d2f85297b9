"""The Python API releases a stream at once when its caller stops reading: leaving an
`async with engine.stream(...)` block (after a `break`) or awaiting `aclose()` returns only
after the engine has given the lane and its pages back, so stats read right after show
0 lanes, 0 running, 0 pages."""

from __future__ import annotations

import pytest

from tf_async import Engine
from tf_async.gate import PROMPTS

pytestmark = pytest.mark.asyncio


def engine(ckpt, **kw) -> Engine:
    return Engine(ckpt, device="cpu", parallel=2, ctx=256, page_size=4, step_tokens=32, **kw)


def released(stats: dict[str, object]) -> bool:
    return (stats["lanes_in_use"], stats["running"], stats["pages_in_use"], stats["queued"]) \
        == (0, 0, 0, 0)


async def test_break_inside_async_with_releases_the_lane_before_the_block_ends(tiny_llama):
    async with engine(tiny_llama) as eng:
        async with eng.stream(PROMPTS[0], max_tokens=200, ignore_eos=True) as deltas:
            async for delta in deltas:
                if delta.token_ids:
                    assert eng.stats()["lanes_in_use"] == 1
                    break
        assert released(eng.stats()), eng.stats()


async def test_chat_stream_is_an_async_context_manager_too(tiny_llama):
    async with engine(tiny_llama) as eng:
        messages = [{"role": "user", "content": "hi"}]
        async with eng.chat(messages, max_tokens=200, ignore_eos=True) as deltas:
            async for _ in deltas:
                break
        assert released(eng.stats()), eng.stats()


async def test_aclose_after_break_waits_for_the_release(tiny_llama):
    async with engine(tiny_llama) as eng:
        deltas = eng.stream(PROMPTS[1], max_tokens=200, ignore_eos=True)
        async for _ in deltas:
            break
        await deltas.aclose()
        assert released(eng.stats()), eng.stats()
        await deltas.aclose()  # twice is a no-op
        with pytest.raises(StopAsyncIteration):
            await deltas.__anext__()


async def test_aclose_of_a_finished_or_unstarted_stream_returns_at_once(tiny_llama):
    async with engine(tiny_llama) as eng:
        never_started = eng.stream(PROMPTS[2], max_tokens=4)
        await never_started.aclose()
        async with eng.stream(PROMPTS[2], max_tokens=4) as deltas:
            texts = [d.text async for d in deltas]
        assert texts and released(eng.stats())


async def test_aclose_of_a_queued_stream_releases_it_and_the_others_go_on(tiny_llama):
    async with engine(tiny_llama) as eng:
        whole = await eng.complete(PROMPTS[3], max_tokens=6)
        running = [eng.stream(p, max_tokens=200, ignore_eos=True) for p in PROMPTS[:2]]
        for s in running:
            await s.__anext__()
        queued = eng.stream(PROMPTS[2], max_tokens=4)
        other = eng.stream(PROMPTS[3], max_tokens=6)
        await queued.aclose()  # never submitted: nothing to wait for
        for s in running:
            await s.aclose()
        assert released(eng.stats()), eng.stats()
        assert (await _collect_ids(other)) == whole.token_ids


async def _collect_ids(stream) -> list[int]:
    ids: list[int] = []
    async with stream:
        async for delta in stream:
            ids += delta.token_ids
    return ids


async def test_a_stop_string_ends_the_request_in_the_engine_too(tiny_llama):
    async with engine(tiny_llama) as eng:
        whole = await eng.complete(PROMPTS[0], max_tokens=40, ignore_eos=True)
        stop = whole.text[len(whole.text) // 3:][:2]
        assert stop
        async with eng.stream(PROMPTS[0], max_tokens=200, ignore_eos=True, stop=stop) as deltas:
            last = [d async for d in deltas][-1]
        assert last.finish_reason == "stop" and last.usage.completion_tokens < 200
        assert released(eng.stats()), eng.stats()
