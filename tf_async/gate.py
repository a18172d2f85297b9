"""The gates: the same requests under two settings must give the same tokens.

`tf-async gate` runs them on a model and device and prints a table; the tests call
`run_gates` on tiny models.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
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


def sampling(mode: str, index: int, max_tokens: int) -> dict[str, Any]:
    if mode == "greedy":
        return {"max_tokens": max_tokens, "temperature": 0.0}
    return {"max_tokens": max_tokens, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1000 + index}


async def generate(engine: Engine, prompts: list[str], mode: str, max_tokens: int,
                   *, concurrent: bool, seeds: list[int] | None = None) -> list[list[int]]:
    """Token ids for each prompt, run all at once or one at a time (seed i+1000 unless given)."""
    seeds = seeds if seeds is not None else list(range(len(prompts)))

    async def one(i: int, prompt: str) -> list[int]:
        done = await engine.complete(prompt, **sampling(mode, seeds[i], max_tokens))
        return done.token_ids

    if concurrent:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return [await one(i, p) for i, p in enumerate(prompts)]


def _count(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


async def run_gates(model: str | Checkpoint | None, *, device: str = "auto", kv_dtype: str = "f32",
                    max_tokens: int = 16, prompts: tuple[str, ...] = PROMPTS, ctx: int = 512,
                    drafter: str | None = None, draft_tokens: int = 4) -> tuple[list[GateRow], dict]:
    from .engine.build import load_model

    ckpt = await asyncio.to_thread(load_model, model)
    base = dict(device=device, ctx=ctx, kv_dtype=kv_dtype, page_size=16)
    rows: list[GateRow] = []
    plist = list(prompts)
    idle: dict = {}
    for mode in ("greedy", "seeded"):
        async with Engine(ckpt, parallel=1, step_tokens=512, **base) as solo_engine:
            solo = await generate(solo_engine, plist, mode, max_tokens, concurrent=False)
        for n in (1, 2, 4, 8):
            picks = [i % len(plist) for i in range(n)]  # fewer prompts than streams: repeat them
            async with Engine(ckpt, parallel=n, step_tokens=64, **base) as eng:
                got = await generate(eng, [plist[i] for i in picks], mode, max_tokens,
                                     concurrent=True, seeds=picks)
                idle[f"concurrent{n}-{mode}"] = eng.stats()
            rows.append(GateRow(f"concurrent == solo ({n})", mode, _count(got, [solo[i] for i in picks]), n))
        async with Engine(ckpt, parallel=4, paging=False, step_tokens=64, **base) as eng:
            got = await generate(eng, plist, mode, max_tokens, concurrent=True)
            idle[f"contiguous-{mode}"] = eng.stats()
        rows.append(GateRow("paging == contiguous", mode, _count(got, solo), len(plist)))
        for step in (1, 3, 7):
            async with Engine(ckpt, parallel=4, step_tokens=step, **base) as eng:
                got = await generate(eng, plist, mode, max_tokens, concurrent=True)
                idle[f"stepped{step}-{mode}"] = eng.stats()
            rows.append(GateRow(f"stepped == whole (step {step})", mode, _count(got, solo), len(plist)))
        if drafter:
            async with Engine(ckpt, parallel=4, step_tokens=64, drafter=drafter,
                              draft_tokens=draft_tokens, **base) as eng:
                got = await generate(eng, plist, mode, max_tokens, concurrent=True)
                idle[f"drafted-{mode}"] = eng.stats()
            rows.append(GateRow(f"drafted == plain ({drafter}, k={draft_tokens})", mode,
                                _count(got, solo), len(plist)))
    empty = sum(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0
                and s.get("draft_areas_in_use", 0) == 0 for s in idle.values())
    rows.append(GateRow("idle is empty", "all", empty, len(idle)))
    return rows, idle


def format_table(rows: list[GateRow]) -> str:
    lines = [f"{'gate':<40} {'sampling':<8} {'result':>8}  ok", "-" * 64]
    for r in rows:
        lines.append(f"{r.name:<40} {r.mode:<8} {r.passed:>3}/{r.total:<4}  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def main_gate(args: Any) -> int:
    t0 = time.perf_counter()
    rows, _ = asyncio.run(run_gates(args.model, device=args.device, kv_dtype=args.kv_dtype,
                                    max_tokens=args.max_tokens, drafter=args.drafter,
                                    draft_tokens=args.draft_tokens))
    print(format_table(rows))
    print(f"\n{sum(r.ok for r in rows)}/{len(rows)} gates pass ({time.perf_counter() - t0:.1f} s)")
    return 0 if all(r.ok for r in rows) else 1
