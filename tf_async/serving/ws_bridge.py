"""Websocket chat through the front: each `chat` message is routed on its own (load and
prefix affinity), over one upstream websocket per replica used by this client socket.

Client -> replica: `chat` to the chosen replica, `cancel` to the replica running that id.
Replica -> client: every frame as it comes. A replica whose socket ends while chats are
open (it died) gives each of those ids an `error` message; a client that leaves closes
every upstream socket, so the replicas cancel its chats and free their lanes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, TypeGuard

import aiohttp
import msgspec
from aiohttp import WSMsgType, web

from .affinity import chat_keys
from .fleet import ReplicaSet

ChatId = str | int
_encoder = msgspec.json.Encoder()


def error_message(chat_id: object, message: str, code: str,
                  kind: str = "server_error") -> dict[str, Any]:
    return {"type": "error", "id": chat_id,
            "error": {"message": message, "type": kind, "param": None, "code": code}}


class WsBridge:
    """One client websocket and its upstream sockets (one per replica it has used)."""

    def __init__(self, replicas: ReplicaSet, ws: web.WebSocketResponse, headers: dict[str, str],
                 query_string: str = ""):
        self.replicas = replicas
        self.query = "?" + query_string if query_string else ""  # a browser's ?api_key=
        self.policy = replicas.policy
        self.ws = ws
        self.headers = {k: v for k, v in headers.items() if k == "Authorization"}
        self.upstreams: dict[int, aiohttp.ClientWebSocketResponse] = {}
        self.readers: dict[int, asyncio.Task[None]] = {}
        self.owner: dict[ChatId, int] = {}  # open chat id -> its replica
        self._send_lock = asyncio.Lock()

    async def serve(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.TEXT:
                    await self.on_text(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self.send(error_message(None, "send JSON text frames",
                                                  "invalid_value", "invalid_request_error"))
        finally:
            await self.close()

    async def on_text(self, data: str) -> None:
        frame = _decode(data)
        chat_id = frame.get("id")
        kind = frame.get("type")
        if _is_id(chat_id) and chat_id in self.owner:  # its cancel, or a duplicate id
            await self.to_replica(self.owner[chat_id], data)
        elif kind == "cancel" and _is_id(chat_id):
            await self.send(error_message(chat_id, f"no chat {chat_id!r} is running",
                                          "unknown_id", "invalid_request_error"))
        else:
            await self.start_chat(frame, chat_id, data)

    async def start_chat(self, frame: dict[str, Any], chat_id: object, data: str) -> None:
        """Route a chat (or a frame the replica will refuse) and send it upstream."""
        keys = chat_keys(frame) if frame.get("type") == "chat" else None
        for _ in range(len(self.replicas.replicas)):
            index = self.policy.choose(keys.lookup if keys else ())
            if index is None:
                break
            upstream = await self.upstream(index)
            if upstream is None:
                continue
            if keys is not None and _is_id(chat_id):
                self.owner[chat_id] = index
                self.policy.begin(index)
                self.replicas.num_routed[index] += 1
                for key in keys.remember:
                    self.policy.remember(key, index)
            await self.to_replica(index, data)
            return
        self.replicas.num_no_replica += 1
        await self.send(error_message(chat_id, "no replica is ready to serve; retry shortly",
                                      "no_replica_ready"))

    async def upstream(self, index: int) -> aiohttp.ClientWebSocketResponse | None:
        """This client's socket to replica `index`, opened on first use; None if refused."""
        if index in self.upstreams:
            return self.upstreams[index]
        url = self.replicas.replicas[index].url
        if url is None:
            self.replicas.connect_failed(index)
            return None
        try:
            ws = await self.replicas.http.ws_connect(url + "/v1/chat/ws" + self.query, headers=self.headers,
                                                     heartbeat=30.0)
        except (aiohttp.ClientError, ConnectionError):
            self.replicas.connect_failed(index)
            return None
        self.upstreams[index] = ws
        self.readers[index] = asyncio.create_task(self.read_replica(index, ws))
        return ws

    async def to_replica(self, index: int, data: str) -> None:
        ws = self.upstreams.get(index)
        if ws is not None and not ws.closed:
            with contextlib.suppress(ConnectionError):
                await ws.send_str(data)

    async def read_replica(self, index: int, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Frames of replica `index` to the client; when its socket ends, an error for
        each chat still open there."""
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                frame = _decode(msg.data)
                if frame.get("type") in ("done", "error"):
                    self.forget(frame.get("id"), index)
                await self.send_text(msg.data)
        finally:
            self.upstreams.pop(index, None)
            await self.fail_open_chats(index)

    async def fail_open_chats(self, index: int) -> None:
        for chat_id in [cid for cid, owner in self.owner.items() if owner == index]:
            self.forget(chat_id, index)
            self.replicas.num_lost_streams[index] += 1
            await self.send(error_message(chat_id, f"replica {index} failed while answering "
                                          "this chat; retry it", "replica_failed"))

    def forget(self, chat_id: object, index: int) -> None:
        if _is_id(chat_id) and self.owner.get(chat_id) == index:
            del self.owner[chat_id]
            self.policy.end(index)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.send_text(_encoder.encode(payload).decode())

    async def send_text(self, text: str) -> None:
        if self.ws.closed:
            return
        async with self._send_lock:
            with contextlib.suppress(ConnectionError):
                await self.ws.send_str(text)

    async def close(self) -> None:
        """The client left: close every upstream socket (the replicas cancel its chats)."""
        for chat_id, index in list(self.owner.items()):
            self.forget(chat_id, index)
        for task in self.readers.values():
            task.cancel()
        for ws in list(self.upstreams.values()):
            await ws.close()
        await asyncio.gather(*self.readers.values(), return_exceptions=True)


def _decode(data: str) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _is_id(value: object) -> TypeGuard[ChatId]:
    return isinstance(value, str | int) and not isinstance(value, bool)
