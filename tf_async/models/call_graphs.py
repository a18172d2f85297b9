"""CallGraphs: a small eager call (a few dozen launches) replayed from CUDA graphs.

The MTP drafter runs one layer and the LM head per draft step and per stream, and writes the
K/V of the committed slots into its ring once a round: each is ~40 small launches, and from
Python each launch costs more than its kernel. `CallGraphs` runs such a call through a graph
instead: the first call of a key runs `fn` eagerly on the graphs' own stream (compiling its
kernels and sizing the pool) and then captures the same call on static copies of its inputs;
later calls of that key copy their inputs into the static ones, replay, and hand out copies
of the outputs. The replay runs the same kernels on the same values: the same bits as eager.

The key is the caller's: everything that fixes the launches (shapes, the addresses of the
arrays the call writes or reads besides its inputs, e.g. a ring's device pointer), so one
graph is never replayed on other memory. Every graph shares one stream and one memory pool:
replays are ordered on that stream, so their temporaries may share memory; the static inputs
and the outputs of each graph stay referenced and are never handed to another. A call whose
capture fails (an op that syncs with the host) stays eager for that key; past `max_graphs`
keys, new keys run eagerly. Bounds checks are skipped inside (the caller's indices are its own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend.base import Array, GraphOps

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Graph:
    inputs: tuple[Array, ...]  # static device inputs
    outputs: tuple[Array, ...]  # the graph's output arrays
    graph: Any
    holds: tuple[Any, ...]  # arrays the graph addresses besides its inputs (kept alive)


class CallGraphs:
    """fn(*inputs) -> tuple of device arrays, replayed from a CUDA graph a key."""

    def __init__(self, ops: GraphOps, max_graphs: int = 96):
        self.ops = ops
        self.max_graphs = max_graphs
        xp = ops.xp
        self._stream = xp.cuda.Stream(non_blocking=False)  # ordered with the legacy stream
        self._pool = xp.cuda.MemoryPool()
        self._graphs: dict[Hashable, _Graph | None] = {}
        self.num_replays = 0
        self.num_captures = 0

    def __call__(self, key: Hashable, fn: Callable[..., tuple[Array, ...]],
                 inputs: tuple[Any, ...], holds: tuple[Any, ...] = ()) -> tuple[Array, ...]:
        """fn(*inputs): inputs are device arrays or host NumPy arrays (copied in)."""
        if key in self._graphs:
            made = self._graphs[key]
            if made is None:
                return fn(*self._on_device(inputs))
            return self._replay(made, inputs)
        if len(self._graphs) >= self.max_graphs:
            return fn(*self._on_device(inputs))
        made, outputs = self._capture(fn, inputs, holds)
        self._graphs[key] = made
        return outputs

    def _on_device(self, inputs: tuple[Any, ...]) -> tuple[Array, ...]:
        """The inputs for an eager call: host arrays uploaded."""
        return tuple(self.ops.asarray(a) if isinstance(a, np.ndarray) else a for a in inputs)

    def _replay(self, made: _Graph, inputs: tuple[Any, ...]) -> tuple[Array, ...]:
        xp = self.ops.xp
        caller = xp.cuda.get_current_stream()
        self._stream.wait_event(caller.record())
        with self._stream:
            _load(xp, made.inputs, inputs)
            made.graph.launch(self._stream)
            outputs = tuple(a.copy() for a in made.outputs)
        caller.wait_event(self._stream.record())
        self.num_replays += 1
        return outputs

    def _capture(self, fn: Callable[..., tuple[Array, ...]], inputs: tuple[Any, ...],
                 holds: tuple[Any, ...]) -> tuple[_Graph | None, tuple[Array, ...]]:
        """Run fn eagerly on static copies of the inputs, then capture the same call; return
        the graph (None: it could not be captured) and the eager outputs."""
        xp = self.ops.xp
        caller = xp.cuda.get_current_stream()
        self._stream.wait_event(caller.record())
        made: _Graph | None = None
        with xp.cuda.using_allocator(self._pool.malloc), self._stream, self.ops.unchecked():
            static = tuple(xp.empty(a.shape, a.dtype) for a in inputs)
            _load(xp, static, inputs)
            eager = fn(*static)
        with self._stream:  # the caller's copies from the default pool: memory of the graphs'
            outputs = tuple(a.copy() for a in eager)  # pool may be a graph's temporaries
        del eager
        with xp.cuda.using_allocator(self._pool.malloc), self._stream, self.ops.unchecked():
            try:
                self._stream.begin_capture(mode=relaxed_capture_mode(xp))
                try:
                    recorded = fn(*static)
                finally:
                    graph = self._stream.end_capture()
                made = _Graph(static, tuple(recorded), graph, holds)
                self.num_captures += 1
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured
                log.warning("call not captured (runs eagerly): %s", exc)
        caller.wait_event(self._stream.record())
        return made, outputs


def array_address(array: Array) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
    """What a graph addressing `array` depends on: its device pointer, shape, strides, dtype."""
    return int(array.data.ptr), tuple(array.shape), tuple(array.strides), str(array.dtype)


def _load(xp: Any, static: tuple[Array, ...], inputs: tuple[Any, ...]) -> None:
    """Copy each input into its static twin (host arrays through one upload each)."""
    for dst, src in zip(static, inputs, strict=True):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"graph input {src.shape} {src.dtype} does not fit "
                             f"{dst.shape} {dst.dtype}")
        if isinstance(src, np.ndarray):
            dst.set(src)
        else:
            xp.copyto(dst, src)


def relaxed_capture_mode(xp: Any) -> Any:
    """Relaxed capture: a pool growing (cudaMalloc) during capture is not an error."""
    return getattr(xp.cuda.runtime, "streamCaptureModeRelaxed", None)
