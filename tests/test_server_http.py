"""The HTTP API over real loopback HTTP: the official openai client (streaming and not,
usage on and off), SSE framing, logprobs, stop/seed/max_tokens, the side routes, API key,
CORS, disconnects (mid-prompt, mid-decode), slow readers, a full queue and an internal fault.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import openai
import pytest
import pytest_asyncio

from .fake_engine import FakeEngine
from .server_helpers import (
    MODEL_NAME,
    live_server,
    metric_value,
    open_engine,
    parse_sse,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
LONG_PROMPT_IDS = [(7 * i) % 250 + 3 for i in range(400)]  # 25 prompt steps of 16 tokens


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_http")
    async with open_engine(folder, parallel=4, ctx=512, step_tokens=16) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(engine):
    async with live_server(engine) as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module")
async def client(base_url):
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused",
                                  max_retries=0) as oa:
        yield oa


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def test_chat_non_streaming_matches_engine(engine, client):
    expected = await engine.chat_complete(CHAT, max_tokens=24, temperature=0.0)
    resp = await client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24,
                                                temperature=0)
    assert resp.object == "chat.completion" and resp.model == MODEL_NAME
    assert resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == expected.usage.prompt_tokens
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_streaming_usage_on_and_off(engine, client, include_usage):
    expected = await engine.chat_complete(CHAT, max_tokens=24, temperature=0.0)
    options = {"include_usage": True} if include_usage else None
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0, stream=True,
        stream_options=options)
    chunks = [chunk async for chunk in stream]
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    usage_chunks = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
        assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens
    else:
        assert usage_chunks == []


@pytest.mark.parametrize("include_usage", [True, False])
async def test_completions_stream_and_not(engine, client, include_usage):
    expected = await engine.complete("Once upon a time", max_tokens=20, temperature=0.0)
    resp = await client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                           max_tokens=20, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text == expected.text
    assert resp.usage.completion_tokens == len(expected.token_ids)
    options = {"include_usage": True} if include_usage else None
    stream = await client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                             max_tokens=20, temperature=0, stream=True,
                                             stream_options=options)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert (chunks[-1].usage is not None) == include_usage
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens


async def test_completion_prompt_as_token_ids(engine, client):
    ids = engine.tokenizer.encode("Once upon a time")
    expected = await engine.complete(ids, max_tokens=12, temperature=0.0)
    resp = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12,
                                           temperature=0)
    assert resp.choices[0].text == expected.text
    assert resp.usage.prompt_tokens == len(ids)


async def test_sse_framing(base_url, http):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Cache-Control"] == "no-cache"
        raw = await resp.read()
    assert raw.startswith(b"data: {") and raw.endswith(b"data: [DONE]\n\n")
    events = parse_sse(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all(set(c) >= {"id", "object", "created", "model", "choices"} for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert "usage" not in chunks[0]


async def test_max_completion_tokens_gives_length(client):
    resp = await client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=5, temperature=0,
        extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


async def test_seed_reproducible_and_matches_engine(engine, client):
    kwargs = dict(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    expected = await engine.complete("The weather", **kwargs)
    first = await client.completions.create(model=MODEL_NAME, prompt="The weather", **kwargs)
    second = await client.completions.create(model=MODEL_NAME, prompt="The weather", **kwargs)
    assert first.choices[0].text == second.choices[0].text == expected.text
    extensions = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1}
    expected_ext = await engine.complete("The weather", **kwargs, **extensions,
                                         presence_penalty=0.5, frequency_penalty=0.5)
    ext = await client.completions.create(model=MODEL_NAME, prompt="The weather", **kwargs,
                                          presence_penalty=0.5, frequency_penalty=0.5,
                                          extra_body=extensions)
    assert ext.choices[0].text == expected_ext.text


async def test_stop_string_cuts_the_text(engine, client):
    full = await engine.complete("Hello", max_tokens=24, temperature=0.0, stop_token_ids=[],
                                 ignore_eos=True)
    text = full.text
    assert len(text) >= 6, text
    stop = text[3:5]
    resp = await client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=24,
                                           temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert resp.choices[0].text == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


async def test_logprobs_completions_and_chat(engine, client):
    resp = await client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=6,
                                           temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = await client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob == pytest.approx(item.top_logprobs[0].logprob) for item in content)


async def test_models_health_lanes(engine, base_url, http, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert (await client.models.retrieve(MODEL_NAME)).id == MODEL_NAME
    async with http.get(base_url + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ok"
    async with http.get(base_url + "/v1/lanes") as resp:
        lanes = (await resp.json())["data"]
    assert [lane["lane"] for lane in lanes] == [0, 1, 2, 3]
    assert all(set(lane) >= {"state", "pages", "tokens"} for lane in lanes)


async def test_tokenize_detokenize_round_trip(engine, base_url, http):
    async with http.post(base_url + "/tokenize", json={"prompt": "Hello world"}) as resp:
        data = await resp.json()
    tokenizer = engine.tokenizer
    assert data["tokens"] == tokenizer.encode("Hello world", add_special_tokens=tokenizer.add_bos)
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == 512
    plain = engine.tokenizer.encode("Hello world")
    async with http.post(base_url + "/detokenize", json={"tokens": plain}) as resp:
        assert (await resp.json())["prompt"] == "Hello world"
    async with http.post(base_url + "/tokenize", json={"messages": CHAT}) as resp:
        chat_ids = (await resp.json())["tokens"]
    assert chat_ids == engine.tokenizer.encode_chat(CHAT)


async def test_metrics_count_requests_and_tokens(base_url, http, client):
    async def scrape() -> str:
        async with http.get(base_url + "/metrics") as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            return await resp.text()

    before = await scrape()
    resp = await client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=7,
                                           temperature=0, extra_body={"ignore_eos": True})
    after = await scrape()
    labels = 'endpoint="completions",outcome="length"'
    assert metric_value(after, "tf_requests_total", labels) == \
        metric_value(before, "tf_requests_total", labels) + 1
    assert metric_value(after, "tf_generation_tokens_total") == \
        metric_value(before, "tf_generation_tokens_total") + 7
    assert metric_value(after, "tf_prompt_tokens_total") == \
        metric_value(before, "tf_prompt_tokens_total") + resp.usage.prompt_tokens
    for name in ("tf_lanes_in_use", "tf_kv_pages_in_use", "tf_queue_depth",
                 "tf_drafted_tokens_total", "tf_accepted_tokens_total",
                 "tf_time_to_first_token_seconds_count", "tf_inter_token_latency_seconds_count"):
        assert f"\n{name}" in after


async def test_disconnect_mid_prompt_releases_the_lane(engine, base_url):
    before = await _metrics(base_url)
    body = {"model": MODEL_NAME, "prompt": LONG_PROMPT_IDS, "max_tokens": 64, "stream": True}
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(base_url + "/v1/completions", json=body))
        await wait_for(lambda: any(lane["state"] == "prefill" for lane in engine.lanes()),
                       what="a lane in prefill")
        request.cancel()
    await wait_idle(engine)
    after = await _metrics(base_url)
    assert metric_value(after, "tf_kv_pages_in_use") == 0
    assert metric_value(after, "tf_lanes_in_use") == 0
    labels = 'endpoint="completions",outcome="cancelled"'
    assert metric_value(after, "tf_requests_total", labels) == \
        metric_value(before, "tf_requests_total", labels) + 1


async def test_disconnect_mid_decode_releases_the_lane(engine, base_url):
    before = await _metrics(base_url)
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 300, "stream": True,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(base_url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # role chunk
        await resp.content.readuntil(b"\n\n")  # first token: decoding now
        assert engine.stats()["lanes_in_use"] >= 1
        resp.close()
    await wait_idle(engine)
    after = await _metrics(base_url)
    assert metric_value(after, "tf_kv_pages_in_use") == 0
    labels = 'endpoint="chat",outcome="cancelled"'
    assert metric_value(after, "tf_requests_total", labels) == \
        metric_value(before, "tf_requests_total", labels) + 1


async def test_slow_reader_does_not_stall_the_engine(engine, base_url, client):
    expected = await engine.complete("slow", max_tokens=100, temperature=0.0, ignore_eos=True,
                                     logprobs=20)
    body = {"model": MODEL_NAME, "prompt": "slow", "max_tokens": 100, "temperature": 0,
            "stream": True, "ignore_eos": True, "logprobs": 20}
    async with aiohttp.ClientSession() as session:
        slow = await session.post(base_url + "/v1/completions", json=body)  # headers only
        other = await client.completions.create(model=MODEL_NAME, prompt="fast", max_tokens=10,
                                                temperature=0)
        assert other.choices[0].text == (await engine.complete("fast", max_tokens=10)).text
        # The engine finishes the unread stream: its lane is free although nobody read it.
        await wait_idle(engine)
        events = parse_sse(await slow.read())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected.text


async def test_queue_full_gives_429_with_retry_after(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_queue")
    async with open_engine(folder, parallel=1, ctx=512, max_queue=1) as eng, \
            live_server(eng) as url, aiohttp.ClientSession() as session:
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        held = [asyncio.create_task(session.post(url + "/v1/completions", json=body))
                for _ in range(2)]
        await wait_for(lambda: eng.stats()["running"] + eng.stats()["queued"] == 2,
                       what="one running and one queued request")
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "queue_full"
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_idle(eng)


async def test_api_key_on_every_route_but_health(engine):
    async with live_server(engine, api_key="s3cret") as url, aiohttp.ClientSession() as http:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/lanes"),
                             ("GET", "/"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                             ("GET", "/v1/chat/ws")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with http.request(method, url + path, headers=headers, json={}) as resp:
                    assert resp.status == 401, (path, headers)
                    assert (await resp.json())["error"]["code"] == "invalid_api_key"
        async with http.get(url + "/health") as resp:
            assert resp.status == 200
        async with http.get(url + "/?api_key=s3cret") as resp:
            assert resp.status == 200  # the web page may pass the key in its URL
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="s3cret") as oa:
            assert (await oa.models.list()).data[0].id == MODEL_NAME
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as oa:
            with pytest.raises(openai.AuthenticationError):
                await oa.models.list()


async def test_cors_off_by_default_and_on_when_asked(engine, base_url, http):
    headers = {"Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"}
    async with http.get(base_url + "/v1/models", headers=headers) as resp:
        assert "Access-Control-Allow-Origin" not in resp.headers
    async with http.options(base_url + "/v1/chat/completions", headers=headers) as resp:
        assert resp.status >= 400 and "Access-Control-Allow-Origin" not in resp.headers
    async with live_server(engine, cors_origin="http://elsewhere.example") as url:
        async with http.options(url + "/v1/chat/completions", headers=headers) as resp:
            assert resp.status == 204
            assert resp.headers["Access-Control-Allow-Origin"] == "http://elsewhere.example"
        async with http.get(url + "/v1/models", headers=headers) as resp:
            assert resp.headers["Access-Control-Allow-Origin"] == "http://elsewhere.example"


async def test_websocket_from_another_origin_is_refused(base_url, http):
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await http.ws_connect(base_url + "/v1/chat/ws", headers={"Origin": "http://evil.example"})
    assert info.value.status == 403


async def test_internal_fault_is_a_logged_500_and_the_server_goes_on(caplog):
    async with FakeEngine(parallel=2) as fake, live_server(fake) as url, \
            aiohttp.ClientSession() as http:
        fake.fail_prompts.add("boom")
        with caplog.at_level(logging.ERROR, logger="tf_async.server"):
            async with http.post(url + "/v1/completions", json={"prompt": "boom"}) as resp:
                assert resp.status == 500
                assert (await resp.json())["error"]["type"] == "server_error"
            async with http.post(url + "/v1/completions",
                                 json={"prompt": "boom", "stream": True}) as resp:
                assert resp.status == 500  # failed before the first token: still a status
        assert "RequestFailedError" in caplog.text
        async with http.post(url + "/v1/completions", json={"prompt": "fine"}) as resp:
            assert resp.status == 200 and (await resp.json())["choices"][0]["text"]


async def _metrics(base_url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as resp:
        return await resp.text()
