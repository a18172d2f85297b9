"""Tool-call parsing, one format at a time: whole text, and the same text fed in pieces of
every size gives the same content and calls (streamed == whole)."""

from __future__ import annotations

import json

import pytest

from tf_async.server.tool_parser import ToolCallParser
from tf_async.server.tools import build_tool_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# (reply text, expected content, expected [(name, arguments)])
CASES = {
    "hermes one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                        "</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    "hermes text then two calls": (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>\n',
        "Let me check.", [("a", {}), ("b", {"x": 1})]),
    "qwen3.5 xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None,
                    [("get_weather", {"city": "Paris", "days": 3})]),
    "llama json": ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
                   [("get_weather", {"city": "Rome"})]),
    "llama python tag, two calls": ('<|python_tag|>{"name": "a", "parameters": {}}; '
                                    '{"name": "b", "parameters": {"k": [1]}}', None,
                                    [("a", {}), ("b", {"k": [1]})]),
    "plain text": ("The weather is fine < 3 <tool", "The weather is fine < 3 <tool", []),
    "json that is not a call": ('{"answer": 42}', '{"answer": 42}', []),
    "broken block is text": ("<tool_call>{not json</tool_call> ok",
                             "<tool_call>{not json</tool_call> ok", []),
    "unclosed block at the end": ('<tool_call>{"name": "a", "arguments": {"q": 1}}', None,
                                  [("a", {"q": 1})]),
}


def run(text: str, piece: int) -> tuple[str | None, list[tuple[str, dict]]]:
    parser = ToolCallParser()
    shown = ""
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    for i, part in enumerate(pieces):
        content, _ = parser.feed(part, final=i == len(pieces) - 1)
        shown += content
    return shown or None, [(c.name, json.loads(c.arguments)) for c in parser.calls]


@pytest.mark.parametrize("case", list(CASES))
def test_each_format_whole_and_in_pieces(case):
    text, content, calls = CASES[case]
    for piece in (len(text) or 1, 1, 2, 3, 7):
        assert run(text, piece) == (content, calls), piece


def test_call_ids_are_unique_and_parallel_false_keeps_one():
    parser = ToolCallParser(parallel=False)
    parser.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                '<tool_call>{"name": "b", "arguments": {}}</tool_call>', final=True)
    assert [c.name for c in parser.calls] == ["a"]
    both = ToolCallParser()
    both.feed(CASES["hermes text then two calls"][0], final=True)
    assert len({c.id for c in both.calls}) == 2 and all(c.id.startswith("call_") for c in both.calls)


def test_xml_values_of_string_parameters_stay_text():
    parser = ToolCallParser(text_params={"f": frozenset({"code", "quoted", "n"})})
    parser.feed("<tool_call>\n<function=f>\n<parameter=code>\n007\n</parameter>\n"
                '<parameter=quoted>\n"a\\"b"\n</parameter>\n<parameter=n>\ntrue\n</parameter>\n'
                "<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>", final=True)
    assert json.loads(parser.calls[0].arguments) == {"code": "007", "quoted": 'a"b', "n": "true",
                                                     "other": 7}


def test_generic_prompt_when_the_template_lacks_tools():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    plain = build_tool_prompt(messages, [WEATHER], None, "{{ messages }}")
    assert plain.tools is None and plain.messages[0]["role"] == "system"
    assert "get_weather" in plain.messages[0]["content"] and "<tool_call>" in plain.messages[0]["content"]
    assert plain.messages[2]["content"].startswith("<tool_call>\n{\"name\": \"get_weather\"")
    assert plain.messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native = build_tool_prompt(messages, [WEATHER], "get_weather", "{% if tools %}{% endif %}")
    assert native.tools == [WEATHER] and native.messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"}
    assert native.fmt == "hermes"
    assert build_tool_prompt(messages, [WEATHER], "get_weather", "{{ tools }}<function=").fmt == "xml"


# (reply, starts thinking, expected reasoning, expected content)
THINK_CASES = {
    "opened by the reply": ("<think>\nLet me see.\n</think>\n\nParis.", False, "\nLet me see.\n", "Paris."),
    "opened by the prompt": ("hmm, 2+2</think>4", True, "hmm, 2+2", "4"),
    "no thinking": ("Just text <thin", False, "", "Just text <thin"),
    "cut inside thinking": ("<think>still going </thi", False, "still going </thi", ""),
}


@pytest.mark.parametrize("case", list(THINK_CASES))
def test_think_split_whole_and_in_pieces(case):
    from tf_async.server.reasoning import ThinkParser

    text, starts, reasoning, content = THINK_CASES[case]
    for piece in (len(text), 1, 2, 5):
        parser = ThinkParser(starts_thinking=starts)
        got = ["", ""]
        pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
        for i, part in enumerate(pieces):
            r, c = parser.feed(part, final=i == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert got == [reasoning, content], piece


def test_reasoning_then_tool_calls():
    from tf_async.server.reasoning import ReplyMode, ReplyParser
    from tf_async.server.tools import ToolMode

    parser = ReplyParser(ReplyMode(True, False, ToolMode(True, "")))
    reasoning, content, calls = parser.feed(
        '<think>need weather</think>\n<tool_call>{"name": "w", "arguments": {}}</tool_call>', True)
    assert (reasoning, content, [c.name for c in calls]) == ("need weather", "", ["w"])
