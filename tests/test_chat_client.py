"""`tf-async chat` as a person uses it: it survives idling at its prompt longer than the
server's websocket heartbeat (short here), reconnects when the server dropped the socket,
greets with the server, the model and how to quit, and text typed during a reply is not
echoed into it (a real pseudo-terminal)."""

from __future__ import annotations

import asyncio
import io
import os
import pty
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tf_async.server.app import SERVER_KEY
from tf_async.server.chat_client import ChatSession, WsChatClient, chat_loop

from .server_helpers import MODEL_NAME, open_engine, wait_for, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")
HEARTBEAT_S = 0.1  # the server pings every 0.1 s and drops a client silent for 0.15 s more
PARAMS = {"max_tokens": 6, "temperature": 0}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_chat"), parallel=2, ctx=512) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(engine):
    from aiohttp import web

    from tf_async.server.app import create_app, start_server

    app = create_app(engine, model_name=MODEL_NAME, ws_heartbeat_s=HEARTBEAT_S)
    runner, port = await start_server(app, "127.0.0.1", 0)
    yield app, f"http://127.0.0.1:{port}"
    await runner.cleanup()
    assert isinstance(app, web.Application)


async def test_idle_at_the_prompt_longer_than_the_heartbeat_then_ask(engine, server):
    _, url = server
    async with WsChatClient(url) as client:
        session = ChatSession(client, **PARAMS)
        first = await session.ask("hello", io.StringIO())
        # Idle at the prompt for 10 heartbeats: the length of the idle is what is tested.
        await asyncio.sleep(10 * HEARTBEAT_S)
        second = await session.ask("again", io.StringIO())
        assert client.num_connects == 1  # kept alive, not reconnected
    turn2 = user("hello") + [{"role": "assistant", "content": first}] + user("again")
    assert second == (await engine.chat_complete(turn2, **PARAMS)).text


async def test_reconnects_when_the_server_dropped_the_socket(engine, server):
    app, url = server
    async with WsChatClient(url) as client:
        session = ChatSession(client, **PARAMS)
        await session.ask("hello", io.StringIO())
        for ws in list(app[SERVER_KEY].websockets):
            await ws.close(code=1001, message=b"restart")
        await wait_for(lambda: not app[SERVER_KEY].websockets, what="socket closed")
        await session.ask("again", io.StringIO())
        assert client.num_connects == 2
    await wait_idle(engine)


async def test_model_name_for_the_banner(server):
    _, url = server
    async with WsChatClient(url) as client:
        assert await client.model_name() == MODEL_NAME


class StepClient:
    """A chat client whose reply goes on only when the test says so."""

    def __init__(self) -> None:
        self.questions: list[str] = []
        self.go_on = asyncio.Event()

    async def model_name(self) -> str:
        return "step-model"

    async def reply(self, messages: list[dict[str, str]], **_: Any) -> AsyncIterator[str]:
        self.questions.append(messages[-1]["content"])
        yield "AAA"
        await self.go_on.wait()
        self.go_on.clear()
        yield "BBB"


async def read_until(master: int, text: bytes, seen: bytearray) -> None:
    while text not in seen:
        seen += await asyncio.to_thread(os.read, master, 4096)


async def test_typed_ahead_text_is_not_echoed_into_the_reply():
    master, slave = pty.openpty()
    client = StepClient()
    with open(slave, closefd=False) as tty_in, open(slave, "w", closefd=False) as tty_out:
        loop_task = asyncio.create_task(chat_loop(ChatSession(client), "a test server",
                                                  stdin=tty_in, stdout=tty_out))
        seen = bytearray()
        await read_until(master, b"quit", seen)  # the banner
        assert b"step-model" in seen and b"a test server" in seen
        os.write(master, b"first question\n")
        await read_until(master, b"AAA", seen)
        os.write(master, b"typed during the reply")  # no Enter: an unfinished line
        client.go_on.set()
        await read_until(master, b"BBB", seen)
        await read_until(master, b"> ", seen[seen.index(b"BBB"):])
        os.write(master, b"second\n")
        await wait_for(lambda: len(client.questions) == 2, what="second question")
        client.go_on.set()
        os.write(master, b"/quit\n")
        await asyncio.wait_for(loop_task, 30)
    os.close(master)
    os.close(slave)
    text = seen.decode()
    assert "AAABBB" in text, text  # nothing typed shows up inside the reply
    # The unfinished line is dropped when the reply ends - when the kernel's pty has handed the
    # bytes to the line discipline by then: that hand-over is asynchronous, and on a loaded
    # machine they can land after the flush (then they are typed at the prompt, as a person
    # typing just after the reply would see them). Either way they never enter the reply.
    assert client.questions[0] == "first question" and client.questions[1].endswith("second")
    if "typed during the reply" not in text:
        assert client.questions == ["first question", "second"]

