"""Backend wiring, checked on the CPU: --device cuda without a GPU/CuPy is a clear error, and
the engine reaches the device only through the Ops calls a GPU backend implements
(upload_linear / asarray at load, alloc_kv for the arena, to_host on logits, synchronize on
lane release)."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest

from tf_async import BadInputError, Engine
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.select import make_ops
from tf_async.backend.weights import AffineWeight, DenseWeight
from tf_async.models.decoder import Decoder


@pytest.fixture()
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError


def test_device_cuda_without_cupy_is_a_clear_error(no_cupy) -> None:
    with pytest.raises(BadInputError, match="--device cuda needs CuPy") as info:
        make_ops("cuda")
    assert info.value.param == "device"


def test_device_auto_without_cupy_falls_back_to_cpu(no_cupy) -> None:
    assert make_ops("auto").name == "cpu"


def test_unknown_device_is_refused() -> None:
    with pytest.raises(BadInputError, match="unknown device"):
        make_ops("tpu")


@pytest.mark.asyncio
async def test_engine_on_cuda_without_gpu_fails_at_start(tiny_llama, no_cupy) -> None:
    with pytest.raises(BadInputError, match="CuPy"):
        async with Engine(tiny_llama, device="cuda", parallel=1, ctx=64):
            pass


class RecordingOps(CpuOps):
    """CpuOps that counts the calls crossing the host/device boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.uploaded: list[object] = []

    def asarray(self, array: np.ndarray) -> np.ndarray:
        self.calls["asarray"] += 1
        return super().asarray(array)

    def upload_linear(self, w):
        self.calls["upload_linear"] += 1
        self.uploaded.append(w)
        return super().upload_linear(w)

    def to_host(self, array: np.ndarray) -> np.ndarray:
        self.calls["to_host"] += 1
        return super().to_host(array)

    def alloc_kv(self, *args, **kw):
        self.calls["alloc_kv"] += 1
        return super().alloc_kv(*args, **kw)

    def synchronize(self) -> None:
        self.calls["synchronize"] += 1


def test_decoder_uploads_every_weight_once(tiny_llama) -> None:
    ops = RecordingOps()
    Decoder(tiny_llama, ops)
    w = tiny_llama.weights
    linears = {id(x) for layer in w.layers for x in (layer.q, layer.k, layer.v, layer.o,
                                                    layer.gate, layer.up, layer.down)}
    linears |= {id(w.embed), id(w.lm_head)}  # tied: one object, uploaded once
    assert {id(x) for x in ops.uploaded} == linears
    assert ops.calls["upload_linear"] == len(linears)
    assert all(isinstance(x, DenseWeight | AffineWeight) for x in ops.uploaded)
    # norms (2 a layer + final) and the RoPE table go through asarray
    assert ops.calls["asarray"] == 2 * len(w.layers) + 1 + 1


@pytest.mark.asyncio
async def test_engine_reaches_the_device_only_through_ops(tiny_llama, monkeypatch) -> None:
    from tf_async.engine import build

    ops = RecordingOps()
    monkeypatch.setattr(build, "make_ops", lambda device: ops)
    async with Engine(tiny_llama, device="cuda", parallel=2, ctx=64) as eng:
        assert eng.parts.ops is ops
        first = await eng.complete("abc", max_tokens=3, temperature=0.0)
        releases = ops.calls["synchronize"]
        second = await eng.complete("abcd", max_tokens=4, temperature=0.0)
    assert ops.calls["alloc_kv"] == 1  # the arena, once
    assert ops.calls["to_host"] >= len(first.token_ids) + len(second.token_ids)  # logits each round
    assert releases >= 1 and ops.calls["synchronize"] >= releases + 1  # each release drains


def test_every_kernel_waits_for_the_kernels_before_it() -> None:
    """Decode graphs join this package's kernels with programmatic edges (cuda_kernels/graphs.py),
    which is safe only if every kernel begins with env.kernel's wait: no module of cuda_kernels
    makes a kernel with cuda.jit directly (only device functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "cuda_kernels"
    bare = []
    for path in sorted(root.glob("*.py")):
        if path.name == "env.py":  # where env.kernel itself wraps cuda.jit
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                call = dec if isinstance(dec, ast.Call) else None
                target = call.func if call is not None else dec
                device = call is not None and any(k.arg == "device" for k in call.keywords)
                if ast.unparse(target) == "cuda.jit" and not device:
                    bare.append(f"{path.name}:{node.name}")
    assert not bare, f"kernels made with cuda.jit instead of env.kernel: {bare}"


def test_both_backends_share_one_set_of_argument_checks() -> None:
    from tf_async.backend import checks, cuda_ops
    from tf_async.backend.cpu import ops as cpu_ops

    for name in ("check_array", "check_shape", "check_affine", "check_kv", "check_kv_dtype",
                 "kv_shape", "num_pages_of", "check_shared_expert_add"):
        assert getattr(cuda_ops, name) is getattr(checks, name) is getattr(cpu_ops, name)
    with pytest.raises(BadInputError, match="kv_write k: expected dtype float32"):
        CpuOps().kv_write(np.zeros((1, 2, 4, 1, 2), np.float32), 0, np.zeros((1, 1, 2)),
                          np.zeros((1, 1, 2), np.float32), np.zeros(1, np.int64), None)
    q4 = AffineWeight(np.zeros((2, 1), np.uint32), np.ones((2, 2), np.float32),
                      np.zeros((2, 2), np.float32), 4, 4)  # groups of 4 codes: half a word
    checks.check_affine(q4)  # the CPU multiplies any whole groups
    with pytest.raises(BadInputError, match="in 4-bit words"):
        checks.check_affine(q4, whole_words=True)  # the GPU needs whole code words
