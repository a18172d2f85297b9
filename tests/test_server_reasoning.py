"""A reasoning model's template (tools and <think> as Qwen3 renders them) on the tiny engine:
reasoning_content split off (message and delta), chat_template_kwargs reaching the template,
reasoning_effort accepted, tools rendered by the template itself, and a constrained reply
rendered with thinking off."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio

from .server_helpers import (
    MODEL_NAME,
    live_openai_client,
    open_engine,
    write_tiny_model,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Think, then answer."}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}}}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny_think"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    async with open_engine(folder, parallel=2, ctx=512, step_tokens=64) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine):
    async with live_openai_client(engine) as oa:
        yield oa


async def test_reply_inside_think_is_reasoning_and_streams_the_same(engine, client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = (await client.chat.completions.create(**kwargs)).choices[0].message
    raw = await engine.chat_complete(ASK, max_tokens=12, temperature=0, ignore_eos=True)
    reasoning = whole.model_extra["reasoning_content"]
    assert "</think>" not in raw.text and reasoning == raw.text and whole.content == ""
    streamed = ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        streamed += "".join((c.delta.model_extra or {}).get("reasoning_content") or ""
                            for c in chunk.choices)
    assert streamed == reasoning


async def test_enable_thinking_false_and_reasoning_effort_none(client):
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}},
                  {"reasoning_effort": "none"}):
        resp = await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, **extra})
        message = resp.choices[0].message
        assert message.content and (message.model_extra or {}).get("reasoning_content") is None
    low = await client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4,
                                               reasoning_effort="low")
    assert low.choices[0].finish_reason in ("stop", "length")


async def test_tools_go_through_the_template_and_forced_calls_skip_thinking(engine, client):
    resp = await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60,
        temperature=0)
    expected = engine.chat_ids(ASK, tools=TOOLS, template_kwargs={"enable_thinking": False})
    assert resp.usage.prompt_tokens == len(expected)
    calls = resp.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["lookup"]
    assert json.loads(calls[0].function.arguments)["q"] in ("a", "b")
    follow = [*ASK, resp.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": calls[0].id, "content": "found"}]
    again = await client.chat.completions.create(model=MODEL_NAME, messages=follow, tools=TOOLS,
                                                 max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
