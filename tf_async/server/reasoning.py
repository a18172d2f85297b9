"""Reasoning models: `<think>...</think>` split off a reply into reasoning_content.

    reply:  [<think>] reasoning </think> [blank] content
    state:   opening   thinking           done

A reply opens thinking with `<think>`, or starts inside it when the prompt ends with the
tag (templates that open it in the generation prompt). Fed piece by piece or whole, the
split is the same: a partly written tag is held back until it is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_parser import ToolCallParser, tag_prefix_len
from .tools import ToolCall, ToolMode

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class ReplyMode:
    """How one chat's replies are read: reasoning split off, tool calls parsed."""

    reasoning: bool  # the template knows <think>
    starts_thinking: bool  # the prompt ends inside <think>
    tools: ToolMode | None


def reply_mode(template: str | None, prompt_text_end: str, tools: ToolMode | None) -> ReplyMode | None:
    reasoning = template is not None and THINK_CLOSE in template
    if not reasoning and tools is None:
        return None
    starts = reasoning and prompt_text_end.rstrip().endswith(THINK_OPEN)
    return ReplyMode(reasoning, starts, tools)


class ThinkParser:
    """feed(text, final) -> (reasoning, content) to show now."""

    def __init__(self, *, starts_thinking: bool):
        self._thinking = starts_thinking
        self._opened = starts_thinking
        self._done = False
        self._content_started = False
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._pending += text
        reasoning, content = "", ""
        if not self._opened and not self._done:
            head = self._pending.lstrip()
            if head.startswith(THINK_OPEN):
                self._pending = head[len(THINK_OPEN):]
                self._thinking = self._opened = True
            elif not final and THINK_OPEN.startswith(head):
                return "", ""  # may still open thinking
            else:
                self._done = True
        if self._thinking:
            end = self._pending.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else tag_prefix_len(self._pending, THINK_CLOSE)
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return reasoning, ""
            reasoning = self._pending[:end]
            self._pending = self._pending[end + len(THINK_CLOSE):]
            self._thinking, self._done = False, True
        if self._opened and not self._content_started:  # blanks after </think>: not content
            self._pending = self._pending.lstrip()
            if not self._pending:
                return reasoning, ""
            self._content_started = True
        content, self._pending = self._pending, ""
        return reasoning, content


class ReplyParser:
    """Reasoning first, then tool calls in what remains: (reasoning, content, calls)."""

    def __init__(self, mode: ReplyMode):
        self.think = ThinkParser(starts_thinking=mode.starts_thinking) if mode.reasoning else None
        self.tools = (ToolCallParser(parallel=mode.tools.parallel, text_params=mode.tools.text_params)
                      if mode.tools is not None else None)
        self.reasoning = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.think.feed(text, final) if self.think is not None else ("", text)
        self.reasoning += reasoning
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.feed(content, final)
        return reasoning, content, calls
