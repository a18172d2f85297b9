"""Tensor parallel over NCCL on several GPUs of one host (`pytest -m gpu
tests/test_gpu_tensor_parallel.py` on a machine with 2+ GPUs; skipped with fewer, and never
run in CI). The CPU tests (test_tensor_parallel*.py) cover the split itself with the fake
communicator; these check the NCCL all-reduce and the engine's gates at TP=2 (and TP=4 where
4 GPUs exist) on CUDA, and TP=2 against TP=1 on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny import random_hf_weights, tiny_config
from tf_async import Engine
from tf_async.gate import PROMPTS, generate, run_gates

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]


def gpu_count() -> int:
    from tf_async.backend.comm import gpu_count as count

    return count()


@pytest.fixture(scope="module", autouse=True)
def _need_gpus() -> None:
    pytest.importorskip("cupy")
    if gpu_count() < 2:
        pytest.skip("tensor parallel over NCCL needs 2+ GPUs (cupy.cuda.runtime.getDeviceCount())")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory):
    from tests.tiny_hf import write_hf
    from tf_async.models.loader import load_checkpoint

    cfg = tiny_config("qwen3", num_key_value_heads=4)
    return load_checkpoint(write_hf(tmp_path_factory.mktemp("tp_gpu"), cfg,
                                    random_hf_weights(cfg, seed=2)))


def test_nccl_all_reduce_sums_every_rank_into_every_buffer() -> None:
    import cupy

    from tf_async.backend.comm import NcclCommunicator

    comm = NcclCommunicator([0, 1])
    host = [np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1) for r in range(2)]
    buffers = []
    for rank in range(2):
        with comm.scope(rank):
            buffers.append(cupy.asarray(host[rank]))
    comm.all_reduce(buffers)
    for rank, buf in enumerate(buffers):
        with comm.scope(rank):
            cupy.cuda.get_current_stream().synchronize()
            np.testing.assert_array_equal(cupy.asnumpy(buf), host[0] + host[1])


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [2, 4])
async def test_every_gate_holds_at_tp_size_on_cuda(tiny_qwen3, size) -> None:
    if gpu_count() < size:
        pytest.skip(f"TP={size} needs {size} GPUs")
    rows, idle = await run_gates(tiny_qwen3, device="cuda", max_tokens=12, ctx=128,
                                 drafter="ngram", tensor_parallel=size, page_size=4)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed


@pytest.mark.asyncio
async def test_tp2_greedy_tokens_equal_tp1_on_cuda(tiny_qwen3) -> None:
    outs = {}
    for size in (1, 2):
        async with Engine(tiny_qwen3, device="cuda", parallel=4, ctx=256, page_size=4,
                          step_tokens=32, tensor_parallel=size) as eng:
            outs[size] = await generate(eng, list(PROMPTS), "greedy", 16, concurrent=True)
    assert outs[2] == outs[1]
