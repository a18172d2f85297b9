"""Websocket chat at /v1/chat/ws.

Client -> server: `{"type": "chat", "id": ..., "messages": [...], ...sampling params}` and
`{"type": "cancel", "id": ...}`. Server -> client: `{"type": "delta", "id", "text"}`, then
`{"type": "done", "id", "finish_reason", "usage"}` (finish_reason "cancelled" and usage
null after a cancel) or `{"type": "error", "id", "error": {message, type, param, code}}`.
Several chats run at once on one socket, each in its own task; closing the socket cancels
them all. Sends share one lock, so a slow reader only holds back its own socket.
Every chat id gets exactly one `done` or `error`; a cancel of an id that is not running gets
an `error` naming it; a frame over the body limit gets an `error`, then close code 1009.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from ..api_types import Delta
from ..errors import BadInputError, QueueFullError
from .schemas import UsageOut, WsCancel, WsChat, decode
from .state import SERVER_KEY, Server

log = logging.getLogger("tf_async.server")

ChatId = str | int
_encoder = msgspec.json.Encoder()
# aiohttp drops a frame over its own limit by closing the transport mid-frame (the client
# sees a reset, not why); it reads frames up to this many times our limit so we can answer.
FRAME_READ_FACTOR = 4


class ChatSocket:
    """One websocket connection and the chats running on it."""

    def __init__(self, server: Server, ws: web.WebSocketResponse):
        self.server = server
        self.ws = ws
        self.chats: dict[ChatId, asyncio.Task[None]] = {}
        self._send_lock = asyncio.Lock()
        self._closing = False

    async def serve(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                    continue
                size = len(msg.data.encode() if msg.type == WSMsgType.TEXT else msg.data)
                if size > self.server.max_body_bytes:
                    await self.refuse_frame(size)
                elif msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                else:
                    await self.send_error(None, BadInputError("send JSON text frames"))
        finally:
            await self.cancel_all()

    async def on_text(self, data: str) -> None:
        try:
            msg = decode(data.encode(), WsChat | WsCancel)
        except BadInputError as exc:
            await self.send_error(_guess_id(data), exc)
            return
        if isinstance(msg, WsCancel):
            await self.cancel_chat(msg.id)
        elif msg.id in self.chats:
            await self.send_error(msg.id, BadInputError(f"chat {msg.id!r} is already running",
                                                        param="id", code="duplicate_id"))
        else:
            self.start_chat(msg)

    async def refuse_frame(self, size: int) -> None:
        limit = self.server.max_body_bytes
        await self.send_error(None, BadInputError(f"websocket frame of {size} bytes is over the "
                                                  f"limit of {limit} bytes", code="frame_too_large"))
        await self.ws.close(code=WSCloseCode.MESSAGE_TOO_BIG, message=b"frame too large")

    async def cancel_chat(self, chat_id: ChatId) -> None:
        task = self.chats.get(chat_id)
        if task is None:
            await self.send_error(chat_id, BadInputError(f"no chat {chat_id!r} is running",
                                                         param="id", code="unknown_id"))
            return
        # A task cancelled before its first step never enters run_chat's try (no `done`):
        # let it start first. Tasks start in the order they were made, so this is one yield.
        while _not_started(task):
            await asyncio.sleep(0)
        if not task.cancelling():  # a second cancel must not interrupt the first one's `done`
            task.cancel()

    def start_chat(self, msg: WsChat) -> None:
        task = asyncio.create_task(self.run_chat(msg))
        self.chats[msg.id] = task
        task.add_done_callback(lambda done: self._forget(msg.id, done))

    def _forget(self, chat_id: ChatId, task: asyncio.Task[None]) -> None:
        if self.chats.get(chat_id) is task:
            del self.chats[chat_id]

    async def run_chat(self, msg: WsChat) -> None:
        tracker = self.server.metrics.tracker("ws_chat")
        try:
            with tracker.guard():
                last = await self._stream_chat(msg, tracker)
            tracker.finish(last.finish_reason or "stop", last.usage)
            usage = UsageOut.of(last.usage) if last.usage is not None else None
            await self.send({"type": "done", "id": msg.id, "finish_reason": last.finish_reason,
                             "usage": usage})
        except asyncio.CancelledError:
            if self._closing:
                raise
            await self.send({"type": "done", "id": msg.id, "finish_reason": "cancelled",
                             "usage": None})
        except (BadInputError, QueueFullError) as exc:
            await self.send_error(msg.id, exc)
        except ConnectionResetError:
            pass  # the socket is gone; serve() cancels the rest
        except Exception as exc:
            log.exception("websocket chat %r failed", msg.id)
            await self.send_error(msg.id, exc)

    async def _stream_chat(self, msg: WsChat, tracker: Any) -> Delta:
        server = self.server
        server.check_model(msg.model)
        messages = [message.as_dict() for message in msg.messages]
        requested = msg.max_completion_tokens or msg.max_tokens
        default = server.chat_default_max_tokens(messages) if requested is None else 0
        params = msg.sampling_params(server.max_tokens_for(requested, default), None)
        last = Delta("", [], "stop")
        async with contextlib.aclosing(server.engine.chat(messages, params,
                                                          cache_salt=msg.cache_salt)) as deltas:
            async for delta in deltas:
                tracker.on_tokens(len(delta.token_ids))
                if delta.text:
                    await self.send({"type": "delta", "id": msg.id, "text": delta.text})
                last = delta
                if delta.finish_reason is not None:
                    break
        return last

    async def send(self, payload: dict[str, Any]) -> None:
        if self._closing or self.ws.closed:
            return
        async with self._send_lock:
            await self.ws.send_str(_encoder.encode(payload).decode())

    async def send_error(self, chat_id: ChatId | None, exc: Exception) -> None:
        await self.send({"type": "error", "id": chat_id, "error": _error_body(exc)})

    async def cancel_all(self) -> None:
        self._closing = True
        tasks = list(self.chats.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _not_started(task: asyncio.Task[None]) -> bool:
    coro = task.get_coro()
    return inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED


def _error_body(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, BadInputError):
        return {"message": exc.message, "type": "invalid_request_error", "param": exc.param,
                "code": exc.code or "invalid_value"}
    if isinstance(exc, QueueFullError):
        return {"message": str(exc) or "the request queue is full; retry later",
                "type": "rate_limit_error", "param": None, "code": "queue_full"}
    return {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
            "param": None, "code": "internal_error"}


def _guess_id(data: str) -> ChatId | None:
    """The `id` of a message that failed validation, so the client can match the error."""
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    chat_id = value.get("id") if isinstance(value, dict) else None
    return chat_id if isinstance(chat_id, str | int) and not isinstance(chat_id, bool) else None


async def chat_websocket(request: web.Request) -> web.WebSocketResponse:
    """GET /v1/chat/ws: upgrade and serve chats until the socket closes."""
    server = request.app[SERVER_KEY]
    server.check_origin(request)
    ws = web.WebSocketResponse(heartbeat=server.ws_heartbeat_s,
                               max_msg_size=FRAME_READ_FACTOR * server.max_body_bytes)
    await ws.prepare(request)
    server.websockets.add(ws)
    try:
        await ChatSocket(server, ws).serve()
    finally:
        server.websockets.discard(ws)
    return ws
