"""The launch order as compiled (cuda_kernels/env.py): a kernel made by `env.kernel` begins with
griddepcontrol.wait, before any global load or store, in its PTX for sm_90 (Hopper), and has
none of it for sm_80. tests/test_cuda_wiring.py checks that every kernel is made by env.kernel;
this checks that env.kernel's kernels really wait (a wrapper that dropped the wait would let a
kernel of a programmatic graph read its inputs before they are written).

Compiling PTX needs numba-cuda and its NVVM, not a GPU; where they are missing (the CPU-only CI)
the test is skipped. It runs in a subprocess: the test session may use the CUDA simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
try:
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, types
    from numba.cuda.cudadrv import nvvm
    nvvm.NVVM()  # raises where NVVM is missing
except Exception as exc:  # noqa: BLE001
    print(json.dumps({"skip": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
cc = tuple(int(v) for v in sys.argv[1].split("."))
device = SimpleNamespace(compute_capability=cc)  # env asks the current device whether to emit
dispatcher.get_current_device = lambda: device
cuda.get_current_device = lambda: device
from cuda_kernels.env import kernel
from cuda_kernels.norm import rms_norm

@kernel
def copy_rows(src, dst):
    i = cuda.grid(1)
    if i < src.shape[0]:
        dst[i] = src[i] + 1.0

f32 = types.Array(types.float32, 1, "C")
f32x2 = types.Array(types.float32, 2, "C")
out = {}
for name, fn, sig in [("copy_rows", copy_rows, (f32, f32)),
                      ("rms_norm", rms_norm, (f32x2, f32, types.float32, f32x2))]:
    ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=cc)
    out[name] = ptx
print(json.dumps(out))
"""


def _ptx(cc: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, cc], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    if proc.returncode != 0 and "CudaUnavailableError" in proc.stderr:
        pytest.skip(f"numba-cuda unusable here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"no NVVM to compile PTX: {result['skip']}")
    return result


def _first(ptx: str, *words: str) -> int:
    found = [ptx.find(w) for w in words if w in ptx]
    return min(found) if found else len(ptx)


def test_kernels_wait_before_touching_memory_on_hopper() -> None:
    for name, ptx in _ptx("9.0").items():
        wait = ptx.find("griddepcontrol.wait")
        assert wait >= 0, f"{name}: no griddepcontrol.wait in its sm_90 PTX"
        memory = _first(ptx, "ld.global", "st.global", "atom.global", "red.global")
        assert wait < memory, f"{name}: touches global memory before griddepcontrol.wait"
        assert "griddepcontrol.launch_dependents" in ptx, name


def test_no_griddepcontrol_before_hopper() -> None:
    for name, ptx in _ptx("8.0").items():
        assert "griddepcontrol" not in ptx, name
