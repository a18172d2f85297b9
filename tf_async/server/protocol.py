"""aiohttp's connection layer, made to answer a client's malformed bytes like the app does.

What aiohttp's HTTP parser refuses before any handler runs (a bad Content-Length, an
over-long URL or header, an unknown Content-Encoding, a bad chunk) is answered by its
connection handler in plain text, with a traceback in the log. Here those answers are the
OpenAI error JSON, and a client's malformed bytes are logged in one line: they are not
faults of the server. (Bytes that are not HTTP at all get the same 400 JSON.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from .schemas import ErrorDetail, ErrorResponse

log = logging.getLogger("tf_async.server")
CLIENT_FAULTS = (HttpProcessingError, web.RequestPayloadError)
MAX_REASON_CHARS = 200


def client_fault_reason(exc: BaseException) -> str:
    """One line saying what was wrong with the client's bytes."""
    cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) else exc
    text = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
    return " ".join(str(text).split())[:MAX_REASON_CHARS] or type(exc).__name__


class JsonErrorHandler(RequestHandler):
    """One connection; parser errors answered as the OpenAI error JSON."""

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        self.log_exception("bad request from %s", request.remote, exc_info=exc)
        detail = ErrorDetail(f"bad HTTP request: {client_fault_reason(exc)}",
                             "invalid_request_error", None, "bad_http_request")
        response = web.Response(status=status, body=msgspec.json.encode(ErrorResponse(detail)),
                                content_type="application/json")
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, CLIENT_FAULTS):
            log.info("%s: %s", args[0] % args[1:], client_fault_reason(exc))
            return
        super().log_exception(*args, **kwargs)


class JsonErrorServer(web.Server):
    """aiohttp's low-level server, making JsonErrorHandler connections."""

    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=asyncio.get_running_loop(), **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """web.AppRunner whose server is a JsonErrorServer (same app, same settings)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts the app
        return JsonErrorServer(server.request_handler, request_factory=server.request_factory,
                               handler_cancellation=server.handler_cancellation,
                               **server._kwargs)
