"""RoPE inverse frequencies for the scaling types of the supported configs (MODELS.md §0.3)."""

from __future__ import annotations

import math

import numpy as np

from ..errors import ModelFormatError
from .config import ModelConfig


def rope_tables(config: ModelConfig, divisors: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Return (inv_freq [rot/2] float32, mscale) for the config's rope type.

    `divisors` are GGUF `rope_freqs.weight` values (llama3 scaling baked into the file)."""
    rot = config.rotary_dim or config.head_dim
    base = np.float64(config.rope_theta)
    inv = 1.0 / base ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    scaling = config.rope_scaling or {}
    rtype = scaling.get("rope_type", "default")
    mscale = 1.0
    if rtype == "linear":
        inv = inv / float(scaling["factor"])
    elif rtype == "llama3":
        inv = _llama3(inv, scaling)
    elif rtype == "yarn":
        inv, mscale = _yarn(inv, scaling, rot, float(base))
    elif rtype != "default":
        raise ModelFormatError(f"unsupported rope scaling type {rtype!r}")
    if divisors is not None:
        if divisors.shape != inv.shape:
            raise ModelFormatError(f"rope_freqs.weight has shape {divisors.shape}, expected {inv.shape}")
        inv = inv / divisors.astype(np.float64)
    return inv.astype(np.float32), float(mscale)


def _llama3(inv: np.ndarray, s: dict) -> np.ndarray:
    factor = float(s["factor"])
    low_ff = float(s.get("low_freq_factor", 1.0))
    high_ff = float(s.get("high_freq_factor", 4.0))
    orig = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = orig / low_ff, orig / high_ff
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen < high_wl, inv, np.where(wavelen > low_wl, inv / factor, mid))
    return out


def _yarn(inv: np.ndarray, s: dict, rot: int, base: float) -> tuple[np.ndarray, float]:
    factor = float(s["factor"])
    orig = float(s.get("original_max_position_embeddings", 4096))
    beta_fast = float(s.get("beta_fast", 32))
    beta_slow = float(s.get("beta_slow", 1))

    def corr(r: float) -> float:
        return rot * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = float(min(math.ceil(corr(beta_slow)), rot - 1))
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(rot // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    out = (inv / factor) * ramp + inv * (1 - ramp)
    attn = s.get("attention_factor")
    if attn is None:
        attn = _mscale(factor, float(s.get("mscale", 1))) / _mscale(factor, float(s.get("mscale_all_dim", 0))) \
            if "mscale" in s else 0.1 * math.log(factor) + 1.0
    return out, float(attn)


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
