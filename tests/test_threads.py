"""CPU kernel threads: the engine picks Numba's `tbb` layer where it loads (the `tbb` package
is a dependency on Linux x86-64), else `workqueue` (workers that sleep rather than spin at a
barrier, so a descheduled worker does not stall every kernel on shared cores), and engine
threads take turns launching parallel kernels (workqueue aborts the process on two launches at
once). Checked in a fresh process, where no threading layer is fixed yet."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

from tf_async.engine import threads

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    import numba
    from tf_async import Engine

    async def main(folder):
        opts = dict(device="cpu", parallel=2, ctx=256, step_tokens=128)
        prompt = "the keeper walks up the stairs of the light " * 4  # parallel-sized prefill
        async with Engine(folder, **opts) as a, Engine(folder, **opts) as b:
            outs = await asyncio.gather(*(e.complete(prompt, max_tokens=12, ignore_eos=True)
                                          for _ in range(3) for e in (a, b)))
        print(json.dumps({"layer": numba.threading_layer(),
                          "same": len({tuple(o.token_ids) for o in outs}) == 1}))

    asyncio.run(main(sys.argv[1]))
""")


def test_two_engines_in_one_process_launch_kernels_in_turn(tiny_llama_dir):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    env["NUMBA_NUM_THREADS"] = "2"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = "tbb" if threads.tbb_loads() else threads.FALLBACK_LAYER
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"layer": expected, "same": True}


def test_tbb_is_taken_where_the_dependency_installs_it() -> None:
    """pyproject installs `tbb` on Linux x86-64: there the engine must find its library (pip
    puts it where the loader does not look) rather than fall back silently."""
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert threads.tbb_loads()


def test_workqueue_when_tbb_does_not_load(monkeypatch) -> None:
    import numba

    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    monkeypatch.setattr(threads, "tbb_loads", lambda: False)
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "default")
    threads.choose_threading_layer()
    assert numba.config.THREADING_LAYER == "workqueue"
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "omp")  # the user's choice wins
    monkeypatch.setattr(numba.config, "THREADING_LAYER", "omp")
    threads.choose_threading_layer()
    assert numba.config.THREADING_LAYER == "omp"
