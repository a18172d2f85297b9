"""The Ray Serve application (tf_async/serving/ray_app.py) on the CPU: a local Ray, two
tiny-model engine replicas and the OpenAI ingress. In CI (ray[serve] is in the test extra:
about 20 s to install and 40 s to run on 2 cores); marked `ray`, so `-m ray` runs it alone."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .server_helpers import metric_value, parse_sse, write_tiny_model

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ray_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import ray
    from ray import serve

    from tf_async.serving.ray_app import build_app

    model = write_tiny_model(tmp_path_factory.mktemp("ray") / "model")
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 1024 * 1024)  # tiny models: no big shared store
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        flags = ["--model", str(Path(model)), "--device", "cpu", "--parallel", "2", "--ctx",
                 "1024", "--no-warmup"]
        serve.run(build_app(2, flags, cpus_per_replica=1.0), name="tf_async", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 10,
            "temperature": 0} | extra


async def _requests(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as resp:
            assert (await resp.json())["replicas_ready"] == 2

        async def one(text: str, stream: bool = False) -> tuple[str, Any]:
            async with http.post(url + "/v1/chat/completions",
                                 json=_chat(text, stream=stream, ignore_eos=stream)) as resp:
                assert resp.status == 200, await resp.text()
                payload = parse_sse(await resp.read()) if stream else await resp.json()
                return resp.headers["X-TF-Replica"], payload

        answers = await asyncio.gather(*(one("Same question") for _ in range(2)))
        assert {replica for replica, _ in answers} == {"0", "1"}  # one each: least loaded
        texts = [a["choices"][0]["message"]["content"] for _, a in answers]
        assert texts[0] == texts[1]  # greedy: the same on either replica
        _, events = await one("Stream it", stream=True)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        assert metric_value(text, "tf_lanes_total") == 4
        assert metric_value(text, "tf_lanes_total", 'replica="1"') == 2
        # A client that leaves mid-stream: the replica cancels it (0 lanes after).
        resp = await http.post(url + "/v1/chat/completions",
                               json=_chat("Long", max_tokens=900, ignore_eos=True, stream=True))
        assert (await resp.content.readline()).startswith(b"data: ")
        await _until(http, url + "/v1/lanes", lambda a: a["stats"]["lanes_in_use"] == 1)
        resp.close()
        await _until(http, url + "/v1/lanes", lambda a: a["stats"]["lanes_in_use"] == 0)
        cancelled = 'endpoint="chat",outcome="cancelled"'
        await _until(http, url + "/metrics",
                     lambda text: metric_value(text, "tf_requests_total", cancelled) == 1)


async def _until(http: aiohttp.ClientSession, url: str, condition: Any) -> None:
    """Poll `url` until `condition(answer)` holds (the engines publish stats once a round)."""
    deadline = time.monotonic() + 60
    while True:
        async with http.get(url) as resp:
            is_json = resp.content_type == "application/json"
            answer = await resp.json() if is_json else await resp.text()
        if condition(answer):
            return
        assert time.monotonic() < deadline, answer
        await asyncio.sleep(0.02)


def test_ray_serve_app_routes_over_two_replicas(ray_url: str) -> None:
    asyncio.run(_requests(ray_url))
