"""CUDA graphs captured from a stream, with programmatic dependent launch between this
package's kernels (Hopper and later).

A decode round is ~400 small kernels in a row; in a plain graph each one is launched only
after the one before has finished and flushed, so every boundary costs the next kernel's
launch. Here every edge of the captured graph that joins two of this
package's kernels (env.kernel: named PDL_NAME_PREFIX...) becomes a programmatic edge (from
port CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC): the next kernel is launched as soon as every
block of the one before has begun (each begins with griddepcontrol.wait, then
launch_dependents), and it waits on the device for its predecessor to finish before it
touches memory. The kernels, their order and every value are those of the plain graph;
edges to or from anything else (copies, CuPy kernels) stay ordinary. Measured on an H200
(docs/PERFORMANCE.md, session 6): 0.05 ms less GPU time in a 2.8 ms q4 batch-1 round.

The driver API is called through ctypes (libcuda, no extra package). Everything here is
optional: `capture_programmatic` returns None where the driver or the device cannot do it,
and the caller keeps its plain graph.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from cuda_kernels.env import PDL_NAME_PREFIX

_CAPTURE_MODE_RELAXED = 2
_NODE_TYPE_KERNEL = 0
_PORT_PROGRAMMATIC = 1
_DEPENDENCY_PROGRAMMATIC = 1


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2 (its first fields read)
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_DRIVER: Any = None


def _driver() -> Any:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL("libcuda.so.1")
    return _DRIVER


def _call(name: str, *args: Any) -> None:
    result = getattr(_driver(), name)(*args)
    if result != 0:
        raise RuntimeError(f"CUDA driver {name}: error {result}")


class ProgrammaticGraph:
    """An instantiated graph (the driver's handles); launch(stream) as cupy's Graph."""

    def __init__(self, graph: ctypes.c_void_p, edges: int):
        self._graph = graph
        self._exec = ctypes.c_void_p()
        self.programmatic_edges = edges
        _call("cuGraphInstantiateWithFlags", ctypes.byref(self._exec), graph, ctypes.c_ulonglong(0))

    def launch(self, stream: Any) -> None:
        _call("cuGraphLaunch", self._exec, ctypes.c_void_p(stream.ptr))

    def __del__(self) -> None:
        try:
            if self._exec:
                _driver().cuGraphExecDestroy(self._exec)
            if self._graph:
                _driver().cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing to free into
            pass


def capture_programmatic(stream: Any, record: Callable[[], None]) -> ProgrammaticGraph | None:
    """Capture what record() launches on `stream` (a CuPy stream, relaxed mode) and return it
    with programmatic edges between this package's kernels; None (nothing captured) where
    this driver or device cannot (the caller then captures a plain graph)."""
    if not supported():
        return None
    handle = ctypes.c_void_p(stream.ptr)
    _call("cuStreamBeginCapture_v2", handle, ctypes.c_int(_CAPTURE_MODE_RELAXED))
    graph = ctypes.c_void_p()
    try:
        try:
            record()
        finally:
            _call("cuStreamEndCapture", handle, ctypes.byref(graph))
        edges = _make_programmatic(graph)
    except Exception:
        if graph:
            _driver().cuGraphDestroy(graph)
        raise
    return ProgrammaticGraph(graph, edges)


def supported() -> bool:
    """A driver with graph edge data (CUDA 12.3+) and a device of compute capability 9.0+."""
    try:
        from numba import cuda

        if tuple(cuda.get_current_device().compute_capability) < (9, 0):
            return False
        driver = _driver()
        return all(hasattr(driver, n) for n in ("cuGraphGetEdges_v2", "cuGraphAddDependencies_v2",
                                                 "cuGraphRemoveDependencies_v2", "cuFuncGetName",
                                                 "cuGraphKernelNodeGetParams_v2"))
    except Exception:  # noqa: BLE001 - no driver or device: the plain graph
        return False


def _make_programmatic(graph: ctypes.c_void_p) -> int:
    """Turn every default edge between two of this package's kernels programmatic; -> count."""
    count = ctypes.c_size_t(0)
    _call("cuGraphGetEdges_v2", graph, None, None, None, ctypes.byref(count))
    n = count.value
    if not n:
        return 0
    src, dst = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
    data = (_EdgeData * n)()
    _call("cuGraphGetEdges_v2", graph, src, dst, data, ctypes.byref(count))
    ours: dict[int, bool] = {}
    pairs = [(src[i], dst[i]) for i in range(n)
             if data[i].type == 0 and data[i].from_port == 0
             and _is_ours(src[i], ours) and _is_ours(dst[i], ours)]
    made = 0
    for a, b in pairs:
        one_src, one_dst = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
        _call("cuGraphRemoveDependencies_v2", graph, one_src, one_dst, None, ctypes.c_size_t(1))
        edge = (_EdgeData * 1)()
        edge[0].from_port, edge[0].type = _PORT_PROGRAMMATIC, _DEPENDENCY_PROGRAMMATIC
        if _driver().cuGraphAddDependencies_v2(graph, one_src, one_dst, edge, ctypes.c_size_t(1)) == 0:
            made += 1
        else:  # refused: the ordinary edge back (the graph stays whole)
            _call("cuGraphAddDependencies_v2", graph, one_src, one_dst, None, ctypes.c_size_t(1))
    return made


def _is_ours(node: int | None, seen: dict[int, bool]) -> bool:
    """Whether a graph node is a kernel of this package (env.kernel's name prefix)."""
    if node is None:
        return False
    if node not in seen:
        kind = ctypes.c_int(-1)
        _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        ok = False
        if kind.value == _NODE_TYPE_KERNEL:
            params = _KernelNodeParams()
            _call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
            name = ctypes.c_char_p()
            if params.func and _driver().cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)) == 0:
                ok = PDL_NAME_PREFIX.encode() in (name.value or b"")
        seen[node] = ok
    return seen[node]
