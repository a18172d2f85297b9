"""Server-sent events for /v1/completions and /v1/chat/completions, and the OpenAI shapes.

The engine pushes deltas into a per-request queue; this handler pulls them and writes,
so a slow reader only slows its own handler (`write` waits for the socket to drain).
A client that goes away (write raises ConnectionResetError, or aiohttp cancels the
handler) closes the engine stream, which cancels the request and frees its lane.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from aiohttp import web

from ..api_types import Completion, Delta
from .metrics import RequestTracker
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatResponse,
    ChunkDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    UsageOut,
    chat_logprobs,
    completion_logprobs,
)

log = logging.getLogger("tf_async.server")

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # no proxy buffering of the stream
}
DONE_EVENT = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class OutputFormat:
    """Turns engine deltas / completions into one endpoint's OpenAI shapes."""

    id_prefix = "cmpl-"

    def __init__(self, model: str, num_logprobs: int | None, decode_token: Callable[[int], str]):
        self.id = self.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.num_logprobs = num_logprobs
        self.decode_token = decode_token

    def first_chunk(self) -> msgspec.Struct | None:
        return None

    def chunk(self, delta: Delta) -> msgspec.Struct:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageOut) -> msgspec.Struct:
        raise NotImplementedError

    def full(self, completion: Completion) -> msgspec.Struct:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    id_prefix = "cmpl-"

    def __init__(self, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._text_offset = 0

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None):
        if self.num_logprobs is None or entries is None:
            return None
        out = completion_logprobs(token_ids, entries, self.num_logprobs, self.decode_token,
                                  self._text_offset)
        self._text_offset = out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else self._text_offset
        return out

    def chunk(self, delta: Delta) -> CompletionResponse:
        choice = CompletionChoice(0, delta.text, self._logprobs(delta.token_ids, delta.logprobs),
                                  delta.finish_reason)
        return CompletionResponse(self.id, "text_completion", self.created, self.model, [choice])

    def usage_chunk(self, usage: UsageOut) -> CompletionResponse:
        return CompletionResponse(self.id, "text_completion", self.created, self.model, [], usage=usage)

    def full(self, completion: Completion) -> CompletionResponse:
        choice = CompletionChoice(0, completion.text,
                                  self._logprobs(completion.token_ids, completion.logprobs),
                                  completion.finish_reason)
        return CompletionResponse(self.id, "text_completion", self.created, self.model, [choice],
                                  usage=UsageOut.of(completion.usage))


class ChatFormat(OutputFormat):
    id_prefix = "chatcmpl-"

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None):
        if self.num_logprobs is None or entries is None:
            return None
        return chat_logprobs(token_ids, entries, self.num_logprobs, self.decode_token)

    def first_chunk(self) -> ChatChunk:
        choice = ChatChunkChoice(0, ChunkDelta(role="assistant", content=""))
        return ChatChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice])

    def chunk(self, delta: Delta) -> ChatChunk:
        content = delta.text if delta.text or delta.finish_reason is None else None
        choice = ChatChunkChoice(0, ChunkDelta(content=content),
                                 self._logprobs(delta.token_ids, delta.logprobs),
                                 delta.finish_reason)
        return ChatChunk(self.id, "chat.completion.chunk", self.created, self.model, [choice])

    def usage_chunk(self, usage: UsageOut) -> ChatChunk:
        return ChatChunk(self.id, "chat.completion.chunk", self.created, self.model, [], usage=usage)

    def full(self, completion: Completion) -> ChatResponse:
        choice = ChatChoice(0, AssistantMessage(completion.text),
                            self._logprobs(completion.token_ids, completion.logprobs),
                            completion.finish_reason)
        return ChatResponse(self.id, "chat.completion", self.created, self.model, [choice],
                            UsageOut.of(completion.usage))


async def stream_sse(
    request: web.Request, deltas: AsyncIterator[Delta], fmt: OutputFormat,
    tracker: RequestTracker, include_usage: bool,
) -> web.StreamResponse:
    """Stream `deltas` as SSE. Bad input / a full queue surface from the first delta,
    before any header is sent, so they still become a 400 / 429."""
    async with contextlib.aclosing(deltas):  # type: ignore[type-var]
        with tracker.guard():
            first = await anext(deltas)
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        try:
            with tracker.guard():
                await response.prepare(request)
                last = await _write_deltas(response, first, deltas, fmt, tracker)
            tracker.finish(last.finish_reason or "stop", last.usage)
            if include_usage and last.usage is not None:
                await response.write(sse_event(fmt.usage_chunk(UsageOut.of(last.usage))))
            await response.write(DONE_EVENT)
        except ConnectionResetError:
            return response  # the client went away; aclosing() cancelled the request
        except Exception as exc:  # a real fault mid-stream: status is sent, report in-band
            log.exception("stream %s failed", fmt.id)
            await _write_error(response, exc)
    return response


async def _write_deltas(
    response: web.StreamResponse, first: Delta, deltas: AsyncIterator[Delta],
    fmt: OutputFormat, tracker: RequestTracker,
) -> Delta:
    opening = fmt.first_chunk()
    if opening is not None:
        await response.write(sse_event(opening))
    delta = first
    while True:
        tracker.on_tokens(len(delta.token_ids))
        if delta.text or delta.finish_reason is not None or delta.logprobs:
            await response.write(sse_event(fmt.chunk(delta)))
        if delta.finish_reason is not None:
            return delta
        following = await anext(deltas, None)
        if following is None:  # the engine ended without a final delta: treat as stop
            return Delta("", [], "stop", None, delta.usage)
        delta = following


async def _write_error(response: web.StreamResponse, exc: Exception) -> None:
    detail = ErrorDetail(f"internal error: {type(exc).__name__}: {exc}", "server_error",
                         code="internal_error")
    with contextlib.suppress(ConnectionResetError):
        await response.write(sse_event(ErrorResponse(detail)))
        await response.write(DONE_EVENT)
