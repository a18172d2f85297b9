"""Every CUDA kernel against float64 references (and the CPU twins) in Numba's CUDA
simulator, at tiny sizes. The simulator must be switched on before numba.cuda is imported,
so the checks run in two child processes (tests/cuda_sim_check.py), side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.cuda_sim_check import CHECKS

ROOT = Path(__file__).resolve().parents[1]
# Three groups of about two minutes each on a quiet 2-core machine (the simulator is slow:
# `ok NAME SECONDS` lines print each check's time), waited for under one deadline.
GROUPS = (
    ["matmul", "embed", "kv_write", "e4m3_exhaustive", "zero_pages", "norm_rope_silu", "moe",
     "cpu_twins"],
    ["attention", "attention_wide_heads", "sampling", "dflash"],
    ["attention_tiled", "fused_layer_ops", "grouped_matmul"],
)
DEADLINE_S = 1500


def _start(names: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "tests" / "cuda_sim_check.py"), *names]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_groups_cover_every_check() -> None:
    assert sorted(n for g in GROUPS for n in g) == sorted(CHECKS)


@pytest.fixture(scope="module")
def sim_results() -> list[tuple[int, str]]:
    procs = [_start(names) for names in GROUPS]
    deadline = time.monotonic() + DEADLINE_S
    try:
        return [_finish(p, deadline) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _finish(proc: subprocess.Popen[str], deadline: float) -> tuple[int, str]:
    """Exit code and output; a group still running at the deadline fails with what it printed."""
    try:
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        return -1, f"still running after {DEADLINE_S} s; printed so far:\n{output}"


@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_kernels_match_references_in_simulator(sim_results: list[tuple[int, str]], group: int) -> None:
    code, output = sim_results[group]
    assert code == 0, output
    for name in GROUPS[group]:
        assert f"ok {name} " in output, output


def test_numpy_2_5_with_numba_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda_kernels import env

    monkeypatch.setattr(np, "__version__", "2.5.2")
    monkeypatch.delattr(np, "row_stack", raising=False)
    with pytest.raises(env.CudaUnavailableError, match="numpy<2.5"):
        env._check_numpy()


def test_uniform_hash_is_documented_splitmix() -> None:
    from cuda_kernels.sampling import uniform_host

    draws = [uniform_host(seed, pos) for seed in (0, 1, 2**63) for pos in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    assert uniform_host(7, 3) == uniform_host(7, 3) != uniform_host(7, 4)


def test_cuda_device_without_cupy_is_a_clear_error() -> None:
    pytest.importorskip("numba")
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.errors import BadInputError

    with pytest.raises(BadInputError, match="CuPy"):
        CudaOps()
