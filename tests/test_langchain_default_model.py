"""An agent framework end to end on the default model (SmolLM2-135M-Instruct, generic tool
prompt): langchain-openai's ChatOpenAI pointed at the server's base URL, as an agent uses it -
`bind_tools` with tool_choice="required" gives a call that validates, the tool's result goes
back as a ToolMessage and the model answers, and `with_structured_output` fills a Pydantic
model (json_schema response_format) and a tool-call-shaped one (function_calling)."""

from __future__ import annotations

import jsonschema
import pydantic
import pytest
import pytest_asyncio
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tf_async import Engine

from .server_helpers import live_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "smollm2"


@tool
def get_weather(city: str, unit: str) -> str:
    """Current weather of a city; unit is "celsius" or "fahrenheit"."""
    return f"22 degrees {unit} and sunny in {city}"


class City(pydantic.BaseModel):
    """A city and its country."""

    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llm(default_checkpoint):
    async with Engine(default_checkpoint, device="cpu", parallel=2, ctx=1024) as engine, \
            live_server(engine, model_name=MODEL) as url:
        yield ChatOpenAI(base_url=url + "/v1", api_key="none", model=MODEL, temperature=0,
                         max_tokens=60, max_retries=0, timeout=600)


async def test_bind_tools_required_then_answer_from_the_tool_result(llm):
    agent = llm.bind_tools([get_weather], tool_choice="required")
    history = [HumanMessage("What is the weather in Paris, in celsius?")]
    reply = await agent.ainvoke(history)
    assert isinstance(reply, AIMessage) and reply.tool_calls, reply
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
    result = await get_weather.ainvoke(call)  # a ToolMessage carrying the call's id
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = await llm.bind_tools([get_weather]).ainvoke([*history, reply, result])
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.content.strip()


async def test_with_structured_output_json_schema(llm):
    city = await llm.with_structured_output(City, method="json_schema").ainvoke(
        "Describe the city of Paris.")
    assert isinstance(city, City) and city.name


async def test_with_structured_output_function_calling(llm):
    city = await llm.with_structured_output(City, method="function_calling").ainvoke(
        "Describe the city of Paris.")
    assert isinstance(city, City) and city.name
