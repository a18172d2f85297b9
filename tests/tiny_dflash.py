"""Tiny random DFlash / DFlash2 drafter folders in the public layout (docs/DFLASH.md), for
the tiny targets of tests/tiny.py (hidden 64, vocab 320, 2 layers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny import TINY_VOCAB
from tests.tiny_hf import write_safetensors


def dflash_config(generation: int = 1, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny drafter: 2 layers, hidden 64, 4 heads of 16, 2 KV heads; block
    of 4; DFlash2: sliding window 6, non-causal, conv kernel 2 over groups of 16, selector
    rank 8 top 4, softcap 20, output multiplier 0.5."""
    dflash: dict[str, Any] = {"block_size": 4, "mask_token_id": TINY_VOCAB - 1,
                              "target_layer_ids": [0, 1]}
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel" if generation == 1 else "DFlash2DraftModel"],
        "model_type": "qwen3", "attention_bias": False, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": TINY_VOCAB, "dflash_config": dflash,
    }
    if generation == 2:
        dflash.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                      final_logit_softcapping=20.0, output_multiplier=0.5)
        cfg.update(is_causal=False, sliding_window=6, num_target_layers=2,
                   layer_types=["sliding_attention"] * 2, use_sliding_window=True)
    cfg.update(overrides)
    return cfg


def dflash_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights under the public names, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qs, kvs = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dflash = cfg["dflash_config"]

    def mat(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    out = {"fc.weight": mat(h, len(dflash["target_layer_ids"]) * h),
           "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                    p + "self_attn.q_proj.weight": mat(qs, h), p + "self_attn.k_proj.weight": mat(kvs, h),
                    p + "self_attn.v_proj.weight": mat(kvs, h), p + "self_attn.o_proj.weight": mat(h, qs),
                    p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                    p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
                    p + "mlp.down_proj.weight": mat(h, inter)})
        if "conv_kernel_size" in dflash:
            k, groups = dflash["conv_kernel_size"], h // dflash["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[p + conv + ".base_kernel"] = (0.5 * rng.standard_normal((2, k, h))).astype(np.float32)
                out[p + conv + ".kernel_projection.weight"] = 0.3 * mat(2 * k * groups, h)
    if "selector_rank" in dflash:
        rank, vocab = dflash["selector_rank"], cfg["vocab_size"]
        out["candidate_selector.hidden_projection.weight"] = mat(rank, h)
        out["candidate_selector.predecessor_codebook"] = rng.standard_normal((vocab, rank)).astype(np.float32)
        out["candidate_selector.successor_codebook"] = rng.standard_normal((vocab, rank)).astype(np.float32)
    return out


def write_dflash(folder: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], *,
                 dtype: str = "bf16") -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    write_safetensors(folder / "model.safetensors", weights, dtype=dtype)
    return folder


def mlx_quantize_dflash(weights: dict[str, np.ndarray], bits: int = 4, group_size: int = 32, *,
                        codebooks: bool = False) -> dict[str, np.ndarray]:
    """The MLX affine layout of the public 4-bit DFlash2 drafters: every projection `P.weight`
    becomes packed uint32 codes `P.weight` + `P.scales` + `P.biases` (norms and conv base
    kernels stay float); codebooks=True quantizes the selector's codebooks too (as
    nn.quantize does to Embedding modules), stored under `.weight`."""
    from tf_async.backend.weights import quantize_affine

    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        book = name.endswith("_codebook")
        if not (book and codebooks) and not (name.endswith(("proj.weight", "projection.weight")) or name == "fc.weight"):
            out[name] = w
            continue
        module = name if book else name.removesuffix(".weight")
        q = quantize_affine(w, bits, group_size)
        out.update({module + ".weight": q.codes, module + ".scales": q.scales,
                    module + ".biases": q.biases})
    return out
