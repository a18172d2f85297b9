"""Tool calling: how tools reach the prompt, and how tool calls come back out of the text.

Prompt side (`ToolPrompt`): a chat template that knows tools (Qwen3, Qwen3.5, Llama 3.x,
Hermes-style: its source mentions `tools`) gets them as the `tools` variable, and assistant
`tool_calls` / `role: "tool"` messages as they are (arguments as objects). Any other template
(the default model's) gets the generic tool prompt below as (part of) the system message,
assistant calls as `<tool_call>` text and tool results as user turns in `<tool_response>`.
`tool_choice: "required"` or a named function is enforced by a grammar (calls only, each
valid against its parameters, in the format the model writes; server/tool_grammar.py).

Text side (`ToolCallParser`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes / Qwen3), `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`
(Qwen3.5 / Qwen3-Coder) and a reply that is one JSON object `{"name": ..., "parameters": ...}`
(Llama 3.x, `<|python_tag|>` allowed first). Fed piece by piece, it returns the content to show
now and the calls completed now; fed the whole text at once, it gives the same result.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from ..errors import BadInputError

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

GENERIC_TOOL_PROMPT = (
    "You can call functions to help answer. The functions, as JSON schemas:\n{tools}\n\n"
    "To call a function, reply with one block per call, exactly like this:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": <the arguments as a JSON object>}}\n"
    "</tool_call>\n"
    "Function results come back inside <tool_response></tool_response>. If no function is "
    "needed, answer normally."
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------- prompt side


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How a chat's replies are read for tool calls."""

    parallel: bool  # parallel_tool_calls: false keeps the first call only
    text_params: dict[str, frozenset[str]]  # function -> parameters the xml format writes as text


@dataclass(frozen=True, slots=True)
class ToolPrompt:
    """What one chat request sends to the template, and the call format of its reply."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # for the template's `tools` variable
    fmt: str  # the call format the model writes: hermes, json or xml


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tool_format(template: str | None) -> str:
    """`xml` (Qwen3.5's <function=...>), `json` (Llama 3.x) or `hermes` (the rest)."""
    if template is not None and "<function=" in template:
        return "xml"
    if template is not None and TOOL_OPEN not in template and (
            PYTHON_TAG in template or "ipython" in template):
        return "json"
    return "hermes"


def build_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                      choice: str | None, template: str | None) -> ToolPrompt:
    """`choice`: None (auto), "required", or a function name."""
    fmt = tool_format(template) if template_knows_tools(template) else "hermes"
    if choice is not None and choice != "required":
        tools = [t for t in tools if t["function"]["name"] == choice]
    if template_knows_tools(template):
        return ToolPrompt([_native_message(m) for m in messages], tools or None, fmt)
    return ToolPrompt(_generic_messages(messages, tools), None, fmt)


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    """Templates expect a call's arguments as an object (OpenAI sends JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    native = []
    for call in calls:
        function = dict(call["function"])
        function["arguments"] = _loads_or_text(function.get("arguments") or "{}")
        native.append({**call, "function": function, **function})
    return {**message, "tool_calls": native}


def _generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    prompt = GENERIC_TOOL_PROMPT.format(tools=listing)
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            blocks = [_hermes_block(c["function"]["name"], c["function"].get("arguments") or "{}")
                      for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([message["content"] or "", *blocks]).strip()})
        else:
            out.append({"role": message["role"], "content": message["content"] or ""})
    if not tools:
        return out
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _hermes_block(name: str, arguments: str) -> str:
    args = json.dumps(_loads_or_text(arguments), ensure_ascii=False)
    return f'{TOOL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{TOOL_CLOSE}'


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_tools(tools: list[dict[str, Any]], choice: str | None) -> None:
    """Tool names unique; a named tool_choice names one of them."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise BadInputError("tool function names must be unique", param="tools")
    if choice not in (None, "required") and choice not in names:
        raise BadInputError(f"tool_choice names `{choice}`, which is not in tools",
                            param="tool_choice")
