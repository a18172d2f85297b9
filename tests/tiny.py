"""Tiny random checkpoints for tests: HF config dicts and float32 weights in HF names.

Writers for each file format live beside this module (tiny_hf.py, tiny_gguf.py); every
test model starts here so that all formats share one config and one set of weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TINY_VOCAB = 320  # matches tests/tiny_tokenizer.py (256 bytes + merges + specials, padded)


def tiny_config(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """An HF config.json dict for a tiny model of `arch` (llama, qwen2, qwen3, qwen3_moe)."""
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
        ],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": TINY_VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": arch != "qwen3_moe",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch in ("qwen3", "qwen3_moe"):
        cfg["head_dim"] = 32  # explicit head_dim with nh*hd != H
    if arch == "qwen3_moe":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    cfg.update(overrides)
    return cfg


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def random_hf_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights with HF names for the config (scaled so activations stay O(1))."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg)
    arch = cfg["model_type"]

    def mat(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": (0.25 * rng.standard_normal((V, H))).astype(np.float32)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = mat(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = mat(H, nh * hd)
        if arch == "qwen2" or cfg.get("attention_bias"):
            for name, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                w[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(size)).astype(np.float32)
        if arch != "qwen2" and cfg.get("attention_bias"):
            w[p + "self_attn.o_proj.bias"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
        if arch in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        sparse = (arch == "qwen3_moe" and layer not in cfg.get("mlp_only_layers", [])
                  and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if sparse:
            E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = mat(E, H)
            for e in range(E):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(Im, H)
                w[p + f"mlp.experts.{e}.up_proj.weight"] = mat(Im, H)
                w[p + f"mlp.experts.{e}.down_proj.weight"] = mat(H, Im)
        else:
            inter = cfg["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = mat(inter, H)
            w[p + "mlp.up_proj.weight"] = mat(inter, H)
            w[p + "mlp.down_proj.weight"] = mat(H, inter)
    w["model.norm.weight"] = norm(H)
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = mat(V, H)
    return w
