"""The prefix cache over real loopback HTTP: usage.prompt_tokens_details.cached_tokens,
`cache_salt` (vLLM's field) keeping tenants apart, and the cache's metrics and lanes view."""

from __future__ import annotations

import aiohttp
import pytest
import pytest_asyncio

from .server_helpers import MODEL_NAME, live_server, open_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
LONG = "a long shared system prompt about rivers, mills and ledgers " * 6


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_prefix"), parallel=2, ctx=512,
                           page_size=4) as eng, live_server(eng) as url:
        yield url


async def _chat(base_url: str, **extra) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": LONG},
                         {"role": "user", "content": "hi"}], **extra}
    async with aiohttp.ClientSession() as http, \
            http.post(base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_a_repeated_prompt_reports_cached_tokens_and_salts_keep_tenants_apart(base_url):
    first = await _chat(base_url, cache_salt="tenant-a")
    again = await _chat(base_url, cache_salt="tenant-a")
    other = await _chat(base_url, cache_salt="tenant-b")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == again["usage"]["prompt_tokens"] - 1  # all but the last token (its logits)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"] == first["choices"]  # resumed == fresh
    async with aiohttp.ClientSession() as http:
        async with http.get(base_url + "/metrics") as resp:
            text = await resp.text()
        async with http.get(base_url + "/v1/lanes") as resp:
            stats = (await resp.json())["stats"]
    hits = [line for line in text.splitlines() if line.startswith("tf_prefix_cache_hit_pages")]
    assert hits and float(hits[0].split()[-1]) >= cached // 4
    assert "tf_prefix_cache_pages " in text and stats["cached_pages"] > 0
    copied = [line for line in text.splitlines() if line.startswith("tf_prefix_cache_copied_rows_total")]
    assert copied and float(copied[0].split()[-1]) == stats["prefix_cache_copied_rows"]
    assert "tf_prefix_state_slots 0.0" in text  # a dense model keeps no recurrent state
    assert stats["pages_in_use"] == 0  # cached pages are not lane pages


async def test_a_bad_cache_salt_is_a_400(base_url):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
            "cache_salt": ""}
    async with aiohttp.ClientSession() as http, \
            http.post(base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "cache_salt"
