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
