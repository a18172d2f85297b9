"""The front of `--replicas` against fake replicas (small aiohttp apps, no engine): SSE
passed through chunk by chunk (not buffered), a replica's 5xx (out of memory) passed
through while the other keeps serving, a replica that fails mid-answer gives a 502 or an
SSE error event then [DONE]."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tf_async.server.app import start_server
from tf_async.serving.fleet import ReplicaSet
from tf_async.serving.front import create_front_app
from tf_async.serving.policy import RoutingPolicy
from tf_async.serving.supervisor import ReplicaSpec

pytestmark = pytest.mark.asyncio
OOM = b'{"error":{"message":"out of memory","type":"server_error","param":null,"code":"oom"}}'


class FakeReplica:
    """An upstream whose answers the test steps through."""

    def __init__(self, mode: str):
        self.mode = mode
        self.release = asyncio.Event()
        self.num_requests = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        if self.mode == "oom":
            return web.Response(status=500, body=OOM, content_type="application/json")
        if self.mode == "ok":
            return web.json_response({"ok": True})
        if self.mode == "drop-once" and self.num_requests == 1:  # a stale kept-alive link
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.mode == "drop-once":
            return web.json_response({"ok": True})
        if self.mode == "drop":  # dies after reading the request, before any answer
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await self.release.wait()  # the test reads chunk 1 before chunk 2 exists
        if self.mode == "die":
            assert request.transport is not None
            request.transport.abort()  # the replica "dies" mid-stream
            return response
        await response.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
        return response


@asynccontextmanager
async def front_over(*fakes: FakeReplica) -> AsyncIterator[tuple[str, ReplicaSet]]:
    runners = []
    replicas = ReplicaSet([ReplicaSpec(i, (), ()) for i in range(len(fakes))],
                          RoutingPolicy(len(fakes)))
    replicas.open_http()
    for index, fake in enumerate(fakes):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", fake.handle)
        runner, port = await start_server(app, "127.0.0.1", 0)
        runners.append(runner)
        replicas.replicas[index].url = f"http://127.0.0.1:{port}"
        replicas.policy.mark_up(index)
    runner, port = await start_server(create_front_app(replicas, max_body_bytes=1 << 20))
    try:
        yield f"http://127.0.0.1:{port}", replicas
    finally:
        await runner.cleanup()
        for r in runners:
            await r.cleanup()
        await replicas.http.close()


async def test_sse_is_passed_through_chunk_by_chunk() -> None:
    fake = FakeReplica("stream")
    async with front_over(fake) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json={"stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert await resp.content.readline() == b'data: {"n": 1}\n'  # before chunk 2
            fake.release.set()
            rest = await resp.content.read()
        assert rest == b'\ndata: {"n": 2}\n\ndata: [DONE]\n\n'


async def test_a_replicas_out_of_memory_5xx_passes_through_and_others_serve() -> None:
    oom, ok = FakeReplica("oom"), FakeReplica("ok")
    async with front_over(oom, ok) as (url, replicas), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json={"prompt": "a"}) as resp:
            assert resp.status == 500 and await resp.read() == OOM
            assert resp.headers["X-TF-Replica"] == "0"
        assert replicas.policy.replicas[0].up  # a 5xx is an answer, not a dead replica
        results = await asyncio.gather(*(http.post(url + "/v1/completions", json={"prompt": "b"})
                                         for _ in range(4)))
        assert sorted(r.status for r in results) == [200, 200, 500, 500]
        for r in results:
            r.close()
        assert ok.num_requests == 2


async def test_replica_dying_mid_stream_ends_with_an_error_event_then_done() -> None:
    fake = FakeReplica("die")
    async with front_over(fake) as (url, replicas), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json={"stream": True}) as resp:
            assert await resp.content.readline() == b'data: {"n": 1}\n'
            fake.release.set()
            rest = await resp.content.read()
        assert b'"code":"replica_failed"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert replicas.num_lost_streams == [1]
        assert replicas.policy.replicas[0].in_flight == 0


async def test_no_replica_listening_is_a_503_not_a_hang() -> None:
    fake = FakeReplica("ok")
    async with front_over(fake) as (url, replicas), aiohttp.ClientSession() as http:
        replicas.replicas[0].url = "http://127.0.0.1:1"  # refused
        async with http.post(url + "/v1/completions", json={"prompt": "a"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_replica_ready"
        assert not replicas.policy.replicas[0].up  # a failed connect takes it out


async def test_cross_site_websocket_upgrade_is_refused() -> None:
    async with front_over(FakeReplica("ok")) as (url, _), aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(url + "/v1/chat/ws", headers={"Origin": "https://evil.example"})
        assert refused.value.status == 403


async def test_replica_lost_before_answering_is_a_502_openai_error() -> None:
    async with front_over(FakeReplica("drop")) as (url, replicas), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json={"prompt": "a"}) as resp:
            assert resp.status == 502
            error = (await resp.json())["error"]
        assert error["code"] == "replica_failed" and error["type"] == "server_error"
        assert replicas.num_lost_streams == [1]


async def test_a_connection_closed_before_any_answer_is_sent_once_more() -> None:
    """A replica restarted on the same port leaves the front a kept-alive connection that is
    closed before any answer: the request goes once more on a new connection (nothing had
    reached the client), not a 502."""
    fake = FakeReplica("drop-once")
    async with front_over(fake) as (url, replicas), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json={"prompt": "a"}) as resp:
            assert resp.status == 200 and await resp.json() == {"ok": True}
        assert replicas.num_lost_streams == [0] and fake.num_requests == 2


async def test_a_replica_that_cannot_start_stops_the_front_with_exit_2(tmp_path: Path) -> None:
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tf_async.cli", "serve", "--replicas", "2",
                           "--model", str(tmp_path / "missing"), "--device", "cpu", "--port",
                           "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "a replica exited before it was ready" in done.stderr
    assert "model path does not exist" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.splitlines()[-1] == "tf-async: stopped (every replica exited)"
