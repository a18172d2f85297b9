"""The front: one aiohttp app on the user's host/port passing requests through to the
replicas (SSE chunk by chunk as it arrives), with /health, /metrics and /v1/lanes over
all of them. The front speaks only the replicas' OpenAI HTTP API.

A client that leaves closes its upstream request (handler cancellation), so the replica
cancels the stream and frees its lane. A replica that dies mid-request ends the request
with an error: an SSE error event then `[DONE]`, or a 502 OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec
from aiohttp import web

from ..server.app import error_response, json_response
from ..server.schemas import ErrorDetail, ErrorResponse
from ..server.sse import DONE_EVENT, sse_event
from .affinity import RequestKeys, request_keys
from .fleet import ReplicaSet
from .fleet_metrics import RouterCounts, render_metrics, sum_lanes
from .ws_bridge import WsBridge

log = logging.getLogger("tf_async.serving")
# Response headers passed back from a replica (the rest are the front's own to set).
_PASSED_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering", "Retry-After",
                   "WWW-Authenticate", "Allow", "Access-Control-Allow-Origin", "Vary",
                   "Access-Control-Allow-Methods", "Access-Control-Allow-Headers",
                   "Access-Control-Max-Age")
REPLICA_HEADER = "X-TF-Replica"  # which replica answered (logs, tests)
_SENT_HEADERS = ("Authorization", "Content-Type", "Content-Encoding", "Accept", "Origin",
                 "Access-Control-Request-Method", "Access-Control-Request-Headers")


class NoReplicaError(Exception):
    """No replica is ready to take a request."""


class _ReplicaGone(Exception):
    """The chosen replica went down between choosing and connecting."""


def no_replica_response() -> web.Response:
    return error_response(503, "no replica is ready to serve; retry shortly",
                          code="no_replica_ready", headers={"Retry-After": "1"})


def lost_response(index: int) -> web.Response:
    return error_response(502, f"replica {index} failed while answering this request; "
                          "retry it", code="replica_failed")


def lost_sse_event(index: int) -> bytes:
    detail = ErrorDetail(f"replica {index} failed while streaming this reply; retry it",
                         "server_error", None, "replica_failed")
    return sse_event(ErrorResponse(detail)) + DONE_EVENT


class Front:
    """The routes of the front over one ReplicaSet."""

    def __init__(self, replicas: ReplicaSet, api_key: str | None = None,
                 cors_origin: str | None = None):
        self.replicas = replicas
        self.policy = replicas.policy
        self.api_key = api_key
        self.cors_origin = cors_origin

    # ------------------------------------------------------------ pass-through

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """Any request but the front's own routes: to the chosen replica and back."""
        body = await request.read()
        keys = request_keys(request.path, _json_object(body)) if body else RequestKeys()
        resent = False
        for _ in range(len(self.replicas.replicas) + 1):  # failed connects are retried
            index = self.policy.choose(keys.lookup)
            if index is None:
                break
            try:
                return await self._forward(request, body, index, keys)
            except (aiohttp.ClientConnectorError, _ReplicaGone):
                self.replicas.connect_failed(index)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # Closed before any answer: a kept-alive connection to a replica that has
                # since restarted on the same port looks just like this. Sent once more, on a
                # new connection (nothing reached the client yet); a second loss is final.
                if resent:
                    self.replicas.num_lost_streams[index] += 1
                    return lost_response(index)
                resent = True
            except aiohttp.ClientError:  # connected, then lost before any answer
                self.replicas.num_lost_streams[index] += 1
                return lost_response(index)
        self.replicas.num_no_replica += 1
        return no_replica_response()

    async def _forward(self, request: web.Request, body: bytes, index: int,
                       keys: RequestKeys) -> web.StreamResponse:
        url = self.replicas.replicas[index].url
        if url is None:
            raise _ReplicaGone
        self.policy.begin(index)
        try:
            async with self.replicas.http.request(
                    request.method, url + request.rel_url.path_qs, data=body or None,
                    headers=_sent_headers(request)) as upstream:
                self.replicas.num_routed[index] += 1
                if upstream.status < 300:
                    for key in keys.remember:
                        self.policy.remember(key, index)
                return await self._answer(request, upstream, index)
        finally:
            self.policy.end(index)

    async def _answer(self, request: web.Request, upstream: aiohttp.ClientResponse,
                      index: int) -> web.StreamResponse:
        self.replicas.track(index, upstream)
        try:
            if upstream.content_type == "text/event-stream":
                return await self._stream(request, upstream, index)
            try:
                payload = await upstream.read()
            except (aiohttp.ClientError, ConnectionError):
                self.replicas.num_lost_streams[index] += 1
                return lost_response(index)
            return web.Response(status=upstream.status, body=payload,
                                headers=_passed_headers(upstream, index))
        finally:
            self.replicas.untrack(index, upstream)

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse,
                      index: int) -> web.StreamResponse:
        """SSE passed through chunk by chunk; a replica failing mid-stream: error + [DONE]."""
        response = web.StreamResponse(status=upstream.status,
                                      headers=_passed_headers(upstream, index))
        await response.prepare(request)
        tail = b"\n\n"  # the last bytes passed on: is an event cut short?
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                tail = (tail + chunk)[-2:]
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            if isinstance(exc, aiohttp.ClientConnectionResetError) and _client_gone(request):
                raise ConnectionResetError("the client went away") from exc
            await self._end_lost_stream(response, index, tail)
            return response
        if not _ended_cleanly(upstream):  # closed by the replica's exit (fleet._on_down)
            await self._end_lost_stream(response, index, tail)
        return response

    async def _end_lost_stream(self, response: web.StreamResponse, index: int,
                               tail: bytes) -> None:
        self.replicas.num_lost_streams[index] += 1
        cut = b"" if tail == b"\n\n" else b"\n\n"  # end a half-passed event first
        with contextlib.suppress(ConnectionResetError):
            await response.write(cut + lost_sse_event(index))

    # ------------------------------------------------------------ the front's own routes

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        """/v1/chat/ws: each chat routed on its own; frames both ways (ws_bridge.py)."""
        self.check_origin(request)
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        await WsBridge(self.replicas, ws, _sent_headers(request), request.query_string).serve()
        return ws

    def check_origin(self, request: web.Request) -> None:
        """As a single server does (server/state.py): no cross-site websocket upgrades
        unless the origin is the allowed one (the replicas see no Origin from the front)."""
        origin = request.headers.get("Origin")
        if origin is None or origin == self.cors_origin or self.cors_origin == "*":
            return
        if urlsplit(origin).netloc != request.host:
            raise web.HTTPForbidden(reason=f"origin {origin} is not allowed")

    async def health(self, request: web.Request) -> web.Response:
        num_up = self.policy.num_up
        if num_up == 0:
            return no_replica_response()
        return json_response({"status": "ok", "replicas_ready": num_up,
                              "replicas": len(self.replicas.replicas)})

    async def metrics(self, request: web.Request) -> web.Response:
        self.check_key(request)
        texts = await self._gather(self.replicas.get_text, "/metrics")
        return web.Response(text=render_metrics(texts, RouterCounts.of(self.replicas)),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def lanes(self, request: web.Request) -> web.Response:
        self.check_key(request)
        answers = await self._gather(self.replicas.get_json, "/v1/lanes")
        return json_response(sum_lanes(answers, self.replicas))

    async def _gather(self, fetch: Any, path: str) -> dict[int, Any]:
        """`fetch(url + path)` on every replica that is up; failures are left out."""
        up = self.replicas.up_urls()
        results = await asyncio.gather(*(fetch(url + path) for _, url in up),
                                       return_exceptions=True)
        return {index: result for (index, _), result in zip(up, results, strict=True)
                if not isinstance(result, BaseException)}

    def check_key(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.query.get("api_key", "")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise web.HTTPUnauthorized(reason="missing or invalid API key")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}  # the replica answers the bad input
    return value if isinstance(value, dict) else {}


def _sent_headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _SENT_HEADERS if name in request.headers}


def _passed_headers(upstream: aiohttp.ClientResponse, index: int) -> dict[str, str]:
    """The replica's headers the client should see, and which replica answered."""
    headers = {name: upstream.headers[name] for name in _PASSED_HEADERS
               if name in upstream.headers}
    return headers | {REPLICA_HEADER: str(index)}


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _ended_cleanly(upstream: aiohttp.ClientResponse) -> bool:
    return upstream.content.is_eof() and upstream.content.exception() is None


@web.middleware
async def front_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """The front's own failures in the OpenAI error JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client left
    except Exception:
        log.exception("front fault on %s %s", request.method, request.path)
        return error_response(500, "internal server error (logged)", code="internal_error")


FRONT_KEY = web.AppKey("tf_async_front", Front)


def create_front_app(replicas: ReplicaSet, *, api_key: str | None = None,
                     cors_origin: str | None = None, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[front_errors])
    front = app[FRONT_KEY] = Front(replicas, api_key, cors_origin)
    app.router.add_get("/health", front.health)
    app.router.add_get("/metrics", front.metrics)
    app.router.add_get("/v1/lanes", front.lanes)
    app.router.add_get("/v1/chat/ws", front.websocket)
    app.router.add_route("*", "/{tail:.*}", front.proxy)
    return app
