"""Threads of the CPU kernels: Numba's threading layer, chosen once per process.

With OpenMP, a parallel kernel ends at a barrier where workers spin, and a step waits for the
slowest worker: when the cores are shared (the event loop, client processes, other programs)
a descheduled worker stalls every parallel kernel (two busy cores: 0.3 tok/s against 12 with
`workqueue`, docs/PERFORMANCE.md). Numba's `workqueue` layer has workers that sleep instead.
It runs one parallel launch at a time per process (a second one at the same moment aborts
the process), so engine threads take KERNEL_LOCK around their kernel work.
"""

from __future__ import annotations

import os
import threading

DEFAULT_LAYER = "workqueue"
# One parallel launch at a time in this process (several Engines in one process share it).
KERNEL_LOCK = threading.RLock()


def choose_threading_layer() -> None:
    """`workqueue` unless NUMBA_THREADING_LAYER names one; no effect once a parallel kernel
    has run in this process (the layer is fixed then)."""
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        import numba

        numba.config.THREADING_LAYER = DEFAULT_LAYER  # type: ignore[attr-defined]

