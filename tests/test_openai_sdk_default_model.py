"""The openai SDK end to end against the default model (SmolLM2-135M-Instruct, whose chat
template knows no tools: the generic tool prompt), as an agent would use it: forced tool
calls that validate, structured outputs parsed into a Pydantic model, the Responses API and
its stream; streamed pieces add up to the non-streamed result."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio

from tf_async import Engine

from .server_helpers import live_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "Current weather of a city", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(default_checkpoint):
    async with Engine(default_checkpoint, device="cpu", parallel=2, ctx=1024) as engine, \
            live_server(engine, model_name="smollm2") as url, \
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as oa:
        yield oa


async def test_required_tool_call_validates_and_streams_the_same(client):
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=60, temperature=0)
    resp = await client.chat.completions.create(**kwargs)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    pieces: dict[int, str] = {}
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for piece in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            pieces[piece.index] = pieces.get(piece.index, "") + (piece.function.arguments or "")
    assert list(pieces.values()) == [c.function.arguments for c in calls]


async def test_parse_with_a_pydantic_model(client):
    resp = await client.beta.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe the city of Paris."}],
        response_format=City, max_tokens=80, temperature=0)
    city = resp.choices[0].message.parsed
    assert isinstance(city, City) and city.name


async def test_responses_create_and_stream(client):
    kwargs = dict(model="smollm2", input="What is the capital of Germany?", max_output_tokens=24,
                  temperature=0)
    resp = await client.responses.create(**kwargs)
    assert "Berlin" in resp.output_text and resp.usage.output_tokens > 0
    async with client.responses.stream(**kwargs) as stream:
        text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    assert text == resp.output_text
