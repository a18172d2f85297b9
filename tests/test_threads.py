"""CPU kernel threads: the engine picks Numba's `workqueue` layer (workers sleep rather than
spin at a barrier, so a descheduled worker does not stall every kernel on shared cores), and
engine threads take turns launching parallel kernels (workqueue aborts the process on two
launches at once). Checked in a fresh process, where no threading layer is fixed yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"layer": "workqueue",
                                                                 "same": True}
