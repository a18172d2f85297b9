"""Where a decode round's time goes: every public method of the engine's ops timed on the
engine thread (outermost calls only, so nested ops count once), beside the round's phases
(schedule, execute, update) and the round itself, per round, for 1 and 8 streams.

On a GPU each timed op ends with a device synchronize, so its time is its launches plus its
kernels (the run is slower than an untimed one: read the shares, not the totals); CPU ops
are timed as they run. The "other" line of execute is what the runner does around the ops
(packing and uploading the batch, Python between launches).

    python benchmarks/op_profile.py --model default --streams 1 8            # CPU
    python benchmarks/op_profile.py --model default --device cuda --streams 1 8 32
    python benchmarks/op_profile.py --model 35b-a3b --device cuda --streams 1 8
        (27b | 35b-a3b: random MLX 4-bit weights at the real shapes, bench_qwen35_gpu.py's)
    python benchmarks/op_profile.py --model 27b --device cuda --streams 1 --drafter dflash
        (a random 4-bit DFlash2 drafter of the model's shapes; its block forward, LM head,
        context writes and kernels timed as phases; --draft-backoff 0: every round drafts)
    python benchmarks/op_profile.py --model 27b --device cuda --streams 1 --drafter dflash --phases-only
        (--phases-only: no op timers (they sync, which stops graph captures and replays): the
        round's phases with a sync at each end, after a warm-up run as long as the timed one)
    python benchmarks/op_profile.py --model 35b-a3b --device cuda --streams 1 --kernels
        (--kernels: no op timers; the window's GPU kernels (graph replays included) from
        torch.profiler's CUPTI trace, summed by kernel name, per round; add --no-pdl for each
        kernel's own time: with programmatic edges a kernel starts early and waits)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

ENGINE_THREAD = "tf-async-engine"
CLOCK = time.perf_counter  # --clock cpu: time.process_time (CPU seconds of the process)
PHASES = (("scheduler", "schedule"), ("runner", "execute"), ("scheduler", "update"))
# With a drafter: its calls inside schedule (propose) and update (absorb), and the recurrent
# states' commit of accepted rows (hybrids), timed apart.
DRAFT_PHASES = (("scheduler.drafter", "propose"), ("scheduler.drafter", "absorb"),
                ("runner.decoder", "commit_states"))
# A DFlash drafter's parts (its model's forward pieces and its own kernels), where it has them.
DFLASH_PHASES = (("scheduler.drafter.model", "block_hidden"), ("scheduler.drafter.model", "logits"),
                 ("scheduler.drafter.model", "write_context"),
                 ("scheduler.drafter.model.kernels", "block_attention"),
                 ("scheduler.drafter.model.kernels", "grouped_conv"),
                 ("scheduler.drafter.model.kernels", "select_greedy"))


class OpTimer:
    """Times the outermost calls of an ops object's public methods, and chosen phases, on the
    engine thread while `enabled`."""

    def __init__(self, sync: Callable[[], None] | None):
        self.sync = sync
        self.enabled = False
        self.depth = 0
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def _timed(self, name: str, fn: Callable[..., Any], *, sync: bool) -> Callable[..., Any]:
        timer = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if (not timer.enabled or timer.depth
                    or threading.current_thread().name != ENGINE_THREAD):
                return fn(*args, **kwargs)
            timer.depth += 1
            start = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync and timer.sync is not None:
                    timer.sync()
                timer.seconds[name] += CLOCK() - start
                timer.calls[name] += 1
                timer.depth -= 1

        return timed

    def install_ops(self, ops: Any) -> None:
        """Wrap every public method of `ops` (a subclass swapped in: internal calls go through
        the wrappers too, and only the outermost is timed)."""
        cls = type(ops)
        names = [n for n in dir(cls) if not n.startswith("_") and n != "synchronize"
                 and callable(getattr(cls, n))]
        wrapped = {}
        for name in names:
            method = getattr(cls, name)
            wrapped[name] = self._method(f"op {name}", method)
        ops.__class__ = type(f"Timed{cls.__name__}", (cls,), wrapped)

    def _method(self, label: str, method: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._timed(label, method, sync=True)

        def bound(obj: Any, *args: Any, **kwargs: Any) -> Any:
            return timed(obj, *args, **kwargs)

        return bound

    def install_phase(self, owner: Any, name: str) -> None:
        """Time `owner.name` (an instance attribute shadows the method) at any depth."""
        method = getattr(owner, name)
        timer = self

        def phase(*args: Any, **kwargs: Any) -> Any:
            if not timer.enabled or threading.current_thread().name != ENGINE_THREAD:
                return method(*args, **kwargs)
            start = CLOCK()
            depth, timer.depth = timer.depth, 0  # ops inside a phase are outermost again
            try:
                return method(*args, **kwargs)
            finally:
                if timer.sync is not None:  # the phase's device work (graph replays) too
                    timer.sync()
                timer.depth = depth
                timer.seconds[f"phase {name}"] += CLOCK() - start
                timer.calls[f"phase {name}"] += 1

        setattr(owner, name, phase)

    @contextmanager
    def window(self) -> Iterator[None]:
        self.seconds.clear()
        self.calls.clear()
        self.enabled = True
        try:
            yield
        finally:
            self.enabled = False


def table(timer: OpTimer, rounds: int, wall_s: float, label: str) -> list[str]:
    """Per round: ms and calls of each phase and op, the ops' sum inside execute and the rest."""
    per = max(rounds, 1)
    lines = [f"{label}: {rounds} rounds, {1e3 * wall_s / per:.2f} ms a round (wall)",
             f"{'what':<34} {'ms/round':>9} {'calls/round':>11} {'share':>6}"]
    total = timer.seconds.get("phase execute", 0.0) + timer.seconds.get("phase schedule", 0.0) \
        + timer.seconds.get("phase update", 0.0)
    ops = {k: v for k, v in timer.seconds.items() if k.startswith("op ")}
    for name in sorted(timer.seconds, key=lambda k: (not k.startswith("phase"), -timer.seconds[k])):
        ms = 1e3 * timer.seconds[name] / per
        share = timer.seconds[name] / total if total else float("nan")
        lines.append(f"{name:<34} {ms:>9.3f} {timer.calls[name] / per:>11.1f} {share:>6.1%}")
    if not ops:  # --phases-only
        return lines
    rest = timer.seconds.get("phase execute", 0.0) - sum(ops.values())
    lines.append(f"{'execute other (runner, Python)':<34} {1e3 * rest / per:>9.3f} "
                 f"{'':>11} {rest / total if total else float('nan'):>6.1%}")
    return lines


def kernel_table(prof: Any, rounds: int, wall_s: float, label: str) -> list[str]:
    """Per round: GPU ms and launches of each kernel name (Numba's mangled names cut to the
    function's), busiest first, and their sum against the wall time."""
    per = max(rounds, 1)
    totals: defaultdict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for event in prof.events():
        if str(event.device_type).endswith("CUDA") and event.device_time_total > 0:
            name = short_kernel_name(event.name)
            totals[name] += event.device_time_total / 1e3
            counts[name] += 1
    busy = sum(totals.values())
    lines = [f"{label}: {rounds} rounds, {1e3 * wall_s / per:.2f} ms a round (wall), "
             f"{busy / per:.2f} ms of kernels a round",
             f"{'kernel':<48} {'ms/round':>9} {'calls/round':>11} {'share':>6}"]
    for name in sorted(totals, key=lambda k: -totals[k])[:40]:
        lines.append(f"{name[:48]:<48} {totals[name] / per:>9.3f} {counts[name] / per:>11.1f} "
                     f"{totals[name] / busy:>6.1%}")
    return lines


def short_kernel_name(name: str) -> str:
    """`_ZN...5numba...12_q4_rows_kernel...` -> `_q4_rows_kernel`: the longest identifier part
    of a mangled Numba name that is not a module path; other names as they are."""
    if not name.startswith("_Z"):
        return name.split("(")[0][:60]
    parts, at = [], name.find("N") + 1  # _ZN<len><id><len><id>...E: read them in order
    while at and (match := re.match(r"(\d+)", name[at:])):
        size = int(match.group(1))
        at += match.end()
        parts.append(name[at:at + size])
        at += size
    useful = [p for p in parts if p not in ("cuda_kernels", "numba", "cudapy", "tf_async")
              and not p.startswith(("Array", "int", "float", "Tuple", "CPointer", "uint"))]
    return useful[-1] if useful else name[:60]


async def profile(ckpt: Any, device: str, streams: int, max_tokens: int, prompt_tokens: int,
                  ctx: int, drafter: str | None = None, kernels: bool = False,
                  draft_backoff: int = 0, phases_only: bool = False) -> list[str]:
    from tf_async import Engine

    rng = np.random.default_rng(streams)
    prompts = [rng.integers(3, min(ckpt_vocab(ckpt), 30000), prompt_tokens).tolist()
               for _ in range(streams)]
    async with Engine(ckpt, device=device, parallel=streams, ctx=ctx, page_size=16,
                      step_tokens=max(512, streams * prompt_tokens), drafter=drafter,
                      draft_backoff=draft_backoff) as eng:
        parts = eng.parts
        assert parts is not None
        sync = parts.ops.synchronize if device != "cpu" else None
        timer = OpTimer(sync)
        if not kernels:
            if not phases_only:
                timer.install_ops(parts.ops)
            dflash = DFLASH_PHASES if drafter and drafter.startswith("dflash:") else ()
            if phases_only:  # only what runs outside a graph capture (a sync inside one stops it)
                dflash = tuple(p for p in dflash if p[1] == "write_context")
            for owner_path, method in PHASES + (DRAFT_PHASES + dflash if drafter else ()):
                owner: Any = parts
                for name in owner_path.split("."):
                    owner = getattr(owner, name)
                timer.install_phase(owner, method)
        await eng.complete(prompts[0], max_tokens=4, ignore_eos=True)  # compile, capture
        first: list[float] = []

        async def one(i: int) -> None:
            async for _ in eng.stream(prompts[i], max_tokens=max_tokens, ignore_eos=True):
                if len(first) <= i:
                    first.append(time.perf_counter())

        # the prompts first (untimed), then a window of decode rounds
        await asyncio.gather(*(eng.complete(p, max_tokens=1) for p in prompts))
        if kernels or phases_only:  # a run as long as the timed one first: every graph captured before
            await asyncio.gather(*(eng.complete(p, max_tokens=max_tokens, ignore_eos=True)
                                   for p in prompts))
        rounds0 = int(eng.stats()["rounds"])
        with timer.window(), kernel_trace(kernels) as prof:
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(streams)))
            wall = time.perf_counter() - start
        rounds = int(eng.stats()["rounds"]) - rounds0
    label = f"{streams} stream(s), {max_tokens} tokens each"
    if kernels:
        return kernel_table(prof, rounds, wall, label)
    return table(timer, rounds, wall, label)


@contextmanager
def kernel_trace(on: bool) -> Iterator[Any]:
    """torch.profiler over the window (CUDA activities only) when `on`; else nothing."""
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield prof


def ckpt_vocab(ckpt: Any) -> int:
    if isinstance(ckpt, str):
        return 30000
    return int(ckpt.config.vocab_size)


def load(model: str, device: str) -> Any:
    if model == "default":
        from tf_async.models.default import default_model_path

        return default_model_path()
    from benchmarks.bench_qwen35_gpu import random_checkpoint

    if device == "cpu":
        return random_checkpoint(np, model)
    import cupy as cp

    return random_checkpoint(cp, model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | 27b | 35b-a3b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--drafter", default=None,
                   help="e.g. mtp, ngram, or dflash (27b | 35b-a3b: a random 4-bit DFlash2 "
                        "drafter, bench_qwen35_gpu.py's): rounds that draft")
    p.add_argument("--draft-backoff", type=int, default=0,
                   help="the engine's draft pacing (default 0: every round drafts)")
    p.add_argument("--kernels", action="store_true",
                   help="GPU kernels by name from torch.profiler (CUPTI), no op timers")
    p.add_argument("--phases-only", action="store_true",
                   help="time the round's phases (schedule, propose, execute, commit_states, "
                        "absorb, write_context, update) with a device sync at each end, no op "
                        "timers: the phases' graphs replay as they do untimed")
    p.add_argument("--no-pdl", action="store_true",
                   help="capture plain CUDA graphs (no programmatic edges): with them a kernel's "
                        "traced time includes its wait for the one before it")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: CPU seconds of the process (time.process_time), for a loaded CPU "
                        "machine (run with NUMBA_NUM_THREADS=1)")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.no_pdl:
        import cuda_kernels.graphs

        cuda_kernels.graphs.supported = lambda: False  # type: ignore[assignment]
    ckpt = load(args.model, args.device)
    drafter = args.drafter
    if drafter == "dflash":
        import tempfile
        from pathlib import Path

        from benchmarks.bench_qwen35_gpu import write_dflash_drafter

        folder = Path(tempfile.mkdtemp(prefix="dflash-")) / args.model
        drafter = f"dflash:{write_dflash_drafter(folder, args.model)}"
    for streams in args.streams:
        lines = asyncio.run(profile(ckpt, args.device, streams, args.max_tokens,
                                    args.prompt_tokens, args.ctx, drafter, args.kernels,
                                    args.draft_backoff, args.phases_only))
        print(f"\n{args.model} on {args.device}")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
