"""The OpenAI Agents SDK end to end on the default model through /v1/responses (its default
API): an agent whose tool_choice is "required" calls its function tool with arguments that
validate, the SDK runs the tool and sends its output back, and the model answers; an agent
with a Pydantic output_type gets its final output parsed (text.format json_schema, strict).
Tracing is off (it would export to OpenAI)."""

from __future__ import annotations

import agents
import openai
import pydantic
import pytest
import pytest_asyncio

from tf_async import Engine

from .server_helpers import live_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
MODEL = "smollm2"
CALLS: list[tuple[str, str]] = []


@agents.function_tool
def get_weather(city: str, unit: str) -> str:
    """Current weather of a city; unit is "celsius" or "fahrenheit"."""
    CALLS.append((city, unit))
    return f"22 degrees {unit} and sunny in {city}"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model(default_checkpoint):
    agents.set_tracing_disabled(True)
    async with Engine(default_checkpoint, device="cpu", parallel=2, ctx=1024) as engine, \
            live_server(engine, model_name=MODEL) as url, \
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        yield agents.OpenAIResponsesModel(model=MODEL, openai_client=client)


async def test_agent_calls_its_tool_then_answers(model):
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.",
                         tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required",
                                                             temperature=0, max_tokens=60))
    CALLS.clear()
    result = await agents.Runner.run(agent, "What is the weather in Paris, in celsius?",
                                     max_turns=3)
    assert CALLS and all(isinstance(city, str) and isinstance(unit, str) for city, unit in CALLS)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)


async def test_agent_output_type_is_parsed(model):
    agent = agents.Agent(name="cities", instructions="Describe the city asked about.",
                         model=model, output_type=City,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=80))
    result = await agents.Runner.run(agent, "Paris", max_turns=1)
    assert isinstance(result.final_output, City) and result.final_output.name
