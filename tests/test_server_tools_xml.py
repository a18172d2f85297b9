"""Qwen3.5's tool-call format (`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...`)
enforced by a grammar on a tiny Qwen3.5 hybrid with random weights, whose chat template writes
calls as Qwen3.5's does: with tool_choice "required" or a named function every reply is calls
that parse and validate against the function's parameters (text, enums, integers, arrays, a
pattern, a date, a $ref'd object); streamed pieces add up to the whole; a call the template
writes is one the grammar accepts."""

from __future__ import annotations

import json

import jsonschema
import pytest
import pytest_asyncio

from tf_async.api_types import GrammarSpec
from tf_async.engine.grammar import Grammars
from tf_async.server.tool_grammar import tag_terms, tool_grammar

from . import tiny_qwen35 as tq
from .server_helpers import MODEL_NAME, live_openai_client, open_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")
# Written after Qwen3.5's template (the tools listed by name only, to keep prompts short); a call is
# <tool_call>\n<function=NAME>\n then <parameter=KEY>\nVALUE\n</parameter>\n per argument
# (strings as text, the rest as JSON), then </function>\n</tool_call>; calls joined by "\n".
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{ '\\n' if not loop.first }}{{ '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{%- for k, v in c.function.arguments | items %}"
    "{{ '<parameter=' + k + '>\\n' }}{{ v if v is string else v | tojson }}{{ '\\n</parameter>\\n' }}"
    "{%- endfor %}{{ '</function>\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}
NOTE = {"type": "object", "$defs": {"place": {"type": "object", "properties": {
    "room": {"type": "string", "maxLength": 6}, "floor": {"type": "integer", "maximum": 9}},
    "required": ["room"]}}, "properties": {
    "text": {"type": "string", "minLength": 2, "maxLength": 12},
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "ref": {"type": "string", "pattern": "[a-z]/\\d{2}$", "maxLength": 8},
    "when": {"type": "string", "format": "date"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "place": {"$ref": "#/$defs/place"}}, "required": ["text", "code", "ref"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "leave_note", "parameters": NOTE}}]
PARAMS = {"get_weather": WEATHER, "leave_note": NOTE}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def validate(name: str, arguments: str) -> None:
    validator = jsonschema.Draft202012Validator(
        PARAMS[name], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(arguments))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    cfg = tq.tiny_qwen35_config(moe=False)
    folder = tq.write_qwen35_hf(tmp_path_factory.mktemp("tiny_qwen35_xml"), cfg,
                                tq.random_qwen35_weights(cfg, seed=5), "bf16")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    async with open_engine(folder, parallel=4, ctx=1024, step_tokens=64) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine):
    async with live_openai_client(engine) as oa:
        yield oa


@pytest.mark.parametrize("seed", range(6))
async def test_required_calls_always_parse_and_validate(client, seed):
    resp = await client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400,
        temperature=1.0, seed=seed)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        validate(call.function.name, call.function.arguments)


async def test_named_function_and_one_call(client):
    for name in PARAMS:
        resp = await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=400, temperature=1.0, seed=3,
            tool_choice={"type": "function", "function": {"name": name}}, parallel_tool_calls=False)
        calls = resp.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == [name]
        validate(name, calls[0].function.arguments)


async def test_streamed_calls_add_up_to_the_whole(client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=400, temperature=1.0, seed=11)
    whole = (await client.chat.completions.create(**kwargs)).choices[0].message.tool_calls
    pieces: dict[int, list[str]] = {}
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for piece in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            name, args = pieces.setdefault(piece.index, ["", ""])
            pieces[piece.index] = [name + (piece.function.name or ""),
                                   args + (piece.function.arguments or "")]
    assert [tuple(p) for p in pieces.values()] == [
        (c.function.name, c.function.arguments) for c in whole]


async def test_the_templates_own_calls_are_what_the_grammar_accepts(engine):
    calls = [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}},
             {"id": "call_2", "type": "function", "function": {
                 "name": "leave_note", "arguments": {"text": "hi <b> there", "code": "ABC",
                                                     "ref": "x-ab/12", "tags": ["x"],
                                                     "place": {"room": "A1"}}}}]
    tokenizer = engine.tokenizer
    before = tokenizer.apply_chat_template(ASK, tools=TOOLS)
    after = tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}], tools=TOOLS,
        add_generation_prompt=False)
    assert after.startswith(before)
    reply = after[len(before):].removesuffix("<|im_end|>\n")
    assert reply.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n")
    spec = tool_grammar(TOOLS, "required", parallel=True, fmt="xml",
                        tags=tag_terms(tokenizer.encode, tokenizer.is_special))
    assert spec is not None
    assert accepts(Grammars(tokenizer), spec, reply), reply


def accepts(grammars: Grammars, spec: GrammarSpec, text: str) -> bool:
    mask = grammars.mask_for(spec)
    for token in grammars.tokenizer.encode(text):
        if not mask.allowed()[token]:
            return False
        mask.consume(token)
    return mask.is_accepting
