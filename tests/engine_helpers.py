"""Helpers shared by the engine, drafting and hybrid tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from tf_async import Engine
from tf_async.engine.sequence import RoundPlan

T = TypeVar("T")
STUCK_AFTER_S = 60.0  # far beyond any tiny-model run: only a stuck engine gets there


def engines_on_ops(monkeypatch: Any, make: Callable[[], T]) -> list[T]:
    """Engines built from now on run on `make()` ops (one per engine, in order of building);
    the list returned fills as they are built."""
    made: list[T] = []

    def make_ops(device: str = "auto") -> T:
        made.append(make())
        return made[-1]

    monkeypatch.setattr("tf_async.engine.build.make_ops", make_ops)
    return made


def graph_decoders_built(monkeypatch: Any) -> list[Any]:
    """The decoders engines built from now on run (GraphDecoders where graphs are on), in
    order of building; the list returned fills as they are built."""
    from tf_async.engine import build

    made: list[Any] = []
    maybe_graphs = build._maybe_graphs

    def recorded(decoder: Any, graphs: bool) -> Any:
        made.append(maybe_graphs(decoder, graphs))
        return made[-1]

    monkeypatch.setattr(build, "_maybe_graphs", recorded)
    return made


async def idle_stats(eng: Engine) -> dict[str, Any]:
    """Wait (polling, bounded) until nothing runs or waits; assert the engine holds nothing."""
    for _ in range(1000):
        s = eng.stats()
        if s["running"] == 0 and s["queued"] == 0 and s["lanes_in_use"] == 0:
            break
        await asyncio.sleep(0.005)
    s = eng.stats()
    held = (s["lanes_in_use"], s["pages_in_use"], s.get("draft_areas_in_use", 0))
    assert held == (0, 0, 0), s
    return s


async def run_with_cancels(eng: Engine, prompts: list[str] | tuple[str, ...],
                           kwargs_of: Callable[[int], dict[str, Any]],
                           cancel_after: list[int | None], cancel_task: int) -> list[Any]:
    """Stream every prompt at once; stream i is closed after `cancel_after[i]` tokens, and task
    `cancel_task` is cancelled before its first token (mid-prompt). Returns each stream's ids
    (None when closed early, CancelledError for the cancelled task)."""
    async def one(i: int) -> list[int] | None:
        ids: list[int] = []
        stream = eng.stream(prompts[i], **kwargs_of(i))
        async for delta in stream:
            ids.extend(delta.token_ids)
            if cancel_after[i] is not None and len(ids) >= cancel_after[i]:
                await stream.aclose()  # acted on between rounds, drafts in flight or not
                return None
        return ids

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    await asyncio.sleep(0)  # let every task submit
    tasks[cancel_task].cancel()
    # A leaked lane would leave the other streams queued forever: fail instead of hanging.
    gathered = asyncio.gather(*tasks, return_exceptions=True)
    return list(await asyncio.wait_for(gathered, timeout=STUCK_AFTER_S))


def record_plans(eng: Engine) -> list[RoundPlan]:
    plans: list[RoundPlan] = []
    runner = eng.parts.runner
    execute = runner.execute

    def spy(plan: RoundPlan):
        plans.append(plan)
        return execute(plan)

    runner.execute = spy  # type: ignore[method-assign]
    return plans
