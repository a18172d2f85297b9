"""The state behind one app's routes (engine, settings, metrics, open websockets) and the
request checks the HTTP routes (app.py) and the websocket (ws.py) share."""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from ..errors import BadInputError
from .metrics import ServerMetrics
from .protocol import client_fault_reason
from .schemas import decode

WS_HEARTBEAT_S = 30.0  # websocket ping interval; a client that misses a pong is dropped
READABLE_ENCODINGS = ("", "identity", "gzip", "x-gzip", "deflate")  # aiohttp decodes these

class HttpError(BadInputError):
    """Bad input answered with a status other than 400 (401, 403, 404, 413, 415)."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, param=param, code=code)
        self.status = status
        self.headers = headers or {}


class Server:
    """The state behind the routes: engine, settings and metrics of one app."""

    def __init__(self, engine: Any, *, api_key: str | None, cors_origin: str | None,
                 model_name: str | list[str] | tuple[str, ...] | None, max_body_bytes: int,
                 ws_heartbeat_s: float = WS_HEARTBEAT_S):
        self.engine = engine
        self.api_key = api_key
        self.cors_origin = cors_origin
        names = [model_name] if isinstance(model_name, str) else list(model_name or ())
        self.model_names = tuple(names) or (getattr(engine, "model_name", None) or "tf-async",)
        self.model_name = self.model_names[0]
        self.fingerprint = _fingerprint(str(getattr(engine, "model_name", self.model_name)))
        self.max_body_bytes = max_body_bytes
        self.ws_heartbeat_s = ws_heartbeat_s
        self.metrics = ServerMetrics(engine.stats)
        self.websockets: set[web.WebSocketResponse] = set()

    # ------------------------------------------------------------ request checks

    def authorized(self, request: web.Request) -> bool:
        """Bearer key in constant time; browsers (page, websocket) may pass ?api_key=."""
        assert self.api_key is not None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" and request.method == "GET":
            token = request.query.get("api_key", "")
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def check_model(self, name: str | None) -> None:
        """`model` is only ever compared with the served names, never used as a path."""
        self.served_name(name)

    def served_name(self, name: str | None) -> str:
        """The served name (or alias, --served-model-name) a request asked for; the first
        name when it gave none."""
        if not name:
            return self.model_name
        if name not in self.model_names:
            served = ", ".join(f"`{n}`" for n in self.model_names)
            raise HttpError(404, f"The model `{name}` does not exist; this server serves {served}.",
                            code="model_not_found", param="model")
        return name

    def check_origin(self, request: web.Request) -> None:
        """Refuse cross-site websocket upgrades unless the origin is the allowed one."""
        origin = request.headers.get("Origin")
        if origin is None or origin == self.cors_origin or self.cors_origin == "*":
            return
        if urlsplit(origin).netloc != request.host:
            raise HttpError(403, f"origin {origin} is not allowed", code="origin_not_allowed")

    async def read_json(self, request: web.Request, kind: type[Any]) -> Any:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise HttpError(413, f"request body over {self.max_body_bytes} bytes",
                            code="request_too_large")
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in READABLE_ENCODINGS:  # aiohttp would pass the body on undecoded
            raise HttpError(415, f"Content-Encoding {encoding!r} is not supported (send gzip, "
                            f"deflate or none)", code="unsupported_content_encoding")
        if request.content_type != "application/json":
            raise HttpError(415, f"Content-Type must be application/json, not "
                            f"{request.content_type}", code="unsupported_media_type")
        try:
            return decode(await request.read(), kind)
        except (web.RequestPayloadError, BadInputError) as exc:
            if _client_gone(request):  # a body cut short by a client that left: a disconnect
                raise ConnectionResetError("the client went away while sending the body") from exc
            if isinstance(exc, BadInputError):
                raise
            raise BadInputError(f"cannot read the request body: {client_fault_reason(exc)}",
                                code="invalid_body") from None

    def max_tokens_for(self, requested: int | None, default: int) -> int:
        ctx = int(self.engine.ctx)
        if requested is not None and requested > ctx:
            raise BadInputError(f"max_tokens={requested} is more than the context ({ctx} tokens)",
                                param="max_tokens", code="max_tokens_too_large")
        return requested if requested is not None else default

    def chat_default_max_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Chats default to what is left of the context after the prompt."""
        return max(1, int(self.engine.ctx) - len(self.chat_prompt_ids(messages)))

    def chat_prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.engine.chat_ids(messages))

    def decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _fingerprint(model_name: str) -> str:
    """`system_fingerprint`: changes when the served model or the tf_async version does."""
    try:
        version = importlib.metadata.version("tf_async")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    digest = hashlib.sha256(f"{model_name}|{version}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


SERVER_KEY = web.AppKey("tf_async_server", Server)
