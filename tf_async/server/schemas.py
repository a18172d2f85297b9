"""Request and response bodies of the HTTP / websocket API as msgspec structs.

Requests are decoded strictly (unknown fields refused, ranges checked); every decoding or
validation failure becomes a `BadInputError` naming the offending field, which the app
turns into a 400 with the OpenAI error JSON. Response structs use OpenAI's field names.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from ..api_types import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    GrammarSpec,
    SamplingParams,
    Usage,
)
from ..errors import BadInputError

MAX_CHOICES = 16  # n per prompt
MAX_PROMPTS = 32  # prompts in one /v1/completions request (times n: choices in all)

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]  # -1 (vLLM habit) and 0 both mean "off"
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Meta(min_length=1)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes once at the end


class IgnoredOpenAIFields(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI request fields that change nothing here: accepted and ignored (docs/OPENAI.md
    lists them). Fields OpenAI does not define still get a 400."""

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None


class _Sampling(IgnoredOpenAIFields, kw_only=True):
    """Fields shared by completions, chat completions and websocket chats (wire names and
    OpenAI's ranges; `sampling_params` maps them onto the engine's SamplingParams)."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: NumChoices = 1
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    # prefix cache (vLLM's field): prompt pages are shared only between requests of one salt
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int, num_logprobs: int | None,
                        grammar: GrammarSpec | None = None) -> SamplingParams:
        """The one mapping from the request schema onto the engine's SamplingParams."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop_tuple(), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=num_logprobs,
            logit_bias=_bias_pairs(self.logit_bias or {}), min_tokens=self.min_tokens, grammar=grammar)


class _Streamed(_Sampling, kw_only=True):
    """The sampling fields, and streaming (HTTP routes)."""

    stream: bool = False
    stream_options: StreamOptions | None = None

    def include_usage(self) -> bool:
        """stream_options is only for streams (OpenAI answers 400 otherwise)."""
        if self.stream_options is not None and not self.stream:
            raise BadInputError("stream_options is only allowed when stream is true",
                                param="stream_options")
        return bool(self.stream_options and self.stream_options.include_usage)


def _bias_pairs(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    try:
        return tuple(sorted((int(token), value) for token, value in bias.items()))
    except ValueError:
        raise BadInputError("logit_bias keys must be token ids (decimal strings)",
                            param="logit_bias") from None


class CompletionRequest(_Streamed, kw_only=True):
    prompt: str | Annotated[list[int | str | list[int]], Meta(min_length=1, max_length=16384)]
    logprobs: NumLogprobs | None = None
    echo: Literal[False] = False
    best_of: NumChoices | None = None
    suffix: None = None

    def prompt_values(self) -> list[str | list[int]]:
        """The prompts: one string, one list of ids, or a list of strings / of id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(tok, int) for tok in self.prompt):
            return [[int(tok) for tok in self.prompt]]  # type: ignore[arg-type]
        if any(isinstance(item, int) for item in self.prompt):
            raise BadInputError("prompt mixes token ids with strings or lists", param="prompt")
        if len(self.prompt) > MAX_PROMPTS:
            raise BadInputError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        return list(self.prompt)  # type: ignore[arg-type]

    def check_best_of(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise BadInputError("best_of must equal n (no server-side ranking)", param="best_of")


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCallIn(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallIn(Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    reasoning_content: str | None = None  # assistant messages (not fed back)

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message for the chat template: role and text, plus tool calls / call id."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [msgspec.to_builtins(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


Messages = Annotated[list[ChatMessage], Meta(min_length=1)]
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDef(Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (object)
    strict: bool | None = None


class ToolDef(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None  # always strict here: the grammar enforces the schema


class ResponseFormat(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        """json_object: any JSON object; json_schema: its schema (constrained decoding)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_schema", '{"type": "object"}', "response_format")
        if self.json_schema is None:
            raise BadInputError("response_format json_schema needs `json_schema`",
                                param="response_format.json_schema")
        schema = self.json_schema.schema if self.json_schema.schema is not None else {}
        return GrammarSpec("json_schema", json.dumps(schema), "response_format.json_schema.schema")


class ChatRequest(_Streamed, kw_only=True):
    messages: Messages
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDef], Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    def template_kwargs(self) -> dict[str, Any]:
        """Variables for the chat template: chat_template_kwargs, and reasoning_effort (as
        itself, and "none" as enable_thinking false unless that is given)."""
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = {"messages", "tools", "add_generation_prompt"} & set(kwargs)
        if reserved:
            raise BadInputError(f"chat_template_kwargs may not set {sorted(reserved)[0]}",
                                param="chat_template_kwargs")
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if self.reasoning_effort == "none":
                kwargs.setdefault("enable_thinking", False)
        return kwargs

    def message_dicts(self) -> list[dict[str, Any]]:
        for i, message in enumerate(self.messages):
            if message.content is None and not message.tool_calls:
                raise BadInputError("content is required (null only on assistant messages with "
                                    "tool_calls)", param=f"messages[{i}].content")
            if message.tool_calls and message.role != "assistant":
                raise BadInputError("only assistant messages have tool_calls",
                                    param=f"messages[{i}].tool_calls")
        return [message.as_dict() for message in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools in play (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            if self.tool_choice not in (None, "none", "auto"):
                raise BadInputError("tool_choice needs tools", param="tool_choice")
            return []
        return [msgspec.to_builtins(tool) for tool in self.tools]

    def forced_tool(self) -> str | None:
        """None (the model decides), "required", or the name of the function to call."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise BadInputError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class WsChat(_Sampling, kw_only=True, tag_field="type", tag="chat"):
    """Websocket `{"type": "chat", "id": ..., "messages": [...], ...params}`."""

    id: str | int
    messages: Messages
    max_completion_tokens: MaxTokens | None = None


class WsCancel(Struct, forbid_unknown_fields=True, tag_field="type", tag="cancel"):
    id: str | int


class TokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------- responses


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageOut(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    drafted_tokens: int = 0  # extension
    accepted_tokens: int = 0  # extension

    @classmethod
    def of(cls, usage: Usage) -> UsageOut:
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
                   PromptTokensDetails(usage.cached_tokens), usage.drafted_tokens,
                   usage.accepted_tokens)


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(Struct, omit_defaults=True):
    id: str
    object: str  # "text_completion" (required: omit_defaults would drop a default)
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    type: str  # "function"
    function: FunctionOut


class AssistantMessage(Struct, omit_defaults=True):
    content: str | None
    role: str  # "assistant" (required: omit_defaults would drop a default)
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None


class ChatResponse(Struct):
    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageOut


class ChunkFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(Struct, omit_defaults=True):
    index: int
    function: ChunkFunction
    id: str | None = None
    type: str | None = None


class ChunkDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunk(Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None = None


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorDetail


# ---------------------------------------------------------------- decoding

_PATH_RE = re.compile(r"at `\$\.?(?P<path>[^`]*)`")
_UNKNOWN_RE = re.compile(r"(?:unknown|missing required) field `(?P<name>[^`]*)`")
_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, kind: Any) -> Any:
    """Decode a JSON body into `kind`; raise BadInputError naming the bad field."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadInputError(f"Invalid request: {exc}", param=error_param(str(exc)),
                            code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise BadInputError(f"Malformed JSON body: {exc}", code="invalid_json") from None


def error_param(message: str) -> str | None:
    """The field a msgspec error message points at (`$.messages[0].role` -> `messages[0].role`)."""
    path_match = _PATH_RE.search(message)
    path = path_match.group("path").replace("[...]", "") if path_match else ""  # a map's key
    unknown = _UNKNOWN_RE.search(message)
    if unknown:
        path = f"{path}.{unknown.group('name')}" if path else unknown.group("name")
    return path or None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [message.as_dict() for message in messages]


# ---------------------------------------------------------------- logprobs


def sorted_top(entry: dict[int, float], limit: int) -> list[tuple[int, float]]:
    """The `limit` most likely (token id, log-prob) pairs, most likely first."""
    return sorted(entry.items(), key=lambda item: (-item[1], item[0]))[:limit]


def completion_logprobs(
    delta_ids: list[int], entries: list[dict[int, float]], limit: int,
    decode_token: Any, text_offset: int,
) -> CompletionLogprobs:
    """Legacy completions logprobs for the tokens of one delta or one completion."""
    tokens = [decode_token(tok) for tok in delta_ids]
    offsets: list[int] = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[entry.get(tok, float("-inf")) for tok, entry in zip(delta_ids, entries, strict=True)],
        top_logprobs=[{decode_token(t): lp for t, lp in sorted_top(entry, limit)} for entry in entries],
        text_offset=offsets,
    )


def chat_logprobs(
    delta_ids: list[int], entries: list[dict[int, float]], limit: int, decode_token: Any,
) -> ChatLogprobs:
    """Chat logprobs (`content: [{token, logprob, bytes, top_logprobs}]`)."""
    content: list[TokenLogprob] = []
    for tok, entry in zip(delta_ids, entries, strict=True):
        token = decode_token(tok)
        tops = [TopLogprob(decode_token(t), lp, list(decode_token(t).encode()))
                for t, lp in sorted_top(entry, limit)]
        content.append(TokenLogprob(token, entry.get(tok, float("-inf")), list(token.encode()), tops))
    return ChatLogprobs(content)
