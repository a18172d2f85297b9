"""Cold start: `Engine.warm_up()` (run by `tf-async serve` before it reports ready) takes
every path a request can reach, so no request after it compiles a kernel. Checked in a fresh
process, where nothing is compiled yet (kernels load from Numba's disk cache or compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_no_kernel_compiles_after_the_warm_up(tiny_llama_dir, drafter):
    cmd = [sys.executable, "-m", "tests.warmup_check", str(tiny_llama_dir)] + \
        ([drafter] if drafter else [])
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["new"] == {}, result
    assert result["idle"] == 0 and result["compiled"] > 5


async def test_warm_up_runs_a_decode_round_of_every_row_count(tiny_llama_dir) -> None:
    """On a GPU each decode shape (rows, streams) is a CUDA graph, captured the first time it
    comes: the warm-up brings every row count up to the lanes' (WARM_DECODE_ROWS at most), so
    the first users' rounds replay graphs instead of capturing them."""
    from tf_async import Engine

    seen: set[tuple[int, int]] = set()
    async with Engine(tiny_llama_dir, device="cpu", parallel=5, ctx=128, page_size=8,
                      step_tokens=16) as engine:
        decoder = engine.parts.decoder
        forward = decoder.forward

        def recording(batch, *args, **kwargs):
            rows = int(batch.token_ids.shape[0])
            if int(batch.logit_rows.shape[0]) == rows:  # every row a decode row
                seen.add((rows, int(batch.block_table.shape[0])))
            return forward(batch, *args, **kwargs)

        decoder.forward = recording
        await engine.warm_up()
        assert engine.stats()["pages_in_use"] == 0
    assert {(n, n) for n in range(1, 6)} <= seen, sorted(seen)


@pytest.mark.parametrize("by_rows", [False, True])
async def test_warm_up_runs_a_prompt_round_alone_of_each_row_range(tiny_llama_dir, by_rows) -> None:
    """A GPU compiles some kernels per range of a round's rows (its ops say so:
    kernels_by_rows): the warm-up runs a prompt round alone of 2**k and 2**k + 1 rows up to a
    step, none shortened by cached pages. The CPU's kernels do not depend on the rows: no
    such rounds there."""
    from dataclasses import replace

    from tf_async import Engine

    alone: set[int] = set()
    async with Engine(tiny_llama_dir, device="cpu", parallel=3, ctx=128, page_size=8,
                      step_tokens=16) as engine:
        ops = engine.parts.ops
        ops.capabilities = replace(ops.capabilities, kernels_by_rows=by_rows)
        decoder = engine.parts.decoder
        forward = decoder.forward

        def recording(batch, *args, **kwargs):
            if int(batch.block_table.shape[0]) == 1 and int(batch.logit_rows.shape[0]) == 1:
                alone.add(int(batch.token_ids.shape[0]))  # one stream's round
            return forward(batch, *args, **kwargs)

        decoder.forward = recording
        await engine.warm_up()
        assert engine.stats()["pages_in_use"] == 0
    if by_rows:
        assert {2, 3, 4, 5, 8, 9, 16} <= alone, sorted(alone)
    else:
        assert not {3, 5, 9} & alone, sorted(alone)
