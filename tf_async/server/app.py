"""The aiohttp app: OpenAI-compatible HTTP + SSE, websocket chat, metrics, web chat page.

`create_app(engine)` builds it; `start_server(app, host, port)` serves it with handler
cancellation on, so a client that disconnects cancels its handler (and its request).
Every error leaves as the OpenAI error JSON; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from ..errors import BadInputError, QueueFullError
from .metrics import CONTENT_TYPE
from .protocol import JsonErrorRunner
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorDetail,
    ErrorResponse,
    TokenizeRequest,
    message_dicts,
)
from .sse import ChatFormat, CompletionFormat, stream_sse
from .state import SERVER_KEY, WS_HEARTBEAT_S, HttpError, Server
from .ws import chat_websocket

log = logging.getLogger("tf_async.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint
STATIC_DIR = Path(__file__).parent / "static"
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}
_encoder = msgspec.json.Encoder()


def error_response(status: int, message: str, *, code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """The OpenAI error JSON `{"error": {"message", "type", "param", "code"}}`."""
    err_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = _encoder.encode(ErrorResponse(ErrorDetail(message, err_type, param, code)))
    return web.Response(status=status, body=body, content_type="application/json",
                        headers=headers)


def json_response(payload: Any) -> web.Response:
    return web.Response(body=_encoder.encode(payload), content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as exc:
        return error_response(exc.status, exc.message, code=exc.code, param=exc.param,
                              headers=exc.headers)
    except BadInputError as exc:
        return error_response(400, exc.message, param=exc.param, code=exc.code or "invalid_value")
    except QueueFullError as exc:
        return error_response(429, str(exc) or "the request queue is full; retry later",
                              code="queue_full", headers={"Retry-After": "1"})
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        return error_response(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"),
                              headers=headers)
    except Exception:
        log.exception("internal fault on %s %s", request.method, request.path)
        return error_response(500, "internal server error (logged)", code="internal_error")


class Routes(Server):
    """The routes of one app, on its Server state."""

    # ------------------------------------------------------------ generation routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tracker = self.metrics.tracker("completions")
        with tracker.guard():
            req = await self.read_json(request, CompletionRequest)
            self.check_model(req.model)
            prompt = req.prompt_value()
            max_tokens = self.max_tokens_for(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
            kwargs = req.engine_kwargs(max_tokens, _engine_logprobs(req.logprobs))
            fmt = CompletionFormat(self.model_name, req.logprobs, self.decode_token)
            if req.stream:
                deltas = self.engine.stream(prompt, **kwargs)
        if req.stream:
            return await stream_sse(request, deltas, fmt, tracker, _include_usage(req))
        with tracker.guard():
            completion = await self.engine.complete(prompt, **kwargs)
        tracker.finish(completion.finish_reason, completion.usage)
        return json_response(fmt.full(completion))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        tracker = self.metrics.tracker("chat")
        with tracker.guard():
            req = await self.read_json(request, ChatRequest)
            self.check_model(req.model)
            messages = req.message_dicts()
            requested = req.requested_max_tokens()
            default = self.chat_default_max_tokens(messages) if requested is None else 0
            num_logprobs = req.num_logprobs()
            kwargs = req.engine_kwargs(self.max_tokens_for(requested, default),
                                       _engine_logprobs(num_logprobs))
            fmt = ChatFormat(self.model_name, num_logprobs, self.decode_token)
            if req.stream:
                deltas = self.engine.chat(messages, **kwargs)
        if req.stream:
            return await stream_sse(request, deltas, fmt, tracker, _include_usage(req))
        with tracker.guard():
            completion = await self.engine.chat_complete(messages, **kwargs)
        tracker.finish(completion.finish_reason, completion.usage)
        return json_response(fmt.full(completion))

    # ------------------------------------------------------------ other routes

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self.check_model(request.match_info["model"])
        return json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tf_async",
                "max_model_len": int(self.engine.ctx)}

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def lanes(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": self.engine.lanes(),
                              "stats": self.engine.stats()})

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self.read_json(request, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadInputError("give exactly one of `prompt` and `messages`", param="prompt")
        tokenizer = self.engine.tokenizer
        if req.prompt is not None:  # the ids a completion of this prompt would start from
            tokens = list(tokenizer.encode(req.prompt,
                                           add_special_tokens=getattr(tokenizer, "add_bos", False)))
        else:
            text = tokenizer.apply_chat_template(message_dicts(req.messages or []),
                                                 add_generation_prompt=req.add_generation_prompt)
            tokens = list(tokenizer.encode(text))
        return json_response({"tokens": tokens, "count": len(tokens),
                              "max_model_len": int(self.engine.ctx)})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await self.read_json(request, DetokenizeRequest)
        self.check_model(req.model)
        vocab_size = getattr(self.engine.tokenizer, "vocab_size", None)
        if vocab_size is not None and any(tok >= vocab_size for tok in req.tokens):
            raise BadInputError(f"token ids must be below the vocabulary size {vocab_size}",
                                param="tokens")
        return json_response({"prompt": self.engine.tokenizer.decode(req.tokens)})

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def favicon(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "favicon.svg",
                                headers={"Content-Type": "image/svg+xml"})


def _include_usage(req: CompletionRequest | ChatRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _engine_logprobs(num_logprobs: int | None) -> int | None:
    # The engine always includes the chosen token; ask for at least one alternative.
    return None if num_logprobs is None else max(1, num_logprobs)


_OPEN_PATHS = ("/health", "/favicon.ico", "/favicon.svg")


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    server = request.app[SERVER_KEY]
    if server.api_key is None or request.path in _OPEN_PATHS or request.method == "OPTIONS":
        return await handler(request)
    if not server.authorized(request):
        raise HttpError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


@web.middleware
async def cors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer preflights only when --cors-origin is set; otherwise no CORS at all."""
    origin = request.app[SERVER_KEY].cors_origin
    if origin is not None and request.method == "OPTIONS":
        return web.Response(status=204, headers=_cors_headers(origin) | {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600"})
    return await handler(request)


def _cors_headers(origin: str) -> dict[str, str]:
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


async def _add_cors(request: web.Request, response: web.StreamResponse) -> None:
    origin = request.app[SERVER_KEY].cors_origin
    if origin is not None:
        response.headers.update(_cors_headers(origin))


async def _close_websockets(app: web.Application) -> None:
    for ws in list(app[SERVER_KEY].websockets):
        await ws.close(code=1001, message=b"server shutdown")


def create_app(engine: Any, *, api_key: str | None = None, cors_origin: str | None = None,
               model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               ws_heartbeat_s: float = WS_HEARTBEAT_S) -> web.Application:
    """The aiohttp application serving `engine` (a started `tf_async.Engine`)."""
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[error_middleware, cors_middleware, auth_middleware])
    server = app[SERVER_KEY] = Routes(engine, api_key=api_key, cors_origin=cors_origin,
                                      model_name=model_name, max_body_bytes=max_body_bytes,
                                      ws_heartbeat_s=ws_heartbeat_s)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model}", server.model)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics_text)
    app.router.add_get("/v1/lanes", server.lanes)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)
    app.router.add_get("/v1/chat/ws", chat_websocket)
    app.router.add_get("/", server.index)
    app.router.add_get("/favicon.ico", server.favicon)  # browsers ask for it: no 404
    app.router.add_get("/favicon.svg", server.favicon)
    app.on_response_prepare.append(_add_cors)
    app.on_shutdown.append(_close_websockets)
    return app


async def start_server(app: web.Application, host: str = "127.0.0.1",
                       port: int = 8000) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 = an ephemeral port); returns the runner and the port.
    A client's malformed HTTP is answered as the OpenAI error JSON (server/protocol.py)."""
    runner = JsonErrorRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])
