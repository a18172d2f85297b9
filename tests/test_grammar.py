"""Constrained decoding on the tiny engine: every output matches its grammar, and the gates
hold with masks (and logit_bias, min_tokens, penalties) on (a row's mask depends on its own tokens only): concurrent == solo and
drafted == plain (drafts verified under the mask), greedy and seeded; idle is empty."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.engine_helpers import idle_stats
from tf_async import BadInputError, Engine
from tf_async.api_types import GrammarSpec

pytestmark = pytest.mark.asyncio

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2}},
    "required": ["n", "kind", "tags"], "additionalProperties": False}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
PROMPTS = ["Hello there", "A list:", "Numbers 1 2 3", "Once upon a time"]


def sampling(index: int, seeded: bool, constrained: bool) -> dict:
    kw: dict = {"max_tokens": 64}
    if seeded:
        kw |= {"temperature": 1.5, "seed": 40 + index}
    if constrained:
        kw["grammar"] = SPEC
    return kw


def make_engine(ckpt, **kw) -> Engine:  # noqa: ANN001
    # ngram_min 1: random tiny-model text rarely repeats 2-grams
    return Engine(ckpt, device="cpu", parallel=4, ctx=256, page_size=4, step_tokens=16,
                  ngram_min=1, **kw)


async def test_outputs_match_the_schema(tiny_llama_dir):
    async with make_engine(tiny_llama_dir) as eng:
        for seeded in (False, True):
            outs = await asyncio.gather(*(eng.complete(p, **sampling(i, seeded, True))
                                          for i, p in enumerate(PROMPTS)))
            for out in outs:
                assert out.finish_reason == "stop", out.text
                jsonschema.validate(json.loads(out.text), SCHEMA)
        await idle_stats(eng)


async def test_concurrent_equals_solo_and_drafted_equals_plain(tiny_llama_dir):
    async def run(eng: Engine, together: bool, seeded: bool) -> list[list[int]]:
        # even rows: a grammar; odd rows: logit_bias, min_tokens and penalties (host path too)
        others = {"logit_bias": {7: 3.0, 11: -5.0}, "min_tokens": 5, "presence_penalty": 0.5}
        calls = [eng.complete(p, **sampling(i, seeded, i % 2 == 0), **({} if i % 2 == 0 else others))
                 for i, p in enumerate(PROMPTS)]
        if together:
            outs = await asyncio.gather(*calls)
        else:
            outs = [await call for call in calls]
        return [o.token_ids for o in outs]

    async with make_engine(tiny_llama_dir) as plain:
        want = {seeded: await run(plain, False, seeded) for seeded in (False, True)}
        for seeded in (False, True):
            assert await run(plain, True, seeded) == want[seeded]
    async with make_engine(tiny_llama_dir, drafter="ngram", draft_tokens=4) as drafted:
        for seeded in (False, True):
            assert await run(drafted, True, seeded) == want[seeded]
        assert drafted.stats()["drafted_tokens"] > 0
        await idle_stats(drafted)


async def test_bad_grammars_are_bad_input(tiny_llama_dir):
    async with make_engine(tiny_llama_dir) as eng:
        for spec in (GrammarSpec("json_schema", '{"type": "objekt"}', "response_format"),
                     GrammarSpec("lark", "start: (", "grammar")):
            with pytest.raises(BadInputError) as info:
                await eng.complete("hi", max_tokens=4, grammar=spec)
            assert info.value.param == spec.param and "invalid" in info.value.message


async def test_unbounded_schemas_get_bounds_that_keep_them_valid():
    from tf_async.engine.grammar import MAX_STRING_CHARS, bounded_numbers

    schema = {"type": "object", "properties": {
        "x": {"type": "number"}, "n": {"type": "integer", "maximum": 3}, "s": {"type": "string"},
        "e": {"type": "string", "enum": ["a"]}, "type": {"type": "string", "maxLength": 4}}}
    out = bounded_numbers(schema)["properties"]
    assert out["x"] == {"type": "number", "minimum": -1e15, "maximum": 1e15, "multipleOf": 1e-6}
    assert out["n"] == {"type": "integer", "maximum": 3, "minimum": -1e15}
    assert out["s"] == {"type": "string", "maxLength": MAX_STRING_CHARS}
    assert out["e"] == schema["properties"]["e"] and out["type"] == schema["properties"]["type"]
    free = bounded_numbers({"type": "object"})
    jsonschema.validate({"a": [1, "b"], "c": {"d": None}}, free)  # nested values still allowed
