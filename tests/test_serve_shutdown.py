"""`tf-async serve` stopping, through a real server process on loopback: SIGINT/SIGTERM
print a draining line, stop accepting, let running streams finish up to
--shutdown-timeout, then cancel the rest and exit 0 with every lane and page released; a
second signal stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from .server_helpers import write_tiny_model

pytestmark = pytest.mark.asyncio
LINE_TIMEOUT_S = 120.0  # generous: the first start compiles kernels on a loaded machine
# `tf-async serve` with each forward slowed by 10 ms, so that a long reply is still streaming
# when the test signals (a throttle, not a synchronisation: every wait below is on output).
THROTTLED_SERVE = """
import sys, time
from tf_async.engine.runner import Runner
init = Runner.__init__
def slow_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.fault_injector = lambda rows: time.sleep(0.01)
Runner.__init__ = slow_init
from tf_async.cli import main
sys.exit(main(sys.argv[1:]))
"""


class ServeProcess:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.lines: list[str] = []
        self.url = ""

    async def line_with(self, text: str) -> str:
        """Read output lines until one contains `text`."""
        assert self.proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), LINE_TIMEOUT_S)
            assert raw, f"server exited before printing {text!r}: {self.lines}"
            line = raw.decode().rstrip()
            self.lines.append(line)
            if text in line:
                return line

    async def exit_code(self) -> int:
        assert self.proc.stdout is not None
        rest = await asyncio.wait_for(self.proc.stdout.read(), LINE_TIMEOUT_S)
        self.lines += rest.decode().splitlines()
        return await self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_serve"))


@contextlib.asynccontextmanager
async def serve(model_dir: Path, *flags: str) -> AsyncIterator[ServeProcess]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", THROTTLED_SERVE, "serve", "--model", str(model_dir),
        "--device", "cpu", "--port", "0", "--parallel", "2", "--ctx", "1024",
        "--log-level", "warning", *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    server = ServeProcess(proc)
    try:
        line = await server.line_with("tf-async: serving")
        server.url = line.split(" on ")[1].split()[0]
        yield server
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


LONG = {"model": "x", "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": "Talk for a long time"}]}


async def started_stream(http: aiohttp.ClientSession, url: str,
                         max_tokens: int = 900) -> aiohttp.ClientResponse:
    """A streaming chat whose first chunk has arrived."""
    body = {**LONG, "max_tokens": max_tokens}
    body.pop("model")
    resp = await http.post(url + "/v1/chat/completions", json=body)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")
    return resp


async def finish_reason(resp: aiohttp.ClientResponse) -> str:
    """Read an SSE response to its end; the last chunk's finish_reason."""
    reason = ""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            choices = json.loads(line[len("data: "):])["choices"]
            if choices and choices[0]["finish_reason"]:
                reason = choices[0]["finish_reason"]
    assert line == "data: [DONE]" or reason, line
    return reason


async def test_sigterm_lets_running_streams_finish_then_exits_0(model_dir: Path) -> None:
    async with serve(model_dir, "--shutdown-timeout", "600") as server, \
            aiohttp.ClientSession() as http:
        resp = await started_stream(http, server.url, max_tokens=40)
        server.proc.send_signal(signal.SIGTERM)
        draining = await server.line_with("shutting down")
        assert "draining 1 request(s) for up to 600 s" in draining
        assert await finish_reason(resp) == "length"  # the whole reply, not cut
        assert await server.exit_code() == 0
    assert any("stopped (1 request(s) finished, 0 cancelled; 0 lanes, 0 pages in use)" in line
               for line in server.lines), server.lines


async def test_second_ctrl_c_stops_at_once_and_no_new_requests_meanwhile(model_dir: Path) -> None:
    async with serve(model_dir, "--shutdown-timeout", "600") as server, \
            aiohttp.ClientSession() as http:
        async with http.ws_connect(server.url + "/v1/chat/ws") as ws:
            resp = await started_stream(http, server.url)
            server.proc.send_signal(signal.SIGINT)
            await server.line_with("Ctrl-C again to stop now")
            # Draining (for up to 600 s): no new connection, no new chat on an open socket.
            with pytest.raises(aiohttp.ClientConnectionError):
                await http.get(server.url + "/health")
            await ws.send_json({"type": "chat", "id": 7, "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}]})
            refused = await ws.receive_json()
            assert refused["type"] == "error" and refused["id"] == 7
            assert "shutting down" in refused["error"]["message"]
            server.proc.send_signal(signal.SIGINT)
            await server.line_with("second signal: cancelling 1 request(s)")
            assert await finish_reason(resp) == "cancelled"
        assert await server.exit_code() == 0
    assert any("stopped (0 request(s) finished, 1 cancelled; 0 lanes, 0 pages in use)" in line
               for line in server.lines), server.lines


async def test_shutdown_timeout_cancels_what_is_left_and_exits_0(model_dir: Path) -> None:
    async with serve(model_dir, "--shutdown-timeout", "0") as server, \
            aiohttp.ClientSession() as http:
        resp = await started_stream(http, server.url)
        server.proc.send_signal(signal.SIGINT)
        await server.line_with("0 s timeout: cancelling 1 request(s)")
        assert await finish_reason(resp) == "cancelled"
        assert await server.exit_code() == 0
    assert any("0 lanes, 0 pages in use" in line for line in server.lines), server.lines
