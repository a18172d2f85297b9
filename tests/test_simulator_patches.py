"""The simulator patches of cuda_kernels/env.py: a shared array's call site gives every thread
of a launch the same array, however many threads ask at once (the simulator's own lookup could
hand two threads two arrays: intermittent garbage in the simulator checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys, threading
import numpy as np
import cuda_kernels.env  # installs the patches (the simulator is on)
from numba.cuda.simulator.kernelapi import FakeCUDAShared
sys.setswitchinterval(5e-5)
split = 0
for _ in range(100):
    shared, got, barrier = FakeCUDAShared(0), [], threading.Barrier(32)
    def ask():
        barrier.wait()
        got.append(id(shared.array((16,), np.float32)))
    threads = [threading.Thread(target=ask) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    split += len(set(got)) > 1
print("split", split)
"""


def test_one_shared_array_a_call_site_under_contention() -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["split", "0"], out.stdout
