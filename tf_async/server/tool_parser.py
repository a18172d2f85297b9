"""Tool calls out of a reply's text, piece by piece (formats: see server/tools.py).

    reply:  | content | <tool_call> body </tool_call> | content | <tool_call> body ...
    state:    plain      in_block                       plain      in_block (final: parsed)

Text that may still become a tool-call tag is held back (never shown, then taken back);
a reply that opens with `{` (Llama 3.x JSON calls) is held whole until the end. Whitespace
at the end of content is held until more text follows, and dropped when calls come. A block that does not parse is shown as content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .tools import PYTHON_TAG, TOOL_CLOSE, TOOL_OPEN, ToolCall, new_call_id


class ToolCallParser:
    """feed(text, final) -> (content to show now, calls completed now)."""

    def __init__(self, *, parallel: bool = True,
                 text_params: Mapping[str, frozenset[str]] | None = None):
        self.parallel = parallel
        self.text_params = text_params or {}  # xml format: parameters whose values are text
        self.calls: list[ToolCall] = []
        self._pending = ""
        self._in_block = False
        self._json_mode = False
        self._shown_text = False  # non-whitespace content shown (no JSON-call reply then)
        self._held_space = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._pending += text
        parts: list[str] = []
        found: list[ToolCall] = []
        while self._step(parts, found, final):
            pass
        found = found if self.parallel else found[: max(0, 1 - len(self.calls))]
        self.calls.extend(found)
        shown = "".join(self._shown(part) for part in parts)
        if final and not self.calls:
            shown, self._held_space = shown + self._held_space, ""
        return shown, found

    def _step(self, parts: list[str], found: list[ToolCall], final: bool) -> bool:
        """One move of the state machine; False when it needs more text (or is done)."""
        if self._json_mode:
            if final:
                calls = parse_json_calls(self._pending)
                if calls is None:
                    parts.append(self._pending)
                else:
                    found.extend(calls)
                self._pending = ""
            return False
        if self._in_block:
            return self._block_step(parts, found, final)
        if not self._shown_text and not self.calls:
            head = self._pending.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._json_mode = True
                return True
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return False  # undecided: could still open a JSON call
        start = self._pending.find(TOOL_OPEN)
        if start >= 0:
            parts.append(self._pending[:start])
            self._pending = self._pending[start + len(TOOL_OPEN):]
            self._in_block = True
            return True
        keep = 0 if final else tag_prefix_len(self._pending, TOOL_OPEN)
        parts.append(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _block_step(self, parts: list[str], found: list[ToolCall], final: bool) -> bool:
        end = self._pending.find(TOOL_CLOSE)
        if end < 0 and not final:
            return False
        body = self._pending if end < 0 else self._pending[:end]
        if end < 0:  # cut short: a partly written closing tag is not part of the call
            body = body[: len(body) - tag_prefix_len(body, TOOL_CLOSE)]
        self._pending = "" if end < 0 else self._pending[end + len(TOOL_CLOSE):]
        self._in_block = False
        call = parse_block(body, self.text_params)
        if call is not None:
            found.append(call)
        else:
            parts.append(TOOL_OPEN + body + ("" if end < 0 else TOOL_CLOSE))
        return end >= 0

    def _shown(self, part: str) -> str:
        """Trailing whitespace is held until text follows (dropped at the end of a reply
        with calls), so pieces of any size show the same content."""
        body = part.rstrip()
        if not body:
            self._held_space += part
            return ""
        self._shown_text = True
        shown = self._held_space + body
        self._held_space = part[len(body):]
        return shown


def tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def parse_block(body: str, text_params: Mapping[str, frozenset[str]]) -> ToolCall | None:
    """One `<tool_call>` body: a JSON object, or Qwen3.5's <function=...> form."""
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml_call(body, text_params)
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj)


def parse_json_calls(text: str) -> list[ToolCall] | None:
    """A whole reply of JSON calls (Llama 3.x): objects, `;`-separated, or one list."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder = json.JSONDecoder()
    objects: list[Any] = []
    pos = 0
    try:
        while pos < len(text):
            obj, pos = decoder.raw_decode(text, pos)
            objects.extend(obj if isinstance(obj, list) else [obj])
            while pos < len(text) and text[pos] in " \n\t;,":
                pos += 1
    except ValueError:
        return None
    calls = [_call_of(obj) for obj in objects]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_xml_call(body: str, text_params: Mapping[str, frozenset[str]]) -> ToolCall | None:
    """<function=NAME><parameter=KEY>VALUE</parameter>...</function>: a value is JSON, or
    text (always text where the function's schema says the parameter is a string)."""
    head, sep, rest = body[len("<function="):].partition(">")
    if not sep or not head.strip():
        return None
    texts = text_params.get(head.strip(), frozenset())
    args: dict[str, Any] = {}
    for chunk in rest.split("<parameter=")[1:]:
        key, sep, value = chunk.partition(">")
        if not sep:
            return None
        key, value = key.strip(), value.split("</parameter>")[0].strip("\n")
        args[key] = _text_value(value) if key in texts else _json_or_text(value)
    return ToolCall(new_call_id(), head.strip(), json.dumps(args, ensure_ascii=False))


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _text_value(value: str) -> str:
    """A string parameter's value: its text, or the string a JSON string literal spells."""
    decoded = _json_or_text(value) if value.startswith('"') else value
    return decoded if isinstance(decoded, str) else value
