"""Structured outputs on the default model: 50 varied JSON schemas, each output validated
(jsonschema), constrained vs unconstrained tokens/s, and the grammar mask's cost per token.

    python benchmarks/structured_outputs.py [--max-tokens 256] [--parallel 1] [--constrained-only]

The constrained run asks each prompt with its schema as the grammar (greedy); the
unconstrained run asks the same prompts with no grammar. The two modes alternate request by request
(`--parallel` at a time), so both see the same load on a shared machine. tokens/s, two ways:
per request (tokens / time from submit to finish, summed over replies: the prompt included,
so a short reply counts its prompt's time against few tokens), and the decode rate per
stream (tokens after the first / time from first token to last: the cost of the mask and
the host sampling, without the prompt); both modes are warmed
up at that width first (Numba compiles a kernel per batch shape on first use). The mask cost
replays every constrained output through a fresh mask: compute + apply + consume, per token.

A reply cut by max_tokens is an unfinished JSON text (finish_reason "length", as OpenAI
does): the budget must let the answer fit. Where a schema sets no bounds, the grammar's own
(engine/grammar.py) allow up to 100 characters a string and 16 digits a number, and SmolLM2
spends one token a digit: an answer with two free strings of digits needs ~250 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

import jsonschema
import numpy as np

from tf_async import Engine
from tf_async.api_types import GrammarSpec
from tf_async.models.default import default_model_path

S, INT, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None, **extra: object) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **extra}


def arr(items: dict, **extra: object) -> dict:
    return {"type": "array", "items": items, **extra}


ADDRESS = obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", obj({"name": S, "age": INT})),
    ("a city", obj({"name": S, "country": S, "population_millions": N})),
    ("a book", obj({"title": S, "author": S, "year": INT, "in_print": B})),
    ("a color", obj({"name": S, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a weather report", obj({"city": S, "temperature_c": N, "sky": {"enum": ["sunny", "cloudy", "rain"]}})),
    ("a list of three fruits", obj({"fruits": arr(S, minItems=3, maxItems=3)})),
    ("a shopping list", obj({"items": arr(obj({"name": S, "quantity": INT}), maxItems=5)})),
    ("a movie", obj({"title": S, "genres": arr({"enum": ["drama", "comedy", "action", "sci-fi"]}), "rating": N})),
    ("a user profile", obj({"username": S, "email": {"type": "string", "format": "email"}, "active": B})),
    ("an address", ADDRESS),
    ("a company", obj({"name": S, "founded": INT, "headquarters": ADDRESS})),
    ("a point", obj({"x": N, "y": N})),
    ("a rectangle", obj({"top_left": obj({"x": INT, "y": INT}), "width": INT, "height": INT})),
    ("a yes/no answer", obj({"answer": {"enum": ["yes", "no"]}, "reason": S})),
    ("a sentiment", obj({"label": {"enum": ["positive", "negative", "neutral"]}, "score": N})),
    ("a recipe", obj({"name": S, "ingredients": arr(S, maxItems=6), "minutes": INT})),
    ("a country", obj({"name": S, "capital": S, "languages": arr(S, maxItems=4)})),
    ("a planet", obj({"name": S, "moons": INT, "has_rings": B})),
    ("an animal", obj({"species": S, "legs": {"type": "integer", "minimum": 0, "maximum": 8}})),
    ("a date", obj({"year": INT, "month": {"type": "integer", "minimum": 1, "maximum": 12},
                    "day": {"type": "integer", "minimum": 1, "maximum": 31}})),
    ("an event", obj({"name": S, "date": {"type": "string", "format": "date"}, "attendees": INT})),
    ("a product", obj({"sku": S, "price": N, "tags": arr(S, maxItems=3), "stock": INT})),
    ("an optional nickname", obj({"name": S, "nickname": {"type": ["string", "null"]}})),
    ("a translation", obj({"source": S, "target": S, "language": {"enum": ["fr", "de", "es"]}})),
    ("a math answer", obj({"question": S, "answer": INT})),
    ("a todo item", obj({"task": S, "done": B, "priority": {"enum": ["low", "medium", "high"]}})),
    ("a song", obj({"title": S, "artist": S, "seconds": INT})),
    ("a car", obj({"make": S, "model": S, "year": INT, "electric": B})),
    ("a team", obj({"name": S, "members": arr(obj({"name": S, "role": S}), maxItems=3)})),
    ("a key-value map", obj({"entries": {"type": "object", "additionalProperties": S, "maxProperties": 3}})),
    ("a classification", {"anyOf": [obj({"kind": {"const": "cat"}, "indoor": B}),
                                     obj({"kind": {"const": "dog"}, "breed": S})]}),
    ("a number list", obj({"values": arr(INT, minItems=1, maxItems=5)})),
    ("a matrix", obj({"rows": arr(arr(INT, maxItems=3), maxItems=3)})),
    ("a status", obj({"code": {"type": "integer", "enum": [200, 404, 500]}, "message": S})),
    ("a temperature range", obj({"low": N, "high": N, "unit": {"enum": ["C", "F"]}})),
    ("a phone contact", obj({"name": S, "phone": {"type": "string", "pattern": "^\\+?[0-9 ]{6,15}$"}})),
    ("a short summary", obj({"summary": {"type": "string", "maxLength": 80}})),
    ("a title and body", obj({"title": {"type": "string", "minLength": 3, "maxLength": 40}, "body": S})),
    ("a boolean flag", obj({"enabled": B})),
    ("a version", obj({"major": INT, "minor": INT, "patch": INT})),
    ("a URL record", obj({"url": {"type": "string", "format": "uri"}, "title": S})),
    ("a nested config", obj({"server": obj({"host": S, "port": INT}), "debug": B})),
    ("a tree node", {"$defs": {"node": obj({"name": S, "children": arr({"$ref": "#/$defs/node"}, maxItems=2)})},
                     "$ref": "#/$defs/node"}),
    ("an order", obj({"id": INT, "lines": arr(obj({"product": S, "qty": INT, "price": N}), maxItems=3),
                      "paid": B})),
    ("a quiz question", obj({"question": S, "options": arr(S, minItems=2, maxItems=4), "correct": INT})),
    ("a coordinate list", obj({"points": arr(obj({"lat": N, "lon": N}), maxItems=3)})),
    ("a language fact", obj({"language": S, "speakers_millions": N, "official_in": arr(S, maxItems=3)})),
    ("a review", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "text": S},
                     additionalProperties=False)),
    ("a partial record", obj({"name": S, "age": INT, "city": S}, required=["name"])),
    ("any JSON object", {"type": "object"}),
]


def prompt_for(what: str, schema: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me {what} as JSON matching this schema: "
                                        f"{json.dumps(schema)}"}]


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    finish_reason: str
    total_s: float  # submitted to finished
    decode_s: float  # first token to last: the decode steps only (no prompt)


async def timed_chat(engine: Engine, messages: list[dict], **kwargs: object) -> Reply:
    ids: list[int] = []
    texts: list[str] = []
    start = first = time.perf_counter()
    finish = ""
    async with engine.chat(messages, **kwargs) as stream:
        async for delta in stream:
            if not ids and delta.token_ids:
                first = time.perf_counter()
            ids += delta.token_ids
            texts.append(delta.text)
            finish = delta.finish_reason or finish
    end = time.perf_counter()
    return Reply("".join(texts), ids, finish, end - start, end - first)


async def run(engine: Engine, max_tokens: int, parallel: int, modes: tuple[bool, ...]):
    """Each schema asked once per mode (constrained or not), modes alternating, `parallel`
    requests at a time: both modes see the same machine load."""
    sem = asyncio.Semaphore(parallel)

    async def one(what: str, schema: dict, constrained: bool) -> Reply:
        kw = {"grammar": GrammarSpec("json_schema", json.dumps(schema))} if constrained else {}
        async with sem:
            return await timed_chat(engine, prompt_for(what, schema), max_tokens=max_tokens,
                                    temperature=0, **kw)

    outs = await asyncio.gather(*(one(what, schema, mode) for what, schema in SCHEMAS
                                  for mode in modes))
    return [outs[i::len(modes)] for i in range(len(modes))]


def request_rate(outs: list[Reply]) -> float:
    """Tokens/s of a request, its prompt included: tokens / time from submit to finish."""
    return sum(len(o.token_ids) for o in outs) / sum(o.total_s for o in outs)


def decode_rate(outs: list[Reply]) -> float:
    """Decode tokens/s of a stream: tokens after the first / time from first to last."""
    return sum(len(o.token_ids) - 1 for o in outs) / sum(o.decode_s for o in outs)


def mask_cost(engine: Engine, outs: list) -> float:
    """Seconds per token to compute, apply and advance a mask (replayed outputs)."""
    vocab = engine.tokenizer.vocab_size
    logits = np.zeros(vocab, np.float32)
    total, tokens = 0.0, 0
    for (_, schema), out in zip(SCHEMAS, outs, strict=True):
        mask = engine._grammars.mask_for(GrammarSpec("json_schema", json.dumps(schema)))
        start = time.perf_counter()
        for token in out.token_ids:
            mask.apply(logits)
            mask.consume(token)
        total += time.perf_counter() - start
        tokens += len(out.token_ids)
    return total / max(tokens, 1)


async def warm_up(engine: Engine, parallel: int) -> None:
    what, schema = SCHEMAS[0]
    for grammar in (None, GrammarSpec("json_schema", json.dumps(schema))):
        await asyncio.gather(*(engine.chat_complete(prompt_for(what, schema), max_tokens=8,
                                                    temperature=0, grammar=grammar)
                               for _ in range(parallel)))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated schema numbers (0-based)")
    parser.add_argument("--constrained-only", action="store_true", help="skip the tok/s ratio")
    args = parser.parse_args()
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        SCHEMAS[:] = [s for i, s in enumerate(SCHEMAS) if i in keep]
    async with Engine(default_model_path(), device="cpu", parallel=args.parallel, ctx=2048) as engine:
        await warm_up(engine, args.parallel)
        start = time.perf_counter()
        modes = (True,) if args.constrained_only else (False, True)
        *frees, fixed = await run(engine, args.max_tokens, args.parallel, modes)
        print(f"run: {time.perf_counter() - start:.0f} s", flush=True)
        failures = []
        for (what, schema), out in zip(SCHEMAS, fixed, strict=True):
            try:
                jsonschema.validate(json.loads(out.text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append((what, out.finish_reason, out.text[:120], str(exc)[:120]))
        print(f"schemas: {len(SCHEMAS)}  valid: {len(SCHEMAS) - len(failures)}  longest reply: "
              f"{max(len(o.token_ids) for o in fixed)} tokens (max_tokens {args.max_tokens})")
        for failure in failures:
            print("  FAIL", failure)
        for free in frees:
            for name, rate in (("per request, prompt included", request_rate),
                               ("decode, per stream", decode_rate)):
                print(f"{name}: unconstrained {rate(free):.1f} tok/s  constrained "
                      f"{rate(fixed):.1f} tok/s  ratio {rate(fixed) / rate(free):.2f}")
        print(f"mask cost: {mask_cost(engine, fixed) * 1e3:.3f} ms/token "
              f"(compute + apply + consume, vocab {engine.tokenizer.vocab_size})")


if __name__ == "__main__":
    asyncio.run(main())
