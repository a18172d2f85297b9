"""Run in a fresh process by tests/test_warmup.py: after `Engine.warm_up()`, a varied set of
requests compiles no new kernel signature (every Numba dispatcher of the CPU backend keeps
the signatures it had after the warm-up). Prints a JSON line {"new": {...}, "idle": {...}}."""

from __future__ import annotations

import asyncio
import json
import sys

from numba.core.registry import CPUDispatcher

from tf_async import Engine
from tf_async.backend.cpu import gdn, kernels


def signatures() -> dict[str, int]:
    return {f"{module.__name__}.{name}": len(obj.signatures)
            for module in (kernels, gdn) for name, obj in vars(module).items()
            if isinstance(obj, CPUDispatcher)}


async def requests(engine: Engine) -> None:
    user = [{"role": "user", "content": "Tell me about lighthouses and the sea."}]
    long_prompt = "the keeper walks up " * 8
    await asyncio.gather(
        engine.chat_complete(user, max_tokens=6, temperature=0),
        engine.chat_complete(user, max_tokens=5, temperature=0.9, seed=3, top_k=5, top_p=0.8,
                             min_p=0.05, presence_penalty=0.3, frequency_penalty=0.2,
                             repetition_penalty=1.2, logprobs=3),
        engine.complete(long_prompt, max_tokens=7, temperature=0.7, seed=11),
        engine.complete("one two one two one two one two", max_tokens=9, stop=["x"]),
    )
    async for _ in engine.stream("hello there", max_tokens=3, ignore_eos=True):
        pass


async def main(folder: str, drafter: str | None) -> None:
    async with Engine(folder, device="cpu", parallel=3, ctx=256, page_size=8, step_tokens=16,
                      drafter=drafter) as engine:
        await engine.warm_up()
        before = signatures()
        await requests(engine)
        after = signatures()
        new = {name: after[name] - before[name] for name in after if after[name] != before[name]}
        print(json.dumps({"new": new, "idle": engine.stats()["pages_in_use"],
                          "compiled": sum(1 for n in before.values() if n)}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
