"""Threads of the CPU kernels: Numba's threading layer, chosen once per process.

With OpenMP, a parallel kernel ends at a barrier where workers spin, and a step waits for the
slowest worker: when the cores are shared (the event loop, client processes, other programs)
a descheduled worker stalls every parallel kernel (two busy cores: 0.3 tok/s against 12 with
`workqueue`, docs/PERFORMANCE.md). Numba's `workqueue` layer has workers that sleep instead,
but it wakes them for every parallel kernel: a decode step's ~250 kernels then gain nothing
from a second core (default model, quiet 2-core machine: 25 ms a token with 2 threads, 23.5
with 1). TBB's workers spin briefly, then sleep, and steal work: 12.7 ms a token with 2
threads (OpenMP 14.7), and with both cores busy with other programs 42 ms (workqueue 56).

So the engine takes `tbb` when it loads (the `tbb` package, a dependency on Linux x86-64,
puts libtbb in the environment's lib/, which the loader does not search: it is preloaded from
there), else `workqueue`; NUMBA_THREADING_LAYER set by the user wins. Engine threads take
KERNEL_LOCK around their kernel work (workqueue aborts the process on two launches at once).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading

FALLBACK_LAYER = "workqueue"
# One parallel launch at a time in this process (several Engines in one process share it).
KERNEL_LOCK = threading.RLock()
_TBB_LIBRARIES = ("libtbb.so.12", "libtbb.12.dylib")


def choose_threading_layer() -> None:
    """`tbb` where it loads, else `workqueue`, unless NUMBA_THREADING_LAYER names one; no
    effect once a parallel kernel has run in this process (the layer is fixed then)."""
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        import numba

        numba.config.THREADING_LAYER = "tbb" if tbb_loads() else FALLBACK_LAYER  # type: ignore[attr-defined]


def tbb_loads() -> bool:
    """Whether Numba's TBB layer can start here: libtbb preloaded from the environment's lib/
    where pip's `tbb` puts it, then Numba's TBB pool imported."""
    _preload_tbb()
    try:
        importlib.import_module("numba.np.ufunc.tbbpool")
    except ImportError:
        return False
    return True


def _preload_tbb() -> None:
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for name in _TBB_LIBRARIES:
            path = os.path.join(prefix, "lib", name)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                return
