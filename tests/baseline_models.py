"""The tiny models whose outputs are kept as baselines (tests/baselines/), one per architecture
and weight kind, written from fixed seeds so that every run writes the same weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests import tiny_qwen35 as tq
from tests.tiny import random_hf_weights, tiny_config

BASELINE_DIR = Path(__file__).parent / "baselines"


def _hf(arch: str, seed: int) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        from tests.tiny_hf import write_hf

        cfg = tiny_config(arch)
        return write_hf(folder, cfg, random_hf_weights(cfg, seed=seed))
    return write


def _mlx(arch: str, seed: int, bits: int) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        from tests.tiny_hf import write_mlx

        cfg = tiny_config(arch)
        return write_mlx(folder, cfg, random_hf_weights(cfg, seed=seed), bits=bits)
    return write


def _gguf(arch: str, seed: int, qtype: str) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        from tests.tiny_gguf import write_gguf

        cfg = tiny_config(arch)
        folder.mkdir(parents=True, exist_ok=True)
        return write_gguf(folder / f"{arch}.gguf", cfg, random_hf_weights(cfg, seed=seed),
                          qtype=qtype)
    return write


def _hybrid(moe: bool, seed: int, kind: str) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        cfg = tq.tiny_qwen35_config(moe=moe)
        weights = tq.random_qwen35_weights(cfg, seed=seed)
        if kind == "mlx4":
            return tq.write_qwen35_mlx(folder, cfg, weights, 4, 32)
        return tq.write_qwen35_hf(folder, cfg, weights, "bf16")
    return write


TINY_MODELS: dict[str, Callable[[Path], Path]] = {
    "llama-f32": _hf("llama", 11),
    "qwen2-f32": _hf("qwen2", 12),
    "qwen3-f32": _hf("qwen3", 13),
    "qwen3_moe-f32": _hf("qwen3_moe", 14),
    "qwen3-mlx4": _mlx("qwen3", 15, 4),
    "llama-mlx8": _mlx("llama", 16, 8),
    "llama-gguf-q4_0": _gguf("llama", 17, "Q4_0"),
    "qwen3_5-mlx4": _hybrid(False, 18, "mlx4"),
    "qwen3_5_moe-bf16": _hybrid(True, 19, "bf16"),
}


def baseline_path(name: str, device: str) -> Path:
    """tests/baselines/<name>-<device>.json; `name` is a TINY_MODELS key or "default"."""
    return BASELINE_DIR / f"{name}-{device}.json"
