"""Decode steps (--decode-steps N): a round of plain decode rows runs up to N forwards in a row,
each step's token fed from the step before where it was chosen. The outputs equal one step a
round, token for token (greedy and seeded, alone and concurrent, stopping mid-round, queued,
paged tight), and nothing is left in use; rounds that cannot step (logprobs, drafter) run one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.engine_helpers import record_plans
from tf_async import BadInputError, Engine
from tf_async.engine.sequence import RoundPlan

PROMPTS = [[5, 9, 33, 2], [7, 7, 40, 12, 3], [100, 3], [61, 62, 63, 64, 65, 66]]


async def _run(ckpt: Any, steps: int, kwargs: list[dict[str, Any]], **engine: Any,
               ) -> tuple[list[tuple[int, ...]], list[str | None], list[RoundPlan], dict]:
    # no prefix cache: a re-admitted stream's table would gain its cached pages unzeroed
    # (test_prefix_cache.py checks that case)
    options = {**dict(device="cpu", parallel=4, ctx=96, page_size=4, decode_steps=steps,
                      prefix_cache=False), **engine}
    async with Engine(ckpt, **options) as eng:
        plans = record_plans(eng)
        done = await asyncio.gather(*(eng.complete(PROMPTS[i % len(PROMPTS)], **kw)
                                      for i, kw in enumerate(kwargs)))
        idle = {**eng.parts.core.snapshot, "preemptions": eng.parts.scheduler.num_preemptions}
    _assert_new_pages_zeroed(plans)
    return [tuple(d.token_ids) for d in done], [d.finish_reason for d in done], plans, idle


def _assert_new_pages_zeroed(plans: list[RoundPlan]) -> None:
    """Every page a lane's table gains in a round (a stepped round reserves every step's
    pages) is zeroed in that round, before the forward writes into it."""
    held: dict[int, set[int]] = {}
    for plan in plans:
        for lane, pages in plan.block_tables.items():
            gained = set(pages) - held.get(lane, set())
            assert gained <= set(plan.pages_to_zero), (lane, gained, plan.pages_to_zero)
            held[lane] = set(pages)


MIXED = [dict(max_tokens=13, ignore_eos=True), dict(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True),
         dict(max_tokens=11, temperature=1.1, top_k=20, top_p=0.9, seed=9, ignore_eos=True),
         dict(max_tokens=6, ignore_eos=True)]


@pytest.mark.asyncio
@pytest.mark.parametrize("steps", [2, 4, 7])
async def test_decode_steps_equal_one_step_a_round(tiny_llama, steps: int) -> None:
    plain, reasons, plain_plans, _ = await _run(tiny_llama, 1, MIXED)
    stepped, stepped_reasons, plans, idle = await _run(tiny_llama, steps, MIXED)
    assert stepped == plain and stepped_reasons == reasons
    assert [len(t) for t in plain] == [13, 9, 11, 6]
    assert max(p.steps for p in plans) == min(steps, 5)  # capped: the shortest stream has 5 left
    assert len(plans) < len(plain_plans) and all(p.steps == 1 for p in plain_plans)
    assert idle["pages_in_use"] == 0 and idle["lanes_in_use"] == 0


@pytest.mark.asyncio
async def test_a_stream_that_stops_inside_a_round_keeps_no_later_token(tiny_llama) -> None:
    free, _, _, _ = await _run(tiny_llama, 1, [dict(max_tokens=20, ignore_eos=True)])
    stop = free[0][5]  # a token the stream produces mid-way: stopping on it ends a step early
    first = free[0].index(stop)
    kwargs = [dict(max_tokens=20, ignore_eos=True, stop_token_ids=[stop]),
              dict(max_tokens=20, ignore_eos=True)]
    plain, reasons, _, _ = await _run(tiny_llama, 1, kwargs)
    stepped, stepped_reasons, plans, idle = await _run(tiny_llama, 8, kwargs)
    assert stepped == plain and stepped_reasons == reasons == ["stop", "length"]
    assert stepped[0][-1] == stop and len(stepped[0]) == first + 1
    assert any(p.steps == 8 for p in plans)
    assert idle["pages_in_use"] == 0 and idle["lanes_in_use"] == 0


@pytest.mark.asyncio
async def test_decode_steps_with_queued_streams_and_a_tight_page_pool(tiny_llama) -> None:
    kwargs = [dict(max_tokens=30, ignore_eos=True, temperature=0.7, seed=i) for i in range(6)]
    tight = dict(parallel=3, kv_pages=24)  # 6 streams queue for 3 lanes; pages run out: preemption
    plain, _, _, _ = await _run(tiny_llama, 1, kwargs, **tight)
    stepped, _, plans, idle = await _run(tiny_llama, 5, kwargs, **tight)
    assert stepped == plain and idle["preemptions"] > 0
    assert any(p.steps == 5 for p in plans)
    assert idle["pages_in_use"] == 0 and idle["lanes_in_use"] == 0


@pytest.mark.asyncio
async def test_rounds_that_cannot_step_run_one_step(tiny_llama) -> None:
    # logprobs are read on the host at every token: while that stream runs, rounds take one step
    kwargs = [dict(max_tokens=12, ignore_eos=True), dict(max_tokens=5, ignore_eos=True, logprobs=2)]
    plain, _, _, _ = await _run(tiny_llama, 1, kwargs)
    stepped, _, plans, _ = await _run(tiny_llama, 4, kwargs)
    assert stepped == plain
    decode = [p for p in plans if all(len(r.token_ids) == 1 for r in p.rows)]
    assert all(p.steps == 1 for p in decode if len(p.rows) == 2)
    assert any(p.steps == 4 for p in decode if len(p.rows) == 1)
    # a drafter verifies several rows a round: no decode steps at all
    drafted, _, plans, _ = await _run(tiny_llama, 4, kwargs[:1], drafter="ngram")
    assert drafted == plain[:1] and all(p.steps == 1 for p in plans)


@pytest.mark.asyncio
async def test_cancel_between_stepped_rounds_releases_everything(tiny_llama) -> None:
    async with Engine(tiny_llama, device="cpu", parallel=2, ctx=96, page_size=4, decode_steps=4) as eng:
        stream = eng.stream(PROMPTS[0], max_tokens=80, ignore_eos=True)
        other = asyncio.ensure_future(eng.complete(PROMPTS[1], max_tokens=20, ignore_eos=True))
        seen = 0
        async for delta in stream:
            seen += len(delta.token_ids)
            if seen >= 8:
                break
        await stream.aclose()
        assert len((await other).token_ids) == 20
        for _ in range(200):
            if eng.parts.core.snapshot["lanes_in_use"] == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.parts.core.snapshot["lanes_in_use"] == 0
        assert eng.parts.core.snapshot["pages_in_use"] == 0


@pytest.mark.parametrize("bad", [0, 65, 2.0, True])
def test_bad_decode_steps_is_a_clear_error(tiny_llama, bad: Any) -> None:
    with pytest.raises(BadInputError, match="decode_steps"):
        Engine(tiny_llama, device="cpu", decode_steps=bad)


@pytest.mark.asyncio
async def test_a_failed_stepped_round_fails_only_that_request(tiny_llama) -> None:
    from tf_async import RequestFailedError

    kwargs = [dict(max_tokens=16, ignore_eos=True), dict(max_tokens=16, ignore_eos=True, seed=3, temperature=0.9)]
    plain, _, _, _ = await _run(tiny_llama, 1, kwargs)
    async with Engine(tiny_llama, device="cpu", parallel=4, ctx=96, page_size=4, decode_steps=4) as eng:
        plans = record_plans(eng)

        def inject(rows) -> None:  # the first request (id 1) fails mid-stream
            if rows.request_id == 1 and rows.start_pos >= len(PROMPTS[0]) + 5:
                raise RuntimeError("injected fault")

        eng.parts.runner.fault_injector = inject
        bad = asyncio.ensure_future(eng.complete(PROMPTS[0], **kwargs[0]))
        await asyncio.sleep(0)
        good = await eng.complete(PROMPTS[1], **kwargs[1])
        with pytest.raises(RequestFailedError, match="injected fault"):
            await bad
        assert tuple(good.token_ids) == plain[1]
        assert any(p.steps > 1 for p in plans)
        for _ in range(200):
            if eng.parts.core.snapshot["lanes_in_use"] == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.parts.core.snapshot["lanes_in_use"] == 0 and eng.parts.core.snapshot["pages_in_use"] == 0


@pytest.mark.asyncio
async def test_decode_steps_with_a_device_sampler(tiny_llama, monkeypatch) -> None:
    """On ops that choose tokens where the logits are (the CPU stand-in of the GPU's sampler):
    the steps feed each chosen id on the 'device', upload the seeded rows' sampler arrays before
    the first step, copy no logits and only the ids of all steps at once; same outputs."""
    from tests.engine_helpers import engines_on_ops
    from tests.test_device_sampling import DeviceStyleOps

    made = engines_on_ops(monkeypatch, DeviceStyleOps)
    plain, _, _, _ = await _run(tiny_llama, 1, MIXED)
    stepped, _, plans, idle = await _run(tiny_llama, 4, MIXED)
    assert stepped == plain and any(p.steps == 4 for p in plans)
    ops = made[-1]
    assert ops.logit_copies() == []
    assert ((4, 4), "int64") in ops.copies  # 4 steps x 4 streams of ids in one copy
    assert ("sample", 4) in ops.launches  # the seeded rows of a stepped round, on the device
    assert idle["pages_in_use"] == 0 and idle["lanes_in_use"] == 0


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests import tiny_qwen35 as tq
    from tf_async.models.loader import load_checkpoint

    cfg = tq.tiny_qwen35_config(moe=False)
    folder = tmp_path_factory.mktemp("hybrid")
    return load_checkpoint(tq.write_qwen35_mlx(folder, cfg, tq.random_qwen35_weights(cfg, seed=5), 4, 32))


@pytest.mark.asyncio
async def test_hybrid_decode_steps_equal_one_step_a_round(tiny_hybrid) -> None:
    """A Qwen3.5 hybrid steps too: each step advances every lane's recurrent state by one token,
    as a plain decode round does (greedy and seeded, concurrent, a stream stopping mid-round)."""
    kwargs = [*MIXED, dict(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3)]
    plain, reasons, _, _ = await _run(tiny_hybrid, 1, kwargs, ctx=64)
    stepped, stepped_reasons, plans, idle = await _run(tiny_hybrid, 4, kwargs, ctx=64)
    assert stepped == plain and stepped_reasons == reasons
    assert max(p.steps for p in plans) == 4
    assert idle["pages_in_use"] == 0 and idle["lanes_in_use"] == 0
