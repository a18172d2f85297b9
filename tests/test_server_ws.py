"""The websocket chat protocol: concurrent chats on one socket, cancel, socket close cancels
everything, duplicate ids, the API key; and the `tf-async chat` client session over it."""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import pytest
import pytest_asyncio

from tf_async.server.app import Server
from tf_async.server.cli import ChatSession, InProcessChatClient, WsChatClient
from tf_async.server.ws import ChatSocket

from .server_helpers import live_server, metric_value, open_engine, wait_for, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_ws"), parallel=4, ctx=512) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(engine):
    async with live_server(engine) as url:
        yield url


async def collect(ws: aiohttp.ClientWebSocketResponse, ids: set) -> dict:
    """Read until every chat in `ids` has ended; returns id -> {text, end message}."""
    out = {chat_id: {"text": "", "end": None} for chat_id in ids}
    while any(entry["end"] is None for entry in out.values()):
        msg = await ws.receive_json(timeout=120)  # a lost `done` fails instead of hanging
        if msg["type"] == "delta":
            out[msg["id"]]["text"] += msg["text"]
        else:
            out[msg["id"]]["end"] = msg
    return out


async def test_concurrent_chats_on_one_socket_match_solo(engine, base_url):
    chats = {1: dict(messages=user("one"), max_tokens=12, temperature=0),
             "two": dict(messages=user("two"), max_tokens=9, temperature=1.5, seed=5),
             3: dict(messages=user("three"), max_tokens=15, temperature=1.0, seed=9, top_k=8)}
    expected = {cid: await engine.chat_complete(c["messages"], **{k: v for k, v in c.items()
                                                                  if k != "messages"})
                for cid, c in chats.items()}
    async with aiohttp.ClientSession() as http, http.ws_connect(base_url + "/v1/chat/ws") as ws:
        for cid, params in chats.items():
            await ws.send_json({"type": "chat", "id": cid, **params})
        results = await collect(ws, set(chats))
    for cid, result in results.items():
        assert result["text"] == expected[cid].text
        end = result["end"]
        assert end["type"] == "done" and end["finish_reason"] == expected[cid].finish_reason
        assert end["usage"]["completion_tokens"] == len(expected[cid].token_ids)
        assert end["usage"]["prompt_tokens"] == expected[cid].usage.prompt_tokens
    await wait_idle(engine)


async def test_cancel_one_chat_leaves_the_others(engine, base_url):
    short = await engine.chat_complete(user("short"), max_tokens=10, temperature=0)
    async with aiohttp.ClientSession() as http, http.ws_connect(base_url + "/v1/chat/ws") as ws:
        await ws.send_json({"type": "chat", "id": "long", "messages": user("long"), **LONG})
        first = await ws.receive_json()
        assert first == {"type": "delta", "id": "long", "text": first["text"]}
        await ws.send_json({"type": "chat", "id": "short", "messages": user("short"),
                            "max_tokens": 10, "temperature": 0})
        await ws.send_json({"type": "cancel", "id": "long"})
        results = await collect(ws, {"long", "short"})
    assert results["long"]["end"] == {"type": "done", "id": "long", "finish_reason": "cancelled",
                                      "usage": None}
    assert results["short"]["text"] == short.text
    assert results["short"]["end"]["finish_reason"] == short.finish_reason
    await wait_idle(engine)


async def test_closing_the_socket_cancels_all_its_chats(engine, base_url):
    async with aiohttp.ClientSession() as http:
        before = await (await http.get(base_url + "/metrics")).text()
        ws = await http.ws_connect(base_url + "/v1/chat/ws")
        for cid in ("a", "b"):
            await ws.send_json({"type": "chat", "id": cid, "messages": user(cid), **LONG})
        await wait_for(lambda: engine.stats()["lanes_in_use"] == 2, what="two lanes in use")
        await ws.close()
        await wait_idle(engine)
        after = await (await http.get(base_url + "/metrics")).text()
    labels = 'endpoint="ws_chat",outcome="cancelled"'
    assert metric_value(after, "tf_requests_total", labels) == \
        metric_value(before, "tf_requests_total", labels) + 2
    assert metric_value(after, "tf_kv_pages_in_use") == 0


async def test_duplicate_running_id_is_an_error(engine, base_url):
    async with aiohttp.ClientSession() as http, http.ws_connect(base_url + "/v1/chat/ws") as ws:
        await ws.send_json({"type": "chat", "id": 7, "messages": user("x"), **LONG})
        await ws.send_json({"type": "chat", "id": 7, "messages": user("y"), **LONG})
        while (msg := await ws.receive_json())["type"] != "error":
            pass
        assert msg["id"] == 7 and msg["error"]["code"] == "duplicate_id"
        await ws.send_json({"type": "cancel", "id": 7})
        while (msg := await ws.receive_json())["type"] != "done":
            pass
        assert msg["finish_reason"] == "cancelled"
    await wait_idle(engine)


async def test_websocket_with_api_key(engine):
    async with live_server(engine, api_key="k3y") as url, aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await http.ws_connect(url + "/v1/chat/ws")
        for kwargs in ({"headers": {"Authorization": "Bearer k3y"}}, {"params": {"api_key": "k3y"}}):
            async with http.ws_connect(url + "/v1/chat/ws", **kwargs) as ws:
                await ws.send_json({"type": "chat", "id": 1, "messages": user("hi"),
                                    "max_tokens": 3})
                assert (await collect(ws, {1}))[1]["end"]["type"] == "done"


async def test_terminal_chat_session_over_websocket(engine, base_url):
    params = {"max_tokens": 8, "temperature": 0}
    async with WsChatClient(base_url) as client:
        session = ChatSession(client, system="Be terse.", **params)
        out = io.StringIO()
        first = await session.ask("hello", out)
        turn1 = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}]
        assert first == (await engine.chat_complete(turn1, **params)).text
        second = await session.ask("again", out)
        turn2 = turn1 + [{"role": "assistant", "content": first},
                         {"role": "user", "content": "again"}]
        assert second == (await engine.chat_complete(turn2, **params)).text
        assert out.getvalue() == first + "\n" + second + "\n"
        # Ctrl-C cancels the reply task: the server stops it, the session goes on.
        session.params = dict(LONG)
        reply = asyncio.create_task(session.ask("go on", io.StringIO()))
        await wait_for(lambda: engine.stats()["lanes_in_use"] == 1, what="reply running")
        reply.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reply
        await wait_idle(engine)
        assert session.history[-1]["role"] == "assistant"
        session.params = params
        assert await session.ask("last", io.StringIO()) == (await engine.chat_complete(
            session.history[:-1], **params)).text


async def test_terminal_chat_session_in_process(engine):
    session = ChatSession(InProcessChatClient(engine), max_tokens=6, temperature=0)
    text = await session.ask("hi", io.StringIO())
    assert text == (await engine.chat_complete(user("hi"), max_tokens=6, temperature=0)).text
    assert session.history == user("hi") + [{"role": "assistant", "content": text}]


async def test_terminal_chat_refused_turn_is_forgotten(engine, base_url):
    from tf_async.server.cli import ChatError

    async with WsChatClient(base_url) as client:
        session = ChatSession(client, max_tokens=10_000)  # more than the context
        with pytest.raises(ChatError, match="max_tokens"):
            await session.ask("hi", io.StringIO())
        assert session.history == []
        session.params = {"max_tokens": 4, "temperature": 0}
        assert await session.ask("hi", io.StringIO()) == (await engine.chat_complete(
            user("hi"), max_tokens=4, temperature=0)).text


class RecordingSocket:
    """Stands in for the aiohttp websocket of a ChatSocket: records what is sent."""

    closed = False

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.arrived = asyncio.Event()

    async def send_str(self, data: str) -> None:
        self.sent.append(json.loads(data))
        self.arrived.set()


async def test_cancel_before_the_chat_task_starts_still_answers_done(engine, base_url):
    # chat then cancel with no await between them: the chat's task has not run yet
    server = Server(engine, api_key=None, cors_origin=None, model_name=None,
                    max_body_bytes=1 << 20)
    ws = RecordingSocket()
    sock = ChatSocket(server, ws)  # type: ignore[arg-type]
    await sock.on_text(json.dumps({"type": "chat", "id": "b", "messages": user("b"), **LONG}))
    await sock.on_text(json.dumps({"type": "cancel", "id": "b"}))
    await wait_for(lambda: not sock.chats, what="chat b ended")
    assert ws.sent[-1] == {"type": "done", "id": "b", "finish_reason": "cancelled", "usage": None}
    assert [m["id"] for m in ws.sent if m["type"] in ("done", "error")] == ["b"]
    await wait_idle(engine)


async def test_chat_chat_cancel_at_once_answers_every_chat(engine, base_url):
    async with aiohttp.ClientSession() as http, http.ws_connect(base_url + "/v1/chat/ws") as ws:
        await ws.send_json({"type": "chat", "id": "a", "messages": user("a"), "max_tokens": 5,
                            "temperature": 0})
        await ws.send_json({"type": "chat", "id": "b", "messages": user("b"), **LONG})
        await ws.send_json({"type": "cancel", "id": "b"})
        results = await collect(ws, {"a", "b"})
    assert results["a"]["end"]["type"] == "done"
    assert results["b"]["end"]["finish_reason"] == "cancelled"
    await wait_idle(engine)


async def test_cancel_of_an_unknown_id_is_an_error_naming_it(engine, base_url):
    async with aiohttp.ClientSession() as http, http.ws_connect(base_url + "/v1/chat/ws") as ws:
        await ws.send_json({"type": "cancel", "id": "no-such-chat"})
        msg = await ws.receive_json(timeout=120)
        assert msg["type"] == "error" and msg["id"] == "no-such-chat"
        assert msg["error"]["code"] == "unknown_id" and msg["error"]["param"] == "id"
        await ws.send_json({"type": "chat", "id": 1, "messages": user("x"), "max_tokens": 3})
        assert (await collect(ws, {1}))[1]["end"]["type"] == "done"


async def test_oversized_frame_gets_an_error_and_close_code_1009(engine):
    async with live_server(engine, max_body_bytes=64 * 1024) as url, \
            aiohttp.ClientSession() as http, http.ws_connect(url + "/v1/chat/ws") as ws:
        await ws.send_str(json.dumps({"type": "chat", "id": 1, "messages": user("x" * 100_000)}))
        msg = await ws.receive_json(timeout=120)
        assert msg["type"] == "error" and msg["error"]["code"] == "frame_too_large", msg
        closing = await ws.receive(timeout=120)
        assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 1009
    await wait_idle(engine)
