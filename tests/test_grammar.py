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


NAMES = {"enum": ["a", "b"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "name": NAMES, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}},
    "required": ["name", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
ROOT_TREE = {"type": "object", "properties": {"name": NAMES, "child": {"$ref": "#"}},
             "required": ["name"], "additionalProperties": False}


def chain(depth: int, key: str) -> dict:
    """A tree `depth` nodes deep, as TREE (children lists) or ROOT_TREE (child objects) has it."""
    if key == "children":
        return {"name": "a", "children": [chain(depth - 1, key)] if depth > 1 else []}
    return {"name": "a", **({"child": chain(depth - 1, key)} if depth > 1 else {})}


def accepts(grammars, schema: dict, value: dict) -> bool:  # noqa: ANN001
    """Does the schema's mask let the value's compact JSON text through to the end?"""
    mask = grammars.mask_for(GrammarSpec("json_schema", json.dumps(schema)))
    for token in grammars.tokenizer.encode(json.dumps(value)):
        if not mask.allowed()[token]:
            return False
        mask.consume(token)
    return mask.is_accepting


@pytest.mark.parametrize(("schema", "key"), [(TREE, "children"), (ROOT_TREE, "child")])
async def test_recursive_schemas_nest_at_most_max_nesting_levels(tiny_llama, schema, key):
    from tf_async.engine.grammar import Grammars
    from tf_async.engine.schema_depth import MAX_NESTING, bounded_depth

    grammars = Grammars(tiny_llama.tokenizer)
    for depth in range(1, MAX_NESTING + 3):
        jsonschema.validate(chain(depth, key), schema)  # the schema itself has no bound
        bounded = jsonschema.Draft202012Validator(bounded_depth(schema))
        assert bounded.is_valid(chain(depth, key)) == (depth <= MAX_NESTING), depth
        assert accepts(grammars, schema, chain(depth, key)) == (depth <= MAX_NESTING), depth


async def test_a_schema_that_cannot_end_within_the_bound_is_kept_as_given(tiny_llama):
    from tf_async.engine.grammar import Grammars
    from tf_async.engine.schema_depth import MAX_NESTING

    # a ring of MAX_NESTING + 1 definitions where only the last may end the nesting
    names = [f"d{i}" for i in range(MAX_NESTING + 1)]
    defs = {name: {"type": "object", "properties": {"next": {"$ref": f"#/$defs/{nxt}"}},
                   "required": [] if name == names[-1] else ["next"], "additionalProperties": False}
            for name, nxt in zip(names, names[1:] + names[:1], strict=True)}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    deepest: dict = {}  # the shortest value: MAX_NESTING + 1 objects
    for _ in range(MAX_NESTING):
        deepest = {"next": deepest}
    jsonschema.validate(deepest, schema)
    assert accepts(Grammars(tiny_llama.tokenizer), schema, deepest)


async def test_recursive_schema_outputs_end_and_validate(tiny_llama_dir):
    async with make_engine(tiny_llama_dir) as eng:
        outs = await asyncio.gather(*(eng.complete(p, max_tokens=200, temperature=1.5, seed=i,
                                                   grammar=GrammarSpec("json_schema", json.dumps(TREE)))
                                      for i, p in enumerate(PROMPTS)))
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), TREE)
        await idle_stats(eng)
