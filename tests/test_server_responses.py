"""/v1/responses over HTTP with the openai SDK on the tiny engine: text and message input,
instructions, function tools (forced calls valid against their parameters), text.format
json_schema, usage, status incomplete at max_output_tokens, and streams whose events add
up to the non-streamed response (the SDK's own stream accumulator included)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from .server_helpers import MODEL_NAME, live_openai_client, open_engine, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
          "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
PERSON = {"type": "object", "properties": {"name": {"enum": ["Ann", "Bob"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    async with open_engine(tmp_path_factory.mktemp("tiny_resp"), parallel=2, ctx=1024,
                           step_tokens=64) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine):
    async with live_openai_client(engine) as oa:
        yield oa


async def test_text_input_with_instructions_is_the_chat_reply(engine, client):
    resp = await client.responses.create(model=MODEL_NAME, input="Say hi.", instructions="Be brief.",
                                         max_output_tokens=10, temperature=0)
    chat = await engine.chat_complete([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Say hi."}],
                                      max_tokens=10, temperature=0)
    assert resp.output_text == chat.text
    assert resp.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert 0 <= resp.usage.input_tokens_details.cached_tokens <= resp.usage.input_tokens


async def test_message_items_and_function_call_round_trip(client):
    first = await client.responses.create(model=MODEL_NAME, input="Weather in Rome?", tools=TOOLS,
                                          tool_choice="required", max_output_tokens=80,
                                          temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMS)
    follow = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
              *[c.model_dump(exclude_none=True) for c in calls],
              *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in calls]]
    again = await client.responses.create(model=MODEL_NAME, input=follow, tools=TOOLS,
                                          max_output_tokens=6, temperature=0)
    assert again.status in ("completed", "incomplete")


async def test_json_schema_text_format(client):
    resp = await client.responses.create(
        model=MODEL_NAME, input="A person, please.", max_output_tokens=80, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), PERSON)


@pytest.mark.parametrize("forced", [False, True])
async def test_stream_events_add_up_to_the_response(engine, client, forced):
    kwargs = dict(model=MODEL_NAME, input="Weather?", max_output_tokens=40, temperature=0.9,
                  extra_body={"seed": 4})
    if forced:
        kwargs |= {"tools": TOOLS, "tool_choice": "required"}
    whole = await client.responses.create(**kwargs)
    types, text, arguments = [], "", ""
    async with client.responses.stream(**kwargs) as stream:
        async for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.function_call_arguments.delta":
                arguments += event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
        if types[-1] == "response.completed":  # the SDK's accumulator agrees
            assert (await stream.get_final_response()).output_text == final.output_text
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert text == whole.output_text == final.output_text
    want_args = "".join(i.arguments for i in whole.output if i.type == "function_call")
    assert arguments == want_args
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    await wait_idle(engine)


async def test_unsupported_fields_are_clear_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL_NAME, input=[{"type": "web_search_call"}])
    assert info.value.body["param"] == "input[0].type"
