"""Cold start on the GPU: after `Engine.warm_up()` no request compiles a cuda_kernels kernel
(tests/warmup_check.py in a fresh process, as tests/test_warmup.py does on the CPU). Session 27
measured the first chat after `tf-async serve --device cuda` at 6-9 s against 20 ms warm
(docs/PERFORMANCE.md): the JSON line's first_s / second_s show what is left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _need_gpu() -> None:
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")


def test_no_cuda_kernel_compiles_after_the_warm_up(tiny_llama_dir) -> None:
    cmd = [sys.executable, "-m", "tests.warmup_check", str(tiny_llama_dir), "--device", "cuda"]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["new"] == {}, result
    assert result["idle"] == 0 and result["compiled"] > 5
