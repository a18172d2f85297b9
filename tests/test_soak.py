"""A small soak and fuzz run (benchmarks/soak.py) on a tiny model in-process: requests over
SSE, plain HTTP and the websocket, a third abandoned at random points, a KV pool small enough
to preempt; plain and ngram-drafted. Every finished result equals its solo run, nothing 5xx,
every websocket chat gets exactly one end, the engine is idle after, and every hostile
request of the fuzz list gets a 4xx OpenAI error JSON with the server alive after."""

from __future__ import annotations

import random

import pytest

from benchmarks.soak import make_plan, run_fuzz, run_soak

from .server_helpers import live_server, open_engine

pytestmark = pytest.mark.asyncio
MAX_BODY = 64 * 1024


@pytest.mark.parametrize("drafter", [None, "ngram"])
async def test_small_soak_and_fuzz(tmp_path_factory, drafter):
    folder = tmp_path_factory.mktemp("tiny_soak")
    async with open_engine(folder, parallel=3, ctx=256, page_size=8, kv_pages=40, step_tokens=16,
                           drafter=drafter) as engine, \
            live_server(engine, max_body_bytes=MAX_BODY) as url:
        # 30-word prompts on 3 lanes of 40 pages of 8 rows: streams get preempted
        plan = make_plan(40, random.Random(5), abandon_fraction=0.4, max_tokens=32,
                         long_prompt_words=30)
        report = await run_soak(url, plan, concurrency=6)
        assert not report.mismatches, report.mismatches
        assert not report.server_errors, report.server_errors
        assert not report.protocol_errors, report.protocol_errors
        assert report.compared > 0 and report.abandoned > 0
        assert {k: report.idle[k] for k in ("lanes_in_use", "pages_in_use", "queued")} == \
            {"lanes_in_use": 0, "pages_in_use": 0, "queued": 0}
        num_cases, failures = await run_fuzz(url, MAX_BODY)
        assert not failures, failures
        assert num_cases > 60
        assert engine.stats()["pages_in_use"] == 0
