"""Resumed == fresh for drafting engines: the same run on an engine with the prefix cache and on
one without it, every drafter proposal recorded by the stream's tokens (tests of the draft model,
MTP and DFlash rings on resumed streams)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from tests.engine_helpers import idle_stats
from tf_async import Engine

Proposals = dict[tuple[int, ...], tuple[int, ...]]
Turn = tuple[list[int], int, int, int]  # output ids, cached, drafted, accepted tokens


def tokens(seed: int, num_tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 60, num_tokens).tolist()


def sampling(mode: str, index: int) -> dict[str, Any]:
    if mode == "greedy":
        return {"max_tokens": 10, "ignore_eos": True}
    return {"max_tokens": 10, "ignore_eos": True, "temperature": 0.9, "seed": 90 + index}


def record_proposals(eng: Engine) -> Proposals:
    """Every proposal of the engine's drafter, by the stream's tokens and the limit."""
    drafter = eng.parts.scheduler.drafter
    assert drafter is not None
    inner = drafter.propose
    seen: Proposals = {}

    def propose(seq: Any, limit: int) -> tuple[int, ...]:
        drafts = inner(seq, limit)
        seen[(*seq.prompt_ids, -1, *seq.output_ids, -2, limit)] = drafts
        return drafts

    drafter.propose = propose  # type: ignore[method-assign]
    return seen


def turn_of(done: Any) -> Turn:
    usage = done.usage
    return done.token_ids, usage.cached_tokens, usage.drafted_tokens, usage.accepted_tokens


async def chat(eng: Engine, turns: int, mode: str, seed: int) -> list[Turn]:
    history = tokens(seed, 23)
    out = []
    for turn in range(turns):
        prompt = history + tokens(seed + 100 + turn, 5 + 3 * turn)
        done = await eng.complete(prompt, **sampling(mode, turn))
        out.append(turn_of(done))
        history = prompt + done.token_ids
    return out


async def shared_prefix_twice(eng: Engine, num_streams: int, mode: str) -> list[Turn]:
    """Two waves of streams sharing a prefix: the second resumes what the first computed."""
    prefix = tokens(1, 41)
    out: list[Turn] = []
    for wave in range(2):
        prompts = [prefix + tokens(200 + 10 * wave + i, 3 + i) for i in range(num_streams)]
        done = await asyncio.gather(*(eng.complete(p, **sampling(mode, i))
                                      for i, p in enumerate(prompts)))
        out += [turn_of(d) for d in done]
    return out


async def resumed_and_fresh(ckpt: Any, options: dict[str, Any], run: Any
                ) -> tuple[list[Turn], list[Turn], Proposals, Proposals, dict[str, Any]]:
    async with Engine(ckpt, **options) as eng:
        seen = record_proposals(eng)
        resumed = await run(eng)
        stats = await idle_stats(eng)
    async with Engine(ckpt, **options, prefix_cache=False) as eng:
        fresh_seen = record_proposals(eng)
        fresh = await run(eng)
    return resumed, fresh, seen, fresh_seen, stats


def differing(seen: Proposals, fresh_seen: Proposals) -> tuple[int, int]:
    """(proposals made on the same tokens with the same limit in both runs, how many of them
    differ). A stream's prompt may be cut differently with the cache (its last token then
    decodes with drafts), and the draft pacing's probes (one draft) follow a stream's own
    history of rejected rounds, so only proposals on the same tokens and limit compare."""
    common = set(seen) & set(fresh_seen)
    return len(common), sum(seen[key] != fresh_seen[key] for key in common)
