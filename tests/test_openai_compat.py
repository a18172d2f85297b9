"""OpenAI compatibility details and the sampling surface, over real loopback HTTP on the tiny
engine: harmless fields ignored, system_fingerprint, prompt_tokens_details, context length
errors, CORS preflights, served-name aliases, n choices, lists of prompts, logit_bias and
min_tokens (each choice exactly what the same request alone gives: the gates hold)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
import pytest_asyncio

from tf_async.api_types import choice_seed
from tf_async.server.cli import add_serve_args

from .server_helpers import MODEL_NAME, live_server, open_engine, parse_sse, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT = [{"role": "user", "content": "Say something."}]
CTX = 256
IGNORED = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u-1",
           "parallel_tool_calls": True, "reasoning_effort": "low", "prompt_cache_key": "k",
           "safety_identifier": "s", "verbosity": "low", "modalities": ["text"]}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_compat"), parallel=4, ctx=CTX,
                           step_tokens=16) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(engine):
    async with live_server(engine, model_name=[MODEL_NAME, "gpt-4o-mini"],
                           cors_origin="http://app.example") as url:
        yield url


@pytest_asyncio.fixture(loop_scope="module")
async def client(base_url):
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused",
                                  max_retries=0) as oa:
        yield oa


async def post(url: str, body: dict) -> tuple[int, dict | list]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        if body.get("stream"):
            return resp.status, parse_sse(await resp.read())
        return resp.status, await resp.json()


async def test_harmless_openai_fields_are_ignored(base_url):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    status, plain = await post(base_url + "/v1/chat/completions", body)
    status_ignored, ignored = await post(base_url + "/v1/chat/completions", body | IGNORED)
    assert status == status_ignored == 200, ignored
    assert ignored["choices"] == plain["choices"]
    status, error = await post(base_url + "/v1/chat/completions", body | {"frobnicate": 1})
    assert status == 400 and error["error"]["param"] == "frobnicate"


async def test_fingerprint_and_cached_tokens_in_every_shape(client):
    chat = await client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3)
    assert chat.system_fingerprint and chat.system_fingerprint.startswith("fp_")
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0  # the prefix cache's share
    comp = await client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3)
    assert comp.system_fingerprint == chat.system_fingerprint
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert all(chunk.system_fingerprint == chat.system_fingerprint for chunk in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_too_long_prompt_is_context_length_exceeded(base_url, route):
    long_text = "word " * (2 * CTX)
    body = ({"prompt": long_text} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": long_text}]})
    status, error = await post(base_url + route, body)
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["param"] is None  # no max_tokens was sent
    status, error = await post(base_url + route, body | {"max_tokens": 8})
    assert error["error"]["code"] == "context_length_exceeded"
    assert error["error"]["param"] == "max_tokens"


async def test_preflight_allows_the_requested_headers(base_url):
    headers = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "x-stainless-os, x-stainless-lang, authorization"}
    async with aiohttp.ClientSession() as http, \
            http.options(base_url + "/v1/chat/completions", headers=headers) as resp:
        assert resp.status == 204
        allowed = {h.strip().lower() for h in resp.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"x-stainless-os", "x-stainless-lang", "authorization", "content-type"} <= allowed


async def test_served_model_name_aliases(client):
    assert [m.id for m in (await client.models.list()).data] == [MODEL_NAME, "gpt-4o-mini"]
    alias = await client.chat.completions.create(model="gpt-4o-mini", messages=CHAT,
                                                 max_tokens=4, temperature=0)
    own = await client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                               temperature=0)
    assert alias.model == "gpt-4o-mini" and own.model == MODEL_NAME
    assert alias.choices[0].message.content == own.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    args = _serve_parser().parse_args(["--served-model-name", "a", "gpt-4o-mini"])
    assert args.served_model_name == ["a", "gpt-4o-mini"]


def _serve_parser():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser


async def test_n_choices_each_reproducible_alone(engine, client):
    kwargs = dict(model=MODEL_NAME, max_tokens=8, temperature=1.0, seed=77,
                  extra_body={"ignore_eos": True})
    many = await client.chat.completions.create(messages=CHAT, n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):
        alone = await engine.chat_complete(CHAT, max_tokens=8, temperature=1.0,
                                           seed=choice_seed(77, i), ignore_eos=True)
        assert choice.message.content == alone.text
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.completion_tokens == 24
    assert many.usage.prompt_tokens == len(engine.chat_ids(CHAT))
    await wait_idle(engine)


async def test_n_choices_streamed_concatenate_to_the_whole(client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, n=3, max_tokens=10, temperature=0.9,
                  seed=5, extra_body={"ignore_eos": True})
    whole = await client.chat.completions.create(**kwargs)
    texts = ["", "", ""]
    finishes: list[str | None] = [None, None, None]
    stream = await client.chat.completions.create(stream=True, **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == ["length"] * 3


async def test_list_of_prompts_times_n(engine, client):
    prompts = ["The sky", "Once upon"]
    resp = await client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=6,
                                           temperature=0.8, seed=3,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for index, choice in enumerate(resp.choices):
        alone = await engine.complete(prompts[index // 2], max_tokens=6, temperature=0.8,
                                      seed=choice_seed(3, index % 2), ignore_eos=True)
        assert choice.text == alone.text
    assert resp.usage.prompt_tokens == sum(len(engine.prompt_ids(p)) for p in prompts)
    ids = await client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]],
                                          max_tokens=2, temperature=0)
    assert len(ids.choices) == 2


async def test_logit_bias_and_min_tokens_keep_rows_independent(engine, client):
    eos = engine.eos_ids[0]
    forced = await client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=6,
                                             temperature=0, logit_bias={"42": 100})
    assert forced.choices[0].text == engine.tokenizer.decode([42]) * 6
    late_stop = dict(max_tokens=8, temperature=0, logit_bias={str(eos): 100},
                     extra_body={"min_tokens": 3})
    early = await client.completions.create(model=MODEL_NAME, prompt="Hi", **late_stop)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 4
    # a biased request next to plain ones changes none of them (concurrent == solo)
    solo = [await engine.complete(p, max_tokens=8, temperature=0, ignore_eos=True)
            for p in ("One", "Two")]
    together = await asyncio.gather(
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=6, temperature=0,
                                  logit_bias={"42": 100}),
        *(engine.complete(p, max_tokens=8, temperature=0, ignore_eos=True) for p in ("One", "Two")))
    assert together[0].choices[0].text == forced.choices[0].text
    assert [c.text for c in together[1:]] == [c.text for c in solo]
    await wait_idle(engine)


async def test_a_refused_choice_cancels_its_siblings(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_small_queue"), parallel=2, ctx=CTX,
                           max_queue=1) as small, live_server(small) as url:
        status, error = await post(url + "/v1/completions", {
            "prompt": "Hello", "n": 4, "max_tokens": 32, "temperature": 1.0})
        assert status == 429 and error["error"]["code"] == "queue_full"
        await wait_idle(small)  # the three admitted choices were cancelled, lanes released
        status, ok = await post(url + "/v1/completions", {"prompt": "Hello", "n": 3,
                                                          "max_tokens": 4})
        assert status == 200 and len(ok["choices"]) == 3
