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
from collections.abc import Callable

import msgspec
from aiohttp import web

from ..api_types import Completion, Delta, Usage
from .choices import ChoiceStreams
from .metrics import RequestTracker
from .reasoning import ReplyMode, ReplyParser
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatResponse,
    ChunkDelta,
    ChunkFunction,
    ChunkToolCall,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    FunctionOut,
    ToolCallOut,
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

    def __init__(self, model: str, num_logprobs: int | None, decode_token: Callable[[int], str],
                 fingerprint: str):
        self.id = self.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.num_logprobs = num_logprobs
        self.decode_token = decode_token
        self.fingerprint = fingerprint

    def first_chunk(self, index: int) -> msgspec.Struct | None:
        return None

    def chunk(self, index: int, delta: Delta) -> msgspec.Struct | None:
        raise NotImplementedError

    def chunks(self, index: int, delta: Delta) -> list[msgspec.Struct]:
        """The SSE events of one delta of choice `index` (none for an empty delta)."""
        chunk = self.chunk(index, delta)
        return [] if chunk is None else [chunk]

    def usage_chunk(self, usage: UsageOut) -> msgspec.Struct:
        raise NotImplementedError

    def full(self, completions: list[Completion], usage: Usage) -> msgspec.Struct:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    id_prefix = "cmpl-"

    def __init__(self, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._text_offsets: dict[int, int] = {}

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]] | None):
        if self.num_logprobs is None or entries is None:
            return None
        offset = self._text_offsets.get(index, 0)
        out = completion_logprobs(token_ids, entries, self.num_logprobs, self.decode_token, offset)
        self._text_offsets[index] = out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else offset
        return out

    def _response(self, choices: list[CompletionChoice], usage: UsageOut | None = None) -> CompletionResponse:
        return CompletionResponse(self.id, "text_completion", self.created, self.model,
                                  self.fingerprint, choices, usage=usage)

    def chunk(self, index: int, delta: Delta) -> CompletionResponse | None:
        if not (delta.text or delta.finish_reason is not None or delta.logprobs):
            return None
        return self._response([CompletionChoice(
            index, delta.text, self._logprobs(index, delta.token_ids, delta.logprobs), delta.finish_reason)])

    def usage_chunk(self, usage: UsageOut) -> CompletionResponse:
        return self._response([], usage)

    def full(self, completions: list[Completion], usage: Usage) -> CompletionResponse:
        choices = [CompletionChoice(i, c.text, self._logprobs(i, c.token_ids, c.logprobs), c.finish_reason)
                   for i, c in enumerate(completions)]
        return self._response(choices, UsageOut.of(usage))


class ChatFormat(OutputFormat):
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, num_logprobs: int | None, decode_token: Callable[[int], str],
                 fingerprint: str, replies: ReplyMode | None = None):
        super().__init__(model, num_logprobs, decode_token, fingerprint)
        self.replies = replies
        self._parsers: dict[int, ReplyParser] = {}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None):
        if self.num_logprobs is None or entries is None:
            return None
        return chat_logprobs(token_ids, entries, self.num_logprobs, self.decode_token)

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageOut | None = None) -> ChatChunk:
        return ChatChunk(self.id, "chat.completion.chunk", self.created, self.model,
                         self.fingerprint, choices, usage=usage)

    def first_chunk(self, index: int) -> ChatChunk:
        return self._chunk([ChatChunkChoice(index, ChunkDelta(role="assistant", content=""))])

    def chunks(self, index: int, delta: Delta) -> list[msgspec.Struct]:
        if self.replies is None:
            return super().chunks(index, delta)
        parser = self._parser(index)
        final = delta.finish_reason is not None
        reasoning, content, calls = parser.feed(delta.text, final)
        out: list[msgspec.Struct] = []
        logprobs = self._logprobs(delta.token_ids, delta.logprobs)
        if content or reasoning or logprobs is not None:
            piece = ChunkDelta(content=content or None, reasoning_content=reasoning or None)
            out.append(self._chunk([ChatChunkChoice(index, piece, logprobs)]))
        first = len(parser.calls) - len(calls)
        for number, call in enumerate(calls, first):
            opening = ChunkToolCall(number, ChunkFunction(call.name, ""), call.id, "function")
            arguments = ChunkToolCall(number, ChunkFunction(arguments=call.arguments))
            out += [self._chunk([ChatChunkChoice(index, ChunkDelta(tool_calls=[piece]))])
                    for piece in (opening, arguments)]
        if final:
            reason = _finish_reason(delta.finish_reason, parser)
            out.append(self._chunk([ChatChunkChoice(index, ChunkDelta(), None, reason)]))
        return out

    def chunk(self, index: int, delta: Delta) -> ChatChunk | None:
        if not (delta.text or delta.finish_reason is not None or delta.logprobs):
            return None
        content = delta.text if delta.text or delta.finish_reason is None else None
        return self._chunk([ChatChunkChoice(index, ChunkDelta(content=content),
                                            self._logprobs(delta.token_ids, delta.logprobs),
                                            delta.finish_reason)])

    def _parser(self, index: int) -> ReplyParser:
        assert self.replies is not None
        if index not in self._parsers:
            self._parsers[index] = ReplyParser(self.replies)
        return self._parsers[index]

    def usage_chunk(self, usage: UsageOut) -> ChatChunk:
        return self._chunk([], usage)

    def full(self, completions: list[Completion], usage: Usage) -> ChatResponse:
        choices = [ChatChoice(i, *self._message(i, c), self._logprobs(c.token_ids, c.logprobs))
                   for i, c in enumerate(completions)]
        return ChatResponse(self.id, "chat.completion", self.created, self.model, self.fingerprint,
                            choices, UsageOut.of(usage))

    def _message(self, index: int, completion: Completion) -> tuple[AssistantMessage, str]:
        if self.replies is None:
            return AssistantMessage(completion.text, "assistant"), completion.finish_reason
        parser = self._parser(index)
        _, content, _ = parser.feed(completion.text, final=True)
        calls = [ToolCallOut(c.id, "function", FunctionOut(c.name, c.arguments)) for c in parser.calls]
        message = AssistantMessage(content if content or not calls else None, "assistant",
                                   calls or None, parser.reasoning or None)
        return message, _finish_reason(completion.finish_reason, parser)


def _finish_reason(reason: str | None, parser: ReplyParser) -> str:
    """"tool_calls" when the reply ended by itself after calls (OpenAI's reason)."""
    return "tool_calls" if parser.calls and reason == "stop" else (reason or "stop")


async def respond(request: web.Request, choices: ChoiceStreams, fmt: OutputFormat,
                  tracker: RequestTracker, *, stream: bool, include_usage: bool) -> web.StreamResponse:
    """The whole answer to a generation request: SSE when `stream`, else one JSON body."""
    if stream:
        return await stream_sse(request, choices, fmt, tracker, include_usage)
    with tracker.guard():
        completions = await choices.collect()
    usage = choices.total_usage([c.usage for c in completions])
    tracker.finish(completions[0].finish_reason, usage)
    return web.Response(body=_encoder.encode(fmt.full(completions, usage)),
                        content_type="application/json")


async def stream_sse(request: web.Request, choices: ChoiceStreams, fmt: OutputFormat,
                     tracker: RequestTracker, include_usage: bool) -> web.StreamResponse:
    """Stream the choices as SSE. Bad input / a full queue surface from the first deltas,
    before any header is sent, so they still become a 400 / 429."""
    with tracker.guard():
        firsts = await choices.firsts()
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        with tracker.guard():
            await response.prepare(request)
            lasts = await _write_deltas(response, firsts, choices, fmt, tracker)
        usage = choices.total_usage([last.usage for last in lasts])
        tracker.finish(lasts[0].finish_reason or "stop", usage)
        if include_usage:
            await response.write(sse_event(fmt.usage_chunk(UsageOut.of(usage))))
        await response.write(DONE_EVENT)
    except ConnectionResetError:
        return response  # the client went away; aclose() below cancels the choices
    except Exception as exc:  # a real fault mid-stream: status is sent, report in-band
        log.exception("stream %s failed", fmt.id)
        await _write_error(response, exc)
    finally:
        await choices.aclose()
    return response


async def _write_deltas(response: web.StreamResponse, firsts: list[Delta], choices: ChoiceStreams,
                        fmt: OutputFormat, tracker: RequestTracker) -> list[Delta]:
    """Write every choice's deltas; -> each choice's last delta."""
    lasts = list(firsts)
    for index in range(len(firsts)):
        opening = fmt.first_chunk(index)
        if opening is not None:
            await response.write(sse_event(opening))
    for index, delta in enumerate(firsts):
        await _write_delta(response, fmt, tracker, index, delta)
    async for index, delta in choices.rest(firsts):
        lasts[index] = delta
        await _write_delta(response, fmt, tracker, index, delta)
    return lasts


async def _write_delta(response: web.StreamResponse, fmt: OutputFormat, tracker: RequestTracker,
                       index: int, delta: Delta) -> None:
    tracker.on_tokens(len(delta.token_ids))
    for chunk in fmt.chunks(index, delta):
        await response.write(sse_event(chunk))


async def _write_error(response: web.StreamResponse, exc: Exception) -> None:
    detail = ErrorDetail(f"internal error: {type(exc).__name__}: {exc}", "server_error",
                         code="internal_error")
    with contextlib.suppress(ConnectionResetError):
        await response.write(sse_event(ErrorResponse(detail)))
        await response.write(DONE_EVENT)
