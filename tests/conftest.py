"""Shared fixtures: tiny checkpoints written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import random_hf_weights, tiny_config


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_hf import write_hf

    cfg = tiny_config("llama")
    return write_hf(tmp_path_factory.mktemp("tiny_llama"), cfg, random_hf_weights(cfg, seed=1))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path):
    from tf_async.models.loader import load_checkpoint

    return load_checkpoint(tiny_llama_dir)


@pytest.fixture(scope="session")
def default_checkpoint():
    from tf_async.models.default import default_model_path
    from tf_async.models.loader import load_checkpoint

    return load_checkpoint(default_model_path())


def pytest_configure(config: pytest.Config) -> None:
    # One Numba worker per kernel call in tests: the event loop, the engine thread and the
    # test clients share two cores, and spinning workers there slow everything down tenfold.
    import os

    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
