"""Run in a fresh process by tests/test_warmup.py (and tests/test_gpu_warmup.py with
`--device cuda`): after `Engine.warm_up()`, a varied set of requests compiles no new kernel
signature (every Numba dispatcher of the backend, the CPU's or cuda_kernels', keeps the
signatures it had after the warm-up). Prints a JSON line {"new": {...}, "idle": ..., ...}
with the wall seconds of the requests' first run and of a second run on other prompts
(what the first still paid for, in a human's eyes: tests assert no timing).

    python -m tests.warmup_check FOLDER [DRAFTER] [--device cuda] [--sample]

--sample: every thread's stack is sampled every 2 ms during the first run, and the functions
seen most (inclusive, by file:function) go to stderr: where the first run's time went.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import sys
import threading
import time

from numba.core.registry import CPUDispatcher

from tf_async import Engine
from tf_async.backend.cpu import gdn, kernels


def signatures(device: str) -> dict[str, int]:
    if device == "cuda":
        # Every CUDA dispatcher alive: the modules' kernels and those their factories keep in
        # dicts per variant (a tile shape, a head size), which a new row range can add.
        from numba.cuda.dispatcher import CUDADispatcher

        found: collections.Counter[str] = collections.Counter()
        for obj in gc.get_objects():
            if isinstance(obj, CUDADispatcher):
                func = obj.py_func
                found[f"{func.__module__}.{func.__qualname__}"] += len(obj.overloads)
        return dict(found)
    return {f"{module.__name__}.{name}": len(obj.signatures)
            for module in (kernels, gdn) for name, obj in vars(module).items()
            if isinstance(obj, CPUDispatcher)}


async def requests(engine: Engine, topic: str = "lighthouses and the sea") -> None:
    user = [{"role": "user", "content": f"Tell me about {topic}."}]
    long_prompt = f"the keeper of {topic} walks up " * 8
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


class StackSampler:
    """Counts, every `period_s`, each function on any other thread's stack (once a sample)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period_s):
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                seen: set[str] = set()
                while ident != me and frame is not None:
                    code = frame.f_code
                    seen.add(f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}")
                    frame = frame.f_back
                self.counts.update(seen)

    def report(self, top: int = 40) -> str:
        lines = [f"{self.samples} samples of {self.period_s * 1e3:.0f} ms"]
        lines += [f"{count:6d} {name}" for name, count in self.counts.most_common(top)]
        return "\n".join(lines)


async def main(folder: str, drafter: str | None, device: str, sample: bool = False) -> None:
    async with Engine(folder, device=device, parallel=3, ctx=256, page_size=8, step_tokens=16,
                      drafter=drafter) as engine:
        await engine.warm_up()
        before = signatures(device)
        started = time.perf_counter()
        if sample:
            with StackSampler() as sampler:
                await requests(engine)
            print(sampler.report(), file=sys.stderr)
        else:
            await requests(engine)
        first_s = time.perf_counter() - started
        after = signatures(device)
        started = time.perf_counter()
        await requests(engine, "rivers and the hills")
        second_s = time.perf_counter() - started
        new = {name: after.get(name, 0) - before.get(name, 0) for name in after
               if after.get(name, 0) != before.get(name, 0)}
        print(json.dumps({"new": new, "idle": engine.stats()["pages_in_use"],
                          "compiled": sum(1 for n in before.values() if n),
                          "first_s": round(first_s, 3), "second_s": round(second_s, 3)}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("drafter", nargs="?", default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sample", action="store_true", help="where the first run's time went")
    parsed = parser.parse_args()
    asyncio.run(main(parsed.folder, parsed.drafter, parsed.device, parsed.sample))
