"""/v1/responses (the OpenAI Responses API) on top of the chat machinery.

A request becomes a ChatRequest (`to_chat_request`: instructions -> system message, input
items -> messages, flat function tools -> chat tools, text.format -> response_format), so
prompts, tools, grammars and reasoning work exactly as in /v1/chat/completions.
`ResponseBuilder` turns the reply into output items (reasoning, message, function_call),
as Responses stream events while it streams, and as one response object at the end; the
events of a stream add up to that object. `previous_response_id` is not supported (nothing
is stored): send the whole conversation as input.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from ..api_types import Usage
from ..errors import BadInputError
from .choices import ChoiceStreams
from .metrics import RequestTracker
from .reasoning import ReplyMode, ReplyParser
from .schemas import (
    ChatMessage,
    ChatRequest,
    FunctionCallIn,
    FunctionDef,
    FunctionName,
    IgnoredOpenAIFields,
    JsonSchemaFormat,
    MaxTokens,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Seed,
    Temperature,
    ToolCallIn,
    ToolDef,
    TopP,
)
from .sse import SSE_HEADERS
from .tools import ToolCall


class FunctionTool(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # accepted; no summaries are made


class ResponsesRequest(IgnoredOpenAIFields, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None  # extension
    stream: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: Literal[False] | None = None

log = logging.getLogger("tf_async.server")


# ---------------------------------------------------------------- request -> chat


class _InputMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_InputText | _OutputText]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class _OutputText(Struct, forbid_unknown_fields=True, kw_only=True, tag_field="type",
                  tag="output_text"):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _InputText(Struct, forbid_unknown_fields=True, tag_field="type", tag="input_text"):
    text: str


class _FunctionCall(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutput(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


_ITEM_KINDS: dict[str, type[Struct]] = {
    "message": _InputMessage, "function_call": _FunctionCall,
    "function_call_output": _FunctionCallOutput}


def to_chat_request(req: ResponsesRequest) -> ChatRequest:
    """The chat request this Responses request means (see the module doc)."""
    if req.previous_response_id is not None:
        raise BadInputError("previous_response_id is not supported (no responses are stored); "
                            "send the conversation as input", param="previous_response_id")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += _input_messages(req.input)
    return ChatRequest(
        messages=messages, model=req.model, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, tools=_chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None)


def _input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for i, raw in enumerate(items):
        item = _decode_item(raw, i)
        if isinstance(item, _InputMessage):
            text = item.content if isinstance(item.content, str) else "".join(
                part.text for part in item.content)
            messages.append(ChatMessage(role=item.role, content=text))
        elif isinstance(item, _FunctionCall):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(item.name, item.arguments))
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, _FunctionCallOutput):
            messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    if not messages:
        raise BadInputError("input has no messages", param="input")
    return messages


def _decode_item(raw: dict[str, Any], index: int) -> Struct | None:
    kind = raw.get("type", "message")
    if kind == "reasoning":
        return None  # earlier reasoning is not fed back (as the chat templates drop it)
    if kind not in _ITEM_KINDS:
        raise BadInputError(f"input item type {kind!r} is not supported", param=f"input[{index}].type")
    try:
        return msgspec.convert(raw, _ITEM_KINDS[kind])
    except msgspec.ValidationError as exc:
        raise BadInputError(f"Invalid input item: {exc}", param=f"input[{index}]") from None


def _chat_tools(tools: list[FunctionTool] | None) -> list[ToolDef] | None:
    if not tools:
        return None
    return [ToolDef("function", FunctionDef(name=t.name, description=t.description,
                                            parameters=t.parameters, strict=t.strict))
            for t in tools]


def _chat_tool_choice(choice: object) -> Any:
    if isinstance(choice, NamedFunctionChoice):
        return NamedToolChoice("function", NamedFunction(choice.name))
    return choice


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    if text is None or text.format is None:
        return None
    fmt = text.format
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.schema,
        strict=fmt.strict))


# ---------------------------------------------------------------- reply -> response


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class ResponseBuilder:
    """Output items of one reply; `feed` returns the stream events of each piece."""

    def __init__(self, model: str, req: ResponsesRequest, replies: ReplyMode | None):
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.req = req
        self.parser = ReplyParser(replies or ReplyMode(False, False, None))
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item text is being added to
        self._sequence = 0

    # ---- events ----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress", None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        reasoning, content, calls = self.parser.feed(text, final)
        events: list[dict[str, Any]] = []
        if reasoning:
            events += self._text_into("reasoning", reasoning)
        if content:
            events += self._text_into("message", content)
        for call in calls:
            events += self._close() + self._function_call(call)
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        status = "incomplete" if finish_reason == "length" else "completed"
        return events + [self._event(f"response.{status}", response=self.response(status, usage))]

    def _text_into(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close() + self._open_item(kind)
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, list[Any]] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=self._open["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, **extra))
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"type": "message", "id": _new_id("msg_"), "status": "in_progress",
                    "role": "assistant", "content": [part]}
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": _new_id("rs_"), "summary": [], "content": [part],
                    "status": "in_progress"}
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        shell = {**item, "content": []}
        return [self._event("response.output_item.added", output_index=index, item=shell),
                self._event("response.content_part.added", item_id=item["id"], output_index=index,
                            content_index=0, part={**part, "text": ""})]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = len(self.output) - 1
        part = item["content"][0]
        done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra: dict[str, list[Any]] = {"logprobs": []} if item["type"] == "message" else {}
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _function_call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {"type": "function_call", "id": _new_id("fc_"), "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": "completed"}
        self.output.append(item)
        index = len(self.output) - 1
        shell = {**item, "arguments": "", "status": "in_progress"}
        return [self._event("response.output_item.added", output_index=index, item=shell),
                self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=item)]

    def error(self, exc: Exception) -> dict[str, Any]:
        return self._event("error", code="internal_error", param=None,
                           message=f"internal error: {type(exc).__name__}: {exc}")

    # ---- the response object --------------------------------------------------------
    def response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": [dict(item) for item in self.output],
            "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": [msgspec.to_builtins(tool) for tool in req.tools or ()],
            "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": msgspec.to_builtins(req.text) if req.text is not None else {"format": {"type": "text"}},
            "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning is not None else None,
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "metadata": req.metadata or {},
        }


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------- the route's answer

_encoder = msgspec.json.Encoder()


async def respond_responses(request: web.Request, choices: ChoiceStreams, builder: ResponseBuilder,
                            tracker: RequestTracker, *, stream: bool) -> web.StreamResponse:
    """One JSON response object, or its stream of events (`event:` + `data:` per event)."""
    if not stream:
        with tracker.guard():
            completion = (await choices.collect())[0]
        builder.feed(completion.text, final=True)
        usage = completion.usage
        tracker.finish(completion.finish_reason, usage)
        body = builder.finish(completion.finish_reason, _usage(usage))[-1]["response"]
        return web.Response(body=_encoder.encode(body), content_type="application/json")
    with tracker.guard():
        firsts = await choices.firsts()
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        with tracker.guard():
            await response.prepare(request)
            await _write(response, builder.start())
            last = firsts[0]
            tracker.on_tokens(len(last.token_ids))
            await _write(response, builder.feed(last.text, last.finish_reason is not None))
            async for _, delta in choices.rest(firsts):
                tracker.on_tokens(len(delta.token_ids))
                await _write(response, builder.feed(delta.text, delta.finish_reason is not None))
                last = delta
        usage = last.usage or Usage()
        tracker.finish(last.finish_reason or "stop", usage)
        await _write(response, builder.finish(last.finish_reason or "stop", _usage(usage)))
    except ConnectionResetError:
        pass  # the client went away; aclose() cancels the request
    except Exception as exc:  # a real fault mid-stream: status is sent, report in-band
        log.exception("response stream %s failed", builder.id)
        with contextlib.suppress(ConnectionResetError):
            await _write(response, [builder.error(exc)])
    finally:
        await choices.aclose()
    return response


def _usage(usage: Usage) -> dict[str, Any]:
    return usage_dict(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


async def _write(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    for event in events:
        await response.write(b"event: " + event["type"].encode() + b"\ndata: "
                             + _encoder.encode(event) + b"\n\n")
