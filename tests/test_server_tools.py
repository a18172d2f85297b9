"""Tool calls and structured outputs over HTTP on the tiny engine (random weights, so only
the grammar makes its replies valid): required / named tool_choice give calls that validate
against the tool's parameters, json_schema replies validate, streamed pieces add up to the
non-streamed reply, and tool results are fed back."""

from __future__ import annotations

import json

import jsonschema
import pytest
import pytest_asyncio

from .server_helpers import MODEL_NAME, live_openai_client, open_engine, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
               "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"enum": ["Ann", "Bob"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_tools"), parallel=4, ctx=1024,
                           step_tokens=64) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine):
    async with live_openai_client(engine) as oa:
        yield oa


def check_calls(message) -> None:  # noqa: ANN001
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
async def test_required_tool_choice_always_gives_valid_calls(client, seed):
    resp = await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=seed)
    choice = resp.choices[0]
    check_calls(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


async def test_named_tool_choice_calls_that_function(client):
    resp = await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    check_calls(resp.choices[0].message)
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_time"]


async def test_streamed_tool_calls_add_up_to_the_whole(client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=1.0, seed=9)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"name": "", "arguments": "", "id": ""})
                call["id"] += piece.id or ""
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


async def test_tool_results_are_fed_back(client):
    first = (await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=0)).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in first.tool_calls]
    resp = await client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS,
                                                max_tokens=8, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


async def test_json_schema_and_json_object_replies_validate(engine, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    for seed in range(3):
        resp = await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, response_format=fmt, max_tokens=100,
            temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    streamed = ""
    async for chunk in await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, response_format=fmt, max_tokens=100, temperature=1.0,
            seed=2, stream=True):
        streamed += "".join(c.delta.content or "" for c in chunk.choices)
    assert streamed == resp.choices[0].message.content
    obj = await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, response_format={"type": "json_object"}, max_tokens=60,
        temperature=0)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # an open object cut by max_tokens: still its beginning
        assert obj.choices[0].message.content.startswith("{")
    await wait_idle(engine)


async def test_parameters_with_defs_and_recursion_give_valid_calls(client):
    node = {"type": "object", "properties": {"id": {"enum": ["a", "b"]}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}}, "required": ["id"]}
    params = {"type": "object", "$defs": {"node": node},
              "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}
    tools = [{"type": "function", "function": {"name": "put_tree", "parameters": params}}]
    for seed in range(2):
        resp = await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=tools, tool_choice="required", max_tokens=300,
            temperature=1.0, seed=seed)
        calls = resp.choices[0].message.tool_calls
        assert calls and all(c.function.name == "put_tree" for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params)
