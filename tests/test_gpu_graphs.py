"""cuda_kernels/graphs.py on a GPU: a chain of this package's kernels captured with programmatic
edges replays to the eager bits; where the driver refuses a programmatic edge the ordinary edge
goes back (same edges, same bits); a recording that raises ends the capture and frees the graph
(the stream captures again afterwards). Run with `pytest -m gpu`."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops() -> Any:
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    from cuda_kernels.graphs import supported
    from tf_async.backend.cuda_ops import CudaOps

    if not supported():
        pytest.skip("no programmatic graph edges on this device or driver")
    return CudaOps()


def _chain(ops: Any, x: Any, weights: list[Any]) -> Any:
    """rms_norm three times, each launch reading the one before (three of our kernels)."""
    for w in weights:
        x = ops.rms_norm(x, w, 1e-6)
    return x


def _edges(graph: Any) -> int:
    from cuda_kernels.graphs import _call

    count = ctypes.c_size_t(0)
    _call("cuGraphGetEdges_v2", graph._graph, None, None, None, ctypes.byref(count))
    return count.value


def _capture(ops: Any, x: Any, weights: list[Any]) -> tuple[Any, Any, Any]:
    """(graph, its output buffer, the stream) of the chain on x, captured programmatically."""
    from cuda_kernels.graphs import capture_programmatic

    cp = ops.xp
    stream = cp.cuda.Stream(non_blocking=False)
    out: list[Any] = []
    with stream:
        _chain(ops, x, weights)  # compiles the kernels outside the capture
        graph = capture_programmatic(stream, lambda: out.append(_chain(ops, x, weights)))
    return graph, out[0], stream


def _replays_match_eager(ops: Any, graph: Any, out: Any, stream: Any, x: Any, weights: list[Any]) -> None:
    cp = ops.xp
    rng = np.random.default_rng(7)
    for _ in range(3):  # fresh inputs each replay, the output poisoned before it
        x[...] = cp.asarray(rng.standard_normal(x.shape, dtype=np.float32))
        out.fill(np.nan)
        with stream:
            graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(cp.asnumpy(out), cp.asnumpy(_chain(ops, x, weights)))


def _inputs(ops: Any) -> tuple[Any, list[Any]]:
    cp, rng = ops.xp, np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal((4, 256), dtype=np.float32))
    return x, [cp.asarray(rng.uniform(0.5, 1.5, 256).astype(np.float32)) for _ in range(3)]


def test_programmatic_chain_replays_the_eager_bits(ops: Any) -> None:
    x, weights = _inputs(ops)
    graph, out, stream = _capture(ops, x, weights)
    assert graph is not None and graph.programmatic_edges == 2  # k1 -> k2 -> k3
    _replays_match_eager(ops, graph, out, stream, x, weights)


class _RefusingDriver:
    """libcuda with cuGraphAddDependencies_v2 refusing every edge that carries edge data."""

    def __init__(self, real: Any):
        self.real, self.refused = real, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def cuGraphAddDependencies_v2(self, graph: Any, src: Any, dst: Any, data: Any, n: Any) -> int:  # noqa: N802
        if data is not None:
            self.refused += 1
            return 1  # CUDA_ERROR_INVALID_VALUE
        return self.real.cuGraphAddDependencies_v2(graph, src, dst, data, n)


def test_refused_programmatic_edge_keeps_the_ordinary_one(ops: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda_kernels import graphs

    x, weights = _inputs(ops)
    plain, _, _ = _capture(ops, x, weights)
    refusing = _RefusingDriver(graphs._driver())
    monkeypatch.setattr(graphs, "_DRIVER", refusing)
    graph, out, stream = _capture(ops, x, weights)
    monkeypatch.undo()
    assert refusing.refused == 2 and graph.programmatic_edges == 0
    assert _edges(graph) == _edges(plain)  # every dependency is back, as an ordinary edge
    _replays_match_eager(ops, graph, out, stream, x, weights)


def test_recording_that_raises_ends_the_capture(ops: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda_kernels import graphs

    x, weights = _inputs(ops)
    cp = ops.xp
    stream = cp.cuda.Stream(non_blocking=False)
    destroyed: list[int] = []
    real = graphs._driver()

    class Recording(_RefusingDriver):
        def cuGraphAddDependencies_v2(self, *args: Any) -> int:  # noqa: N802
            return self.real.cuGraphAddDependencies_v2(*args)

        def cuGraphDestroy(self, graph: Any) -> int:  # noqa: N802
            destroyed.append(1)
            return self.real.cuGraphDestroy(graph)

    def record() -> None:
        _chain(ops, x, weights)
        raise RuntimeError("recording failed")

    with stream:
        _chain(ops, x, weights)
        monkeypatch.setattr(graphs, "_DRIVER", Recording(real))
        with pytest.raises(RuntimeError, match="recording failed"):
            graphs.capture_programmatic(stream, record)
        monkeypatch.undo()
    assert destroyed == [1]  # the captured graph was freed
    assert not stream.is_capturing()
    stream.synchronize()
    graph, out, stream = _capture(ops, x, weights)  # capturing works again
    _replays_match_eager(ops, graph, out, stream, x, weights)
