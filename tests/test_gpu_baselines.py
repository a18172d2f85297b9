"""GPU baselines (`pytest -m gpu`): this build's outputs on the GPU equal the ones recorded on
an H200 (tests/baselines/*-cuda.json, written by `python -m tests.record_baselines --device
cuda`), dense and hybrid tiny models, every section (flags off with CUDA graphs, paging,
contiguous), tokens and top-5 log-probs."""

from __future__ import annotations

import asyncio

import pytest

from tests.baseline_models import TINY_MODELS, baseline_path
from tf_async import baseline
from tf_async.models.loader import load_checkpoint

pytestmark = pytest.mark.gpu
CUDA_BASELINES = [name for name in TINY_MODELS if baseline_path(name, "cuda").is_file()]


@pytest.fixture(scope="module", autouse=True)
def _need_gpu() -> None:
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")


def test_there_are_gpu_baselines_for_dense_and_hybrid_models() -> None:
    assert {"llama-f32", "qwen3-mlx4", "qwen3_5-mlx4", "qwen3_5_moe-bf16"} <= set(CUDA_BASELINES)


@pytest.mark.parametrize("name", CUDA_BASELINES)
def test_tiny_model_on_the_gpu_equals_its_baseline(tmp_path, name) -> None:
    path = baseline_path(name, "cuda")
    ckpt = load_checkpoint(TINY_MODELS[name](tmp_path / name))
    results = asyncio.run(baseline.check(ckpt, baseline.load(path), path))
    failed = [(r.format(), r.mismatches[:3]) for r in results if not r.ok]
    assert not failed, failed
