"""The gates: the same requests under two settings must give the same tokens.

`tf-async gate` runs them on a model and device and prints a table; the tests call
`run_gates` on tiny models.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from .api import Engine
from .models.checkpoint import Checkpoint

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers: 2, 3,",
    "Once upon a time, in a land far away, there lived a",
    "def add(a, b):\n    return",
    "Translate to French: good morning, my friend.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Explain photosynthesis in one sentence, then explain it again in simpler words for a child.",
)


@dataclass(frozen=True, slots=True)
class GateRow:
    name: str
    mode: str  # "greedy" or "seeded"
    passed: int
    total: int

    @property
    def ok(self) -> bool:
        return self.passed == self.total


def sampling(mode: str, index: int, max_tokens: int, temperature: float = 0.9) -> dict[str, Any]:
    if mode == "greedy":
        return {"max_tokens": max_tokens, "temperature": 0.0}
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": 0.95, "top_k": 40,
            "seed": 1000 + index}


async def generate(engine: Engine, prompts: list[str], mode: str, max_tokens: int,
                   *, concurrent: bool, seeds: list[int] | None = None,
                   temperature: float = 0.9) -> list[list[int]]:
    """Token ids for each prompt, run all at once or one at a time (seed i+1000 unless given)."""
    seeds = seeds if seeds is not None else list(range(len(prompts)))

    async def one(i: int, prompt: str) -> list[int]:
        done = await engine.complete(prompt, **sampling(mode, seeds[i], max_tokens, temperature))
        return done.token_ids

    if concurrent:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return [await one(i, p) for i, p in enumerate(prompts)]


def _count(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


async def run_gates(model: str | Checkpoint | None, *, device: str = "auto", kv_dtype: str = "f32",
                    max_tokens: int = 16, prompts: tuple[str, ...] = PROMPTS, ctx: int = 512,
                    drafter: str | None = None, draft_tokens: int = 4,
                    drafters: tuple[str, ...] = (), temperature: float = 0.9,
                    cuda_graphs: bool = True, tensor_parallel: int = 1,
                    page_size: int = 16) -> tuple[list[GateRow], dict]:
    """Every gate on `model`; drafted == plain once per drafter (`drafter` and `drafters`);
    seeded rows sample at `temperature`; cuda_graphs, tensor_parallel and page_size as
    Engine's (every engine of the run: the gates hold within a TP size). Returns (rows,
    engine stats at the end of each run)."""
    from .engine.build import load_model

    ckpt = await asyncio.to_thread(load_model, model)
    run = GateRun(ckpt, dict(device=device, ctx=ctx, kv_dtype=kv_dtype, page_size=page_size,
                             cuda_graphs=cuda_graphs, tensor_parallel=tensor_parallel),
                  list(prompts), max_tokens, temperature)
    specs = ([drafter] if drafter else []) + list(drafters)
    rows: list[GateRow] = []
    for mode in ("greedy", "seeded"):
        rows += await run.mode_rows(mode, specs, draft_tokens)
    empty = sum(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0
                and s.get("draft_areas_in_use", 0) == 0 for s in run.idle.values())
    rows.append(GateRow("idle is empty", "all", empty, len(run.idle)))
    return rows, run.idle


@dataclass(slots=True)
class GateRun:
    """The engines of one `run_gates` call; `idle` keeps each engine's stats at its end."""

    ckpt: Checkpoint
    base: dict[str, Any]
    prompts: list[str]
    max_tokens: int
    temperature: float
    idle: dict[str, Any] = field(default_factory=dict)

    async def outputs(self, key: str, mode: str, engine_options: dict[str, Any],
                      picks: list[int] | None = None) -> list[list[int]]:
        """All prompts (or `picks` of them, seeded by index) at once on one engine."""
        prompts = self.prompts if picks is None else [self.prompts[i] for i in picks]
        async with Engine(self.ckpt, **self.base, **engine_options) as eng:
            got = await generate(eng, prompts, mode, self.max_tokens, concurrent=True,
                                 seeds=picks, temperature=self.temperature)
            self.idle[f"{key}-{mode}"] = eng.stats()
        return got

    async def complete(self, eng: Engine, ids: list[int], index: int, mode: str) -> list[int]:
        done = await eng.complete(ids, **sampling(mode, index, self.max_tokens, self.temperature))
        return done.token_ids

    async def resumed_row(self, mode: str, solo: list[list[int]]) -> GateRow:
        """Turn 2 of each prompt's chat (turn 1, its output, a follow-up) on an engine that
        served turn 1 (prefix cache, all chats at once), against turn 2 alone on a fresh
        engine without the cache."""
        async with Engine(self.ckpt, parallel=1, step_tokens=512, prefix_cache=False,
                          **self.base) as fresh_engine:
            turns = [_turn_two(fresh_engine, p, solo[i]) for i, p in enumerate(self.prompts)]
            fresh = [await self.complete(fresh_engine, t, i, mode) for i, t in enumerate(turns)]
        async with Engine(self.ckpt, parallel=4, step_tokens=64, **self.base) as eng:
            async def chat(i: int) -> list[int]:
                first = await self.complete(eng, _turn_one(eng, self.prompts[i]), i, mode)
                return await self.complete(eng, _turn_two(eng, self.prompts[i], first), i, mode)

            got = list(await asyncio.gather(*(chat(i) for i in range(len(self.prompts)))))
            self.idle[f"resumed-{mode}"] = eng.stats()
        return GateRow("resumed == fresh (turn 2)", mode, _count(got, fresh), len(self.prompts))

    async def mode_rows(self, mode: str, drafters: list[str], draft_tokens: int) -> list[GateRow]:
        async with Engine(self.ckpt, parallel=1, step_tokens=512, prefix_cache=False,
                          **self.base) as solo_engine:
            solo = await generate(solo_engine, self.prompts, mode, self.max_tokens,
                                  concurrent=False, temperature=self.temperature)
        rows, total = [], len(self.prompts)
        for n in (1, 2, 4, 8):
            picks = [i % total for i in range(n)]  # fewer prompts than streams: repeat them
            got = await self.outputs(f"concurrent{n}", mode, dict(parallel=n, step_tokens=64), picks)
            rows.append(GateRow(f"concurrent == solo ({n})", mode,
                                _count(got, [solo[i] for i in picks]), n))
        got = await self.outputs("contiguous", mode, dict(parallel=4, paging=False, step_tokens=64))
        rows.append(GateRow("paging == contiguous", mode, _count(got, solo), total))
        for step in (1, 3, 7):
            got = await self.outputs(f"stepped{step}", mode, dict(parallel=4, step_tokens=step))
            rows.append(GateRow(f"stepped == whole (step {step})", mode, _count(got, solo), total))
        got = await self.outputs("decode-steps", mode, dict(parallel=4, step_tokens=64, decode_steps=4))
        rows.append(GateRow("decode steps == one step (4)", mode, _count(got, solo), total))
        rows.append(await self.resumed_row(mode, solo))
        for spec in drafters:
            got = await self.outputs(f"drafted-{spec}", mode, dict(
                parallel=4, step_tokens=64, drafter=spec, draft_tokens=draft_tokens))
            rows.append(GateRow(f"drafted == plain ({spec}, k={draft_tokens})", mode,
                                _count(got, solo), total))
        return rows


FOLLOW_UP = " Tell me more about that."


def _turn_one(eng: Engine, prompt: str) -> list[int]:
    return eng.tokenizer.encode(prompt, add_special_tokens=eng.tokenizer.add_bos)


def _turn_two(eng: Engine, prompt: str, answer: list[int]) -> list[int]:
    return _turn_one(eng, prompt) + answer + eng.tokenizer.encode(FOLLOW_UP, add_special_tokens=False)


def format_table(rows: list[GateRow]) -> str:
    lines = [f"{'gate':<40} {'sampling':<8} {'result':>8}  ok", "-" * 64]
    for r in rows:
        lines.append(f"{r.name:<40} {r.mode:<8} {r.passed:>3}/{r.total:<4}  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main_gate(args: Any) -> int:
    t0 = time.perf_counter()
    drafter = None if args.drafter in (None, "none") else args.drafter
    rows, _ = asyncio.run(run_gates(args.model, device=args.device, kv_dtype=args.kv_dtype,
                                    max_tokens=args.max_tokens, drafter=drafter,
                                    draft_tokens=args.draft_tokens,
                                    cuda_graphs=args.cuda_graphs,
                                    tensor_parallel=args.tensor_parallel))
    print(format_table(rows))
    print(f"\n{sum(r.ok for r in rows)}/{len(rows)} gates pass ({time.perf_counter() - t0:.1f} s)")
    return 0 if all(r.ok for r in rows) else 1
