"""Ray Serve for a cluster: N engine replica deployments and one OpenAI ingress.

    ray start --head                                   # on the head node
    ray start --address HEAD:6379                      # on each other node
    serve run tf_async.serving.ray_app:app_builder replicas=4 gpus=1 \\
        flags="--model /models/qwen3-8b --device cuda --parallel 16"

Each replica deployment (`tf_async_replica_<i>`, one Ray replica each, one GPU with
gpus=1) runs a full `tf_async.Engine` behind the project's own aiohttp app (server/app.py:
the same OpenAI routes, parsing and SSE) on the replica's loopback; the ingress routes each
request with the front's policy (policy.py: least loaded, prefix affinity) and streams
the replica's bytes back. The ingress is the project's routing, not Ray's: with one
deployment per engine, Ray's default power-of-two-choices router has nothing to choose.
Websockets are not served through Ray (use `tf-async serve --replicas N` on one host).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..server.app import start_server
from ..server.schemas import ErrorDetail, ErrorResponse
from .affinity import request_keys
from .fleet_metrics import RouterCounts, merge_lanes, render_metrics, router_view
from .front import lost_sse_event
from .policy import RoutingPolicy

POLL_INTERVAL_S = 0.5
_PASSED_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after")
_encoder = msgspec.json.Encoder()


class EngineReplica:
    """One engine and the project's OpenAI app on this replica's loopback."""

    def __init__(self, flags: list[str]):
        self._flags = flags
        self._lock = asyncio.Lock()
        self._url: str | None = None
        self._engine: Any = None
        self._http: aiohttp.ClientSession | None = None

    async def _started(self) -> tuple[str, aiohttp.ClientSession]:
        async with self._lock:
            if self._url is None or self._http is None:
                from ..server.app import create_app
                from ..server.cli import engine_from_args, serve_parser

                args = serve_parser().parse_args(self._flags)
                self._engine = await engine_from_args(args).start()
                if args.warmup:
                    await self._engine.warm_up()
                app = create_app(self._engine, model_name=args.served_model_name,
                                 max_body_bytes=args.max_body_bytes)
                _, port = await start_server(app, "127.0.0.1", 0)
                self._url = f"http://127.0.0.1:{port}"
                self._http = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False,
                    connector=aiohttp.TCPConnector(force_close=True))
        return self._url, self._http

    async def request(self, method: str, path_qs: str, headers: dict[str, str],
                      body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:
        """The status and headers first, then the body chunk by chunk as it arrives;
        closing this generator (the client left) closes the request, which cancels it."""
        url, http = await self._started()
        async with http.request(method, url + path_qs, data=body or None,
                                headers=headers) as resp:
            yield {"status": resp.status, "headers": {
                k: v for k, v in resp.headers.items() if k.lower() in _PASSED_HEADERS}}
            async for chunk in resp.content.iter_any():
                yield chunk

    async def stats(self) -> dict[str, Any]:
        await self._started()
        return dict(self._engine.stats())

    async def lanes(self) -> dict[str, Any]:
        await self._started()
        return {"data": self._engine.lanes(), "stats": dict(self._engine.stats())}

    async def metrics_text(self) -> str:
        url, http = await self._started()
        async with http.get(url + "/metrics") as resp:
            return await resp.text()


class OpenAIIngress:
    """The HTTP entry: routes each request to one replica deployment with RoutingPolicy."""

    def __init__(self, *replicas: DeploymentHandle):
        self.handles = list(replicas)
        self.policy = RoutingPolicy(len(self.handles))
        for index in range(len(self.handles)):
            self.policy.mark_up(index)
        self.num_routed = [0] * len(self.handles)
        self.num_lost = [0] * len(self.handles)
        self.num_no_replica = 0
        self._poller: asyncio.Task[None] | None = None

    async def __call__(self, request: Request) -> Response:
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever())
        path = request.url.path
        if path == "/health":
            return self._health()
        if path == "/metrics":
            return await self._metrics()
        if path == "/v1/lanes":
            return await self._lanes()
        return await self._proxy(request, path)

    async def _proxy(self, request: Request, path: str) -> Response:
        body = await request.body()
        keys = request_keys(path, _json_object(body))
        index = self.policy.choose(keys.lookup)
        if index is None:
            self.num_no_replica += 1
            return _error(503, "no replica is ready to serve; retry shortly", "no_replica_ready")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "accept")}
        path_qs = path + (f"?{request.url.query}" if request.url.query else "")
        self.policy.begin(index)
        try:
            chunks = self.handles[index].options(stream=True).request.remote(
                request.method, path_qs, headers, body)
            assert isinstance(chunks, DeploymentResponseGenerator)  # stream=True
            head = await chunks.__anext__()
        except Exception:  # the replica's actor died or is restarting
            self.policy.end(index)
            self.policy.mark_down(index)
            self.num_lost[index] += 1
            return _error(502, f"replica {index} failed while answering this request; retry "
                          "it", "replica_failed")
        self.num_routed[index] += 1
        if head["status"] < 300:
            for key in keys.remember:
                self.policy.remember(key, index)
        return StreamingResponse(self._body(chunks, index, head), status_code=head["status"],
                                 headers=head["headers"] | {"X-TF-Replica": str(index)})

    async def _body(self, chunks: DeploymentResponseGenerator, index: int, head: dict[str, Any]) -> AsyncIterator[bytes]:
        sse = head["headers"].get("content-type", head["headers"].get("Content-Type", ""))
        try:
            async for chunk in chunks:
                yield chunk
        except Exception:
            self.num_lost[index] += 1
            self.policy.mark_down(index)
            if sse.startswith("text/event-stream"):
                yield b"\n\n" + lost_sse_event(index)
        finally:
            self.policy.end(index)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(i) for i in range(len(self.handles))))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll(self, index: int) -> None:
        try:
            stats = await self.handles[index].stats.remote()
        except Exception:
            self.policy.mark_down(index)
            return
        busy = int(stats.get("lanes_in_use", 0))
        self.policy.update_stats(index, busy, int(stats.get("lanes_total", 0)) - busy,
                                 int(stats.get("queued", 0)))
        self.policy.mark_up(index)

    def _health(self) -> Response:
        if self.policy.num_up == 0:
            return _error(503, "no replica is ready to serve; retry shortly", "no_replica_ready")
        return Response(_encoder.encode({"status": "ok", "replicas_ready": self.policy.num_up,
                                         "replicas": len(self.handles)}),
                        media_type="application/json")

    async def _lanes(self) -> Response:
        results = await asyncio.gather(*(h.lanes.remote() for h in self.handles),
                                       return_exceptions=True)
        answers = {i: a for i, a in enumerate(results) if isinstance(a, dict)}
        merged = merge_lanes(answers) | {"replicas": [
            router_view(self.policy, i) | {"replica": i, "stats": answers.get(i, {}).get("stats")}
            for i in range(len(self.handles))]}
        return Response(_encoder.encode(merged), media_type="application/json")

    async def _metrics(self) -> Response:
        results = await asyncio.gather(*(h.metrics_text.remote() for h in self.handles),
                                       return_exceptions=True)
        texts = {i: text for i, text in enumerate(results) if isinstance(text, str)}
        counts = RouterCounts(self.policy, tuple(self.num_routed), (0,) * len(self.handles),
                              tuple(self.num_lost), self.num_no_replica)
        return Response(render_metrics(texts, counts), media_type="text/plain; version=0.0.4")


def _json_object(body: bytes) -> dict[str, Any]:
    with contextlib.suppress(msgspec.DecodeError):
        value = msgspec.json.decode(body)
        return value if isinstance(value, dict) else {}
    return {}


def _error(status: int, message: str, code: str) -> Response:
    body = _encoder.encode(ErrorResponse(ErrorDetail(message, "server_error", None, code)))
    return Response(body, status_code=status, media_type="application/json",
                    headers={"Retry-After": "1"} if status == 503 else None)


def build_app(num_replicas: int, flags: list[str], gpus_per_replica: float = 0.0,
              cpus_per_replica: float = 1.0) -> Any:
    """The Ray Serve application: `num_replicas` engine deployments and the ingress."""
    options = {"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica}
    handles = [serve.deployment(name=f"tf_async_replica_{i}", num_replicas=1,
                                max_ongoing_requests=1024,
                                ray_actor_options=options)(EngineReplica).bind(flags)
               for i in range(num_replicas)]
    ingress = serve.deployment(name="tf_async_ingress", max_ongoing_requests=4096)(OpenAIIngress)
    return ingress.bind(*handles)


def app_builder(args: dict[str, str]) -> Any:
    """`serve run tf_async.serving.ray_app:app_builder replicas=N gpus=1 flags="..."`:
    `flags` are `tf-async serve` engine flags, read by the same parser as the CLI."""
    return build_app(int(args.get("replicas", "2")), shlex.split(args.get("flags", "")),
                     float(args.get("gpus", "0")), float(args.get("cpus", "1")))
