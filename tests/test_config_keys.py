"""Checkpoints saved by transformers 5 spell some config keys differently from the Hub's
originals (configuration classes' `attribute_map`s, and `rope_theta` moved into
`rope_parameters`); each supported architecture loads the same model under either spelling."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.tiny import random_hf_weights, tiny_config
from tests.tiny_hf import write_hf
from tests.tiny_qwen35 import random_qwen35_weights, tiny_qwen35_config, write_qwen35_hf
from tf_async.models.loader import load_checkpoint

# transformers 5: Qwen3MoeConfig (and the other MoE configs) map num_experts -> num_local_experts
RENAMED = {"num_experts": "num_local_experts"}


def transformers5_spelling(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers 5 writes it: renamed keys, rope_theta in rope_parameters."""
    out = {RENAMED.get(key, key): value for key, value in cfg.items()}
    if "rope_theta" in out:
        theta = out.pop("rope_theta")
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                                  **(out.get("rope_parameters") or {})}
    return out


def same_model(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(str(a)), load_checkpoint(str(b))
    assert dataclasses.replace(cb.config, name=ca.config.name) == ca.config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_transformers5_keys_read_like_the_originals(tmp_path: Path, arch: str) -> None:
    cfg = tiny_config(arch)
    weights = random_hf_weights(cfg, seed=2)
    original = write_hf(tmp_path / "orig", cfg, weights)
    renamed = write_hf(tmp_path / "v5", transformers5_spelling(cfg), weights)
    same_model(original, renamed)
    if arch == "qwen3_moe":
        assert load_checkpoint(str(renamed)).config.num_experts == cfg["num_experts"]


@pytest.mark.parametrize("moe", [False, True])
def test_transformers5_keys_read_like_the_originals_hybrid(tmp_path: Path, moe: bool) -> None:
    cfg = tiny_qwen35_config(moe)
    weights = random_qwen35_weights(cfg, seed=2)
    original = write_qwen35_hf(tmp_path / "orig", cfg, weights, dtype="f32")
    renamed = write_qwen35_hf(tmp_path / "v5", transformers5_spelling(cfg), weights, dtype="f32")
    same_model(original, renamed)
