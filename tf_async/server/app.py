"""The aiohttp app: OpenAI-compatible HTTP + SSE, websocket chat, metrics, web chat page.

`create_app(engine)` builds it; `start_server(app, host, port)` serves it with handler
cancellation on, so a client that disconnects cancels its handler (and its request).
Every error leaves as the OpenAI error JSON; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import logging
import re
import secrets
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from ..api import check_context
from ..api_types import GrammarSpec, SamplingParams
from ..errors import BadInputError, QueueFullError
from .choices import ChoiceStreams
from .metrics import CONTENT_TYPE
from .protocol import JsonErrorRunner
from .reasoning import ReplyMode, reply_mode
from .responses import ResponseBuilder, ResponsesRequest, respond_responses, to_chat_request
from .schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorDetail,
    ErrorResponse,
    TokenizeRequest,
    message_dicts,
)
from .sse import ChatFormat, CompletionFormat, respond
from .state import SERVER_KEY, WS_HEARTBEAT_S, HttpError, Server
from .tool_grammar import tag_terms, text_parameters, tool_grammar
from .tools import ToolMode, build_tool_prompt, check_tools
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

    def choice_streams(self, prompts: list[list[int]], params: SamplingParams, n: int,
                       cache_salt: str | None = None) -> ChoiceStreams:
        """n engine streams per prompt; choice i of a prompt draws from for_choice(i);
        `cache_salt` (vLLM's field): prompt pages are shared only with the same salt."""
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        return ChoiceStreams([self.engine.stream(ids, params.for_choice(i, base_seed),
                                                 cache_salt=cache_salt)
                              for ids in prompts for i in range(n)], n)

    # ------------------------------------------------------------ generation routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tracker = self.metrics.tracker("completions")
        with tracker.guard():
            req = await self.read_json(request, CompletionRequest)
            model = self.served_name(req.model)
            include_usage = req.include_usage()
            req.check_best_of()
            prompts = [self.engine.prompt_ids(prompt) for prompt in req.prompt_values()]
            max_tokens = self.max_tokens_for(req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
            for ids in prompts:
                check_context(len(ids), max_tokens, int(self.engine.ctx),
                              max_tokens_sent=req.max_tokens is not None)
            params = req.sampling_params(max_tokens, _engine_logprobs(req.logprobs))
            fmt = CompletionFormat(model, req.logprobs, self.decode_token, self.fingerprint)
            choices = self.choice_streams(prompts, params, req.n, req.cache_salt)
        return await respond(request, choices, fmt, tracker, stream=req.stream,
                             include_usage=include_usage)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        tracker = self.metrics.tracker("chat")
        with tracker.guard():
            req = await self.read_json(request, ChatRequest)
            model = self.served_name(req.model)
            include_usage = req.include_usage()
            choices, replies, num_logprobs = self.chat_choices(req)
            fmt = ChatFormat(model, num_logprobs, self.decode_token, self.fingerprint, replies)
        return await respond(request, choices, fmt, tracker, stream=req.stream,
                             include_usage=include_usage)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        tracker = self.metrics.tracker("responses")
        with tracker.guard():
            req = await self.read_json(request, ResponsesRequest)
            model = self.served_name(req.model)
            choices, replies, _ = self.chat_choices(to_chat_request(req))
            builder = ResponseBuilder(model, req, replies)
        return await respond_responses(request, choices, builder, tracker, stream=req.stream)

    def chat_choices(self, req: ChatRequest) -> tuple[ChoiceStreams, ReplyMode | None, int | None]:
        """The engine streams of a chat request's choices, how its replies are read, and
        the number of log-probs each token carries."""
        ids, replies, grammar = self.chat_prompt(req)
        if grammar is not None:  # a bad schema is named before any length check
            self.engine.check_grammar(grammar)
        requested = req.requested_max_tokens()
        ctx = int(self.engine.ctx)
        max_tokens = self.max_tokens_for(requested, max(1, ctx - len(ids)))
        check_context(len(ids), max_tokens, ctx, max_tokens_sent=requested is not None)
        num_logprobs = req.num_logprobs()
        params = req.sampling_params(max_tokens, _engine_logprobs(num_logprobs), grammar)
        return self.choice_streams([ids], params, req.n, req.cache_salt), replies, num_logprobs

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], ReplyMode | None, GrammarSpec | None]:
        """Prompt ids of a chat request, how its replies are read (reasoning, tool calls),
        and the grammar they must match (forced tool calls, else response_format)."""
        messages = req.message_dicts()
        tools = req.tool_dicts()
        grammar = req.response_format.grammar() if req.response_format is not None else None
        forced = req.forced_tool() if tools else None
        template_kwargs = req.template_kwargs()
        if grammar is not None or forced is not None:  # a constrained reply has no thinking
            template_kwargs.setdefault("enable_thinking", False)
        tokenizer = self.engine.tokenizer
        if not tools and not _has_tool_turns(messages):
            ids = self.engine.chat_ids(messages, template_kwargs=template_kwargs)
            return ids, self._reply_mode(ids, None), grammar
        check_tools(tools, forced)
        prompt = build_tool_prompt(messages, tools, forced, tokenizer.chat_template)
        ids = self.engine.chat_ids(prompt.messages, tools=prompt.tools, template_kwargs=template_kwargs)
        parallel = req.parallel_tool_calls is not False
        tool_grammar_spec = tool_grammar(tools, forced, parallel=parallel, fmt=prompt.fmt,
                                         tags=tag_terms(tokenizer.encode, tokenizer.is_special))
        mode = ToolMode(parallel, text_parameters(tools)) if tools else None
        return ids, self._reply_mode(ids, mode), tool_grammar_spec or grammar

    def _reply_mode(self, ids: list[int], tools: ToolMode | None) -> ReplyMode | None:
        tokenizer = self.engine.tokenizer
        return reply_mode(tokenizer.chat_template, tokenizer.decode(ids[-16:]), tools)

    # ------------------------------------------------------------ other routes

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list",
                              "data": [self._model_card(name) for name in self.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        return json_response(self._model_card(self.served_name(request.match_info["model"])))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "tf_async",
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


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


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
            "Access-Control-Allow-Headers": _allowed_headers(request),
            "Access-Control-Max-Age": "600"})
    return await handler(request)


def _allowed_headers(request: web.Request) -> str:
    """The preflight allows the headers it asks for (SDKs send x-stainless-*, openai-*)."""
    asked = request.headers.get("Access-Control-Request-Headers", "")
    names = ["Authorization", "Content-Type"] + [h.strip() for h in asked.split(",") if h.strip()]
    return ", ".join(dict.fromkeys(name for name in names if _HEADER_NAME.fullmatch(name)))


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


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
               model_name: str | list[str] | tuple[str, ...] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               ws_heartbeat_s: float = WS_HEARTBEAT_S) -> web.Application:
    """The aiohttp application serving `engine` (a started `tf_async.Engine`); `model_name`:
    the name(s) it answers to (the first is the one /v1/models lists first)."""
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[error_middleware, cors_middleware, auth_middleware])
    server = app[SERVER_KEY] = Routes(engine, api_key=api_key, cors_origin=cors_origin,
                                      model_name=model_name, max_body_bytes=max_body_bytes,
                                      ws_heartbeat_s=ws_heartbeat_s)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/v1/responses", server.responses)
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
