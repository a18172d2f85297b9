"""`tf-async serve --replicas 2` through real processes on loopback: the front passes
requests through to two tiny-model replicas (outputs equal to one engine's), spreads load,
keeps a conversation on its replica, passes cancels through (0 lanes after), survives a
killed replica (error, restart, rejoin), sums /metrics, and stops its children on SIGTERM.

Each replica's forwards are slowed by 10 ms (a throttle, as in test_serve_shutdown.py, so a
long reply is still streaming when a test acts); every wait is on output or polled state.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tf_async.server.app import start_server
from tf_async.serving.fleet import ReplicaSet
from tf_async.serving.front import create_front_app
from tf_async.serving.policy import RoutingPolicy
from tf_async.serving.supervisor import ReplicaSpec

from .server_helpers import metric_value, parse_sse, write_tiny_model

pytestmark = pytest.mark.asyncio
START_TIMEOUT_S = 300.0  # two children compile kernels on a loaded 2-core machine
THROTTLE = """
import time
from tf_async.engine.runner import Runner
init = Runner.__init__
def slow_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.fault_injector = lambda rows: time.sleep(0.01)
Runner.__init__ = slow_init
"""
FRONT = f"""
import sys
import tf_async.serving.supervisor as supervisor
supervisor.CHILD_CODE = {THROTTLE!r} + supervisor.CHILD_CODE
from tf_async.cli import main
sys.exit(main(sys.argv[1:]))
"""


class FrontProcess:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path):
        self.proc = proc
        self.log = log
        self.url = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_line(self, text: str) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith(text):  # the front's own lines (a replica's are prefixed)
                    return line
            assert self.proc.poll() is None, f"front exited: {self.output()}"
            time.sleep(0.05)  # polling the log file for a line, not a synchronisation
        raise AssertionError(f"no line with {text!r}: {self.output()}")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontProcess]:
    folder = tmp_path_factory.mktemp("replicas")
    model = write_tiny_model(folder / "model")
    log = folder / "front.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", FRONT, "serve", "--replicas", "2", "--model", str(model),
             "--device", "cpu", "--port", "0", "--parallel", "4", "--ctx", "1024",
             "--log-level", "warning", "--no-warmup"], stdout=out, stderr=subprocess.STDOUT)
    server = FrontProcess(proc, log)
    try:
        line = server.wait_line("tf-async: serving ")
        server.url = line.split(" on ")[1].split()[0]
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def chat_body(text: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


async def lanes(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/v1/lanes") as resp:
        return await resp.json()


async def wait_no_lanes(http: aiohttp.ClientSession, url: str) -> None:
    """Poll the front's /v1/lanes until every replica reports 0 lanes and 0 pages."""
    async def idle() -> bool:
        answer = await lanes(http, url)
        return all(r["up"] and r["stats"]["lanes_in_use"] == 0 and r["stats"]["pages_in_use"] == 0
                   for r in answer["replicas"])
    deadline = time.monotonic() + 60
    while not await idle():
        assert time.monotonic() < deadline, await lanes(http, url)
        await asyncio.sleep(0.02)


async def wait_state(http: aiohttp.ClientSession, url: str,
                     condition: Callable[[list[dict[str, Any]]], bool]) -> None:
    """Poll the front's /v1/lanes until `condition(replicas)` holds."""
    deadline = time.monotonic() + 60
    while not condition((await lanes(http, url))["replicas"]):
        assert time.monotonic() < deadline, await lanes(http, url)
        await asyncio.sleep(0.02)


async def open_stream(http: aiohttp.ClientSession, url: str, text: str,
                      max_tokens: int = 900) -> aiohttp.ClientResponse:
    """A streaming chat through the front whose first chunk has arrived."""
    resp = await http.post(url + "/v1/chat/completions",
                           json=chat_body(text, max_tokens, stream=True, ignore_eos=True))
    assert resp.status == 200, await resp.text()
    assert (await resp.content.readline()).startswith(b"data: ")
    return resp


async def test_outputs_through_the_front_equal_one_engines(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        replica_urls = [r["url"] for r in (await lanes(http, front.url))["replicas"]]
        for path, body in (("/v1/chat/completions", chat_body("Tell me a story")),
                           ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12,
                                                "temperature": 0})):
            answers = []
            for url in [front.url, *replica_urls]:
                async with http.post(url + path, json=body) as resp:
                    assert resp.status == 200
                    answers.append(await resp.json())
            texts = [_text(a["choices"][0]) for a in answers]
            assert texts[0] == texts[1] == texts[2] and answers[0]["usage"]["completion_tokens"] == 12
        async with http.post(front.url + "/v1/chat/completions",
                             json=chat_body("Tell me a story", stream=True)) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = parse_sse(await resp.read())
        assert events[-1] == "[DONE]"
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                           if e["choices"])
        async with http.post(front.url + "/v1/chat/completions",
                             json=chat_body("Tell me a story")) as resp:
            answers_text = _text((await resp.json())["choices"][0])
        assert streamed == answers_text
        async with http.get(front.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "model"
        responses = []
        for url in (front.url, replica_urls[0]):
            async with http.post(url + "/v1/responses", json={
                    "input": "Tell me a story", "max_output_tokens": 12, "temperature": 0}) as resp:
                assert resp.status == 200
                responses.append((await resp.json())["output"][0]["content"])
        assert responses[0] == responses[1]


def _text(choice: dict[str, Any]) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def test_concurrent_streams_spread_over_both_replicas(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        before = await _metrics(http, front.url)

        async def one(i: int) -> str:
            async with http.post(front.url + "/v1/chat/completions",
                                 json=chat_body(f"Stream number {i}", 24, stream=True,
                                                ignore_eos=True)) as resp:
                events = parse_sse(await resp.read())
                assert events[-2]["choices"][0]["finish_reason"] == "length"
                return resp.headers["X-TF-Replica"]

        served_by = await asyncio.gather(*(one(i) for i in range(8)))
        after = await _metrics(http, front.url)
    assert sorted(set(served_by)) == ["0", "1"] and min(served_by.count(r) for r in "01") >= 3
    for replica in "01":  # each replica's own count, as /metrics reports it
        label = f'replica="{replica}",endpoint="chat",outcome="length"'
        got = (metric_value(after, "tf_requests_total", label)
               - metric_value(before, "tf_requests_total", label))
        assert got == served_by.count(replica)
    summed = 'endpoint="chat",outcome="length"'
    assert (metric_value(after, "tf_requests_total", summed)
            - metric_value(before, "tf_requests_total", summed)) == 8


async def _metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_metrics_are_summed_over_replicas(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        text = await _metrics(http, front.url)
    for name in ("tf_lanes_total", "tf_kv_pages_total"):
        per_replica = [metric_value(text, name, f'replica="{r}"') for r in "01"]
        assert per_replica[0] > 0 and metric_value(text, name) == sum(per_replica)
    assert metric_value(text, "tf_lanes_total") == 8  # 2 replicas x --parallel 4
    assert metric_value(text, "tf_router_replica_up", 'replica="1"') == 1
    assert "# TYPE tf_requests_total counter" in text


async def test_turn_two_lands_on_turn_ones_replica(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        busy = await open_stream(http, front.url, "keep one replica busy")  # turn 1: the other
        turn1 = [{"role": "user", "content": "My name is Ada. Remember it."}]
        async with http.post(front.url + "/v1/chat/completions",
                             json={"messages": turn1, "max_tokens": 8, "temperature": 0}) as resp:
            first = await resp.json()
            home = resp.headers["X-TF-Replica"]
        other = busy.headers["X-TF-Replica"]
        assert home != other
        busy.close()
        await wait_no_lanes(http, front.url)
        # Make home one stream busier than the other (within the margin of 2), so that the
        # least loaded is the other one: a stream sent to the other replica directly (the
        # front does not count it) makes the next tie go to home.
        replicas = (await lanes(http, front.url))["replicas"]
        direct = await open_stream(http, replicas[int(other)]["url"], "direct to the other")
        await wait_state(http, front.url, lambda r: r[int(other)]["router"]["lanes_free"] == 3
                         and r[int(home)]["router"]["lanes_free"] == 4)
        held = await open_stream(http, front.url, "held at home")
        assert held.headers["X-TF-Replica"] == home
        turn2 = turn1 + [first["choices"][0]["message"],
                         {"role": "user", "content": "What is my name?"}]
        async with http.post(front.url + "/v1/chat/completions",
                             json={"messages": turn2, "max_tokens": 8, "temperature": 0}) as resp:
            second = await resp.json()
            assert resp.headers["X-TF-Replica"] == home
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        held.close()
        direct.close()
        await wait_no_lanes(http, front.url)


async def test_sse_disconnect_through_the_front_frees_the_lane(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        streams = [await open_stream(http, front.url, f"leave me {i}") for i in range(2)]
        assert {s.headers["X-TF-Replica"] for s in streams} == {"0", "1"}
        await wait_state(http, front.url,  # the engines publish stats once a round
                         lambda r: all(x["stats"]["lanes_in_use"] == 1 for x in r))
        for stream in streams:
            stream.close()  # the client leaves mid-stream
        await wait_no_lanes(http, front.url)


async def test_websocket_cancel_and_disconnect_through_the_front(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(front.url + "/v1/chat/ws") as ws:
            for chat_id in (1, 2):  # least loaded: one on each replica
                await ws.send_json({"type": "chat", "id": chat_id, "max_tokens": 900,
                                    "ignore_eos": True, "temperature": 0,
                                    "messages": [{"role": "user", "content": f"ws {chat_id}"}]})
            seen: set[int] = set()
            while seen != {1, 2}:
                msg = await ws.receive_json()
                assert msg["type"] == "delta", msg
                seen.add(msg["id"])
            await wait_state(http, front.url,
                             lambda r: all(x["stats"]["lanes_in_use"] == 1 for x in r))
            await ws.send_json({"type": "cancel", "id": 1})
            while (msg := await ws.receive_json())["type"] == "delta":
                pass
            assert msg == {"type": "done", "id": 1, "finish_reason": "cancelled", "usage": None}
            await ws.send_json({"type": "cancel", "id": 99})
            while (msg := await ws.receive_json())["type"] == "delta":
                pass
            assert msg["type"] == "error" and msg["error"]["code"] == "unknown_id"
        # chat 2 was still running when the socket closed
        await wait_no_lanes(http, front.url)


async def test_killed_replica_errors_its_streams_restarts_and_rejoins(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        streams = [await open_stream(http, front.url, f"stream {i}") for i in range(2)]
        on = {s.headers["X-TF-Replica"]: s for s in streams}
        assert sorted(on) == ["0", "1"]
        async with http.ws_connect(front.url + "/v1/chat/ws") as ws:
            await ws.send_json({"type": "chat", "id": "w", "max_tokens": 900, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "ws victim"}]})
            assert (await ws.receive_json())["type"] == "delta"
            await wait_state(http, front.url,
                             lambda r: any(x["stats"]["lanes_in_use"] == 2 for x in r))
            state = await lanes(http, front.url)
            (victim,) = [r for r in state["replicas"] if r["stats"]["lanes_in_use"] == 2]
            dead, alive = str(victim["replica"]), str(1 - victim["replica"])
            os.kill(victim["pid"], signal.SIGKILL)
            while (msg := await ws.receive_json())["type"] == "delta":
                pass
            assert msg["type"] == "error" and msg["id"] == "w"
            assert msg["error"]["code"] == "replica_failed"
        events = parse_sse((await on[dead].content.read()).lstrip(b"\n"))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "replica_failed"
        for _ in range(4):  # the other replica's stream goes on
            line = b"\n"
            while line == b"\n":
                line = await on[alive].content.readline()
            assert line.startswith(b"data: {\"id\""), line
        async with http.post(front.url + "/v1/chat/completions", json=chat_body("still?")) as r:
            assert r.status == 200  # on `alive`, or on `dead` if it has already rejoined
        on[alive].close()

        async def rejoined() -> bool:
            async with http.get(front.url + "/health") as resp:
                return (await resp.json()).get("replicas_ready") == 2
        deadline = time.monotonic() + START_TIMEOUT_S
        while not await rejoined():
            assert time.monotonic() < deadline, front.output()[-3000:]
            await asyncio.sleep(0.05)
        metrics = await _metrics(http, front.url)
        assert metric_value(metrics, "tf_router_replica_restarts_total", f'replica="{dead}"') == 1
        assert metric_value(metrics, "tf_router_lost_requests_total", f'replica="{dead}"') == 2
        busy = await open_stream(http, front.url, "hold one")
        assert busy.headers["X-TF-Replica"] == alive or busy.headers["X-TF-Replica"] == dead
        async with http.post(front.url + "/v1/chat/completions", json=chat_body("other?")) as r:
            assert r.status == 200 and r.headers["X-TF-Replica"] != busy.headers["X-TF-Replica"]
        busy.close()
        await wait_no_lanes(http, front.url)


async def test_sigterm_stops_every_replica_no_orphans(front: FrontProcess) -> None:
    async with aiohttp.ClientSession() as http:
        pids = [r["pid"] for r in (await lanes(http, front.url))["replicas"]]
    front.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(front.proc.wait, 120) == 0
    assert "tf-async: stopped (every replica exited)" in front.output()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_no_replica_ready_is_a_503_with_the_openai_error() -> None:
    specs = [ReplicaSpec(i, (), ()) for i in range(2)]
    app = create_front_app(ReplicaSet(specs, RoutingPolicy(2)), max_body_bytes=1 << 20)
    runner, port = await start_server(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            for method, path in (("GET", "/health"), ("POST", "/v1/chat/completions")):
                async with http.request(method, f"http://127.0.0.1:{port}{path}",
                                        json=chat_body("hi")) as resp:
                    assert resp.status == 503
                    body = await resp.json()
                assert body["error"]["code"] == "no_replica_ready"
                assert body["error"]["type"] == "server_error"
    finally:
        await runner.cleanup()

