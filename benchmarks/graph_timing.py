"""Timing GPU work as CUDA-graph replays (the benchmark scripts' one way to do it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def graph_seconds(cp: Any, record: Callable[[Any], None], replays: int = 10) -> float:
    """GPU seconds of one replay of a graph of what `record(stream)` launches on `stream` (a
    CuPy stream, also CuPy's current one while it runs): one eager run first (compiles and
    warms), then the capture, one untimed replay and `replays` replays between events."""
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        record(stream)
        stream.synchronize()
        stream.begin_capture()
        record(stream)
        graph = stream.end_capture()
        graph.launch(stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / replays
