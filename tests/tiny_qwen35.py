"""Tiny random Qwen3.5 hybrids (`qwen3_5` dense, `qwen3_5_moe`) with one MTP layer, and
their HF and MLX folders.

Weights use HF names and the HF norm convention (N2 norms stored as w, applied as 1 + w;
`linear_attn.norm` plain). `write_qwen35_mlx` applies MLX's conversion (MODELS.md 5.10,
FORMATS.md 3.5). `hf_effective_weights` / `mlx_effective_weights` give the HF-named float
weights a file decodes to, for tests/reference_qwen35.py.

MTP in MLX folders: mainline mlx-lm drops `mtp.*`, but the engine drafts with the MTP layer
from MLX 4-bit checkpoints too (issue 7), so `write_qwen35_mlx` keeps it by default under
its HF names `mtp.*` (quantized like the trunk, norms +1 shifted, experts as switch_mlp);
`keep_mtp=False` writes the mainline layout, which must give "declares MTP, no weights".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny_hf import stored_value, write_safetensors
from tf_async.backend.weights import dequantize_affine, quantize_affine

TINY_VOCAB = 320  # matches tests/tiny_tokenizer.py
LM = "model.language_model."


def tiny_qwen35_config(moe: bool, **overrides: Any) -> dict[str, Any]:
    """A flat (text-only) config.json dict: 4 layers (3 linear_attention : 1 full_attention),
    gated attention with partial rotary 0.25, GDN with Hv > Hk, one MTP layer."""
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": TINY_VOCAB,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "attention_bias": False, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 512, "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if moe:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32)
    else:
        cfg["intermediate_size"] = 96
    cfg.update(overrides)
    return cfg


def as_vl_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The released layout: LM keys under text_config (model_type `<type>_text`)."""
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "tie_word_embeddings")}
    text["model_type"] = cfg["model_type"] + "_text"
    return {"model_type": cfg["model_type"], "architectures": cfg["architectures"],
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False), "text_config": text}


# ---------------------------------------------------------------------------------------
# random weights (HF names, float32)


class _Gen:
    """Random tensors scaled so activations stay O(1)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def mat(self, *shape: int) -> np.ndarray:
        return (self.rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def zero_centred(self, dim: int) -> np.ndarray:  # N2 weights, applied as 1 + w
        return (0.1 * self.rng.standard_normal(dim)).astype(np.float32)

    def plain(self, dim: int) -> np.ndarray:  # N3 weight, applied as w
        return (1.0 + 0.1 * self.rng.standard_normal(dim)).astype(np.float32)


def _attention(gen: _Gen, cfg: dict[str, Any], p: str) -> dict[str, np.ndarray]:
    H, nh, nkv, hd = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                      cfg["head_dim"])
    return {p + "q_proj.weight": gen.mat(2 * nh * hd, H), p + "k_proj.weight": gen.mat(nkv * hd, H),
            p + "v_proj.weight": gen.mat(nkv * hd, H), p + "o_proj.weight": gen.mat(H, nh * hd),
            p + "q_norm.weight": gen.zero_centred(hd), p + "k_norm.weight": gen.zero_centred(hd)}


def _deltanet(gen: _Gen, cfg: dict[str, Any], p: str) -> dict[str, np.ndarray]:
    H = cfg["hidden_size"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kernel = (cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
                      cfg["linear_conv_kernel_dim"])
    channels = 2 * hk * dk + hv * dv
    return {p + "in_proj_qkv.weight": gen.mat(channels, H), p + "in_proj_z.weight": gen.mat(hv * dv, H),
            p + "in_proj_b.weight": gen.mat(hv, H), p + "in_proj_a.weight": gen.mat(hv, H),
            p + "conv1d.weight": (gen.mat(channels, 1, kernel) * 1.5).astype(np.float32),
            p + "dt_bias": (0.5 * gen.rng.standard_normal(hv)).astype(np.float32),
            # decay rates exp(A_log) in [0.1, 1): the state keeps a memory of several tokens
            p + "A_log": np.log(gen.rng.uniform(0.1, 1.0, hv)).astype(np.float32),
            p + "norm.weight": gen.plain(dv), p + "out_proj.weight": gen.mat(H, hv * dv)}


def _ffn(gen: _Gen, cfg: dict[str, Any], p: str) -> dict[str, np.ndarray]:
    H = cfg["hidden_size"]
    if not str(cfg["model_type"]).startswith("qwen3_5_moe"):
        inter = cfg["intermediate_size"]
        return {p + "gate_proj.weight": gen.mat(inter, H), p + "up_proj.weight": gen.mat(inter, H),
                p + "down_proj.weight": gen.mat(H, inter)}
    E, Im, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    return {p + "gate.weight": gen.mat(E, H),
            p + "experts.gate_up_proj": gen.mat(E, 2 * Im, H),  # rows [0, Im) gate, [Im, 2Im) up
            p + "experts.down_proj": gen.mat(E, H, Im),
            p + "shared_expert.gate_proj.weight": gen.mat(Is, H),
            p + "shared_expert.up_proj.weight": gen.mat(Is, H),
            p + "shared_expert.down_proj.weight": gen.mat(H, Is),
            p + "shared_expert_gate.weight": gen.mat(1, H)}


def _layer(gen: _Gen, cfg: dict[str, Any], p: str, kind: str) -> dict[str, np.ndarray]:
    H = cfg["hidden_size"]
    w = {p + "input_layernorm.weight": gen.zero_centred(H),
         p + "post_attention_layernorm.weight": gen.zero_centred(H)}
    if kind == "linear_attention":
        w.update(_deltanet(gen, cfg, p + "linear_attn."))
    else:
        w.update(_attention(gen, cfg, p + "self_attn."))
    w.update(_ffn(gen, cfg, p + "mlp."))
    return w


def random_qwen35_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights with HF Qwen3.5 names (`model.language_model.*`, `lm_head.weight`,
    `mtp.*`); Qwen3.5-MoE experts in the fused HF layout."""
    gen = _Gen(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    w = {LM + "embed_tokens.weight": gen.rng.standard_normal((V, H)).astype(np.float32)}
    for layer, kind in enumerate(cfg["layer_types"]):
        w.update(_layer(gen, cfg, f"{LM}layers.{layer}.", kind))
    w[LM + "norm.weight"] = gen.zero_centred(H)
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = 4.0 * gen.mat(V, H)  # sharp logits: clear greedy margins
    for i in range(int(cfg.get("mtp_num_hidden_layers", 0))):
        w.update(_layer(gen, cfg, f"mtp.layers.{i}.", "full_attention"))
    if cfg.get("mtp_num_hidden_layers"):
        w.update({"mtp.fc.weight": gen.mat(H, 2 * H), "mtp.norm.weight": gen.zero_centred(H),
                  "mtp.pre_fc_norm_embedding.weight": gen.zero_centred(H),
                  "mtp.pre_fc_norm_hidden.weight": gen.zero_centred(H)})
    return w


# ---------------------------------------------------------------------------------------
# HF folder

_FP32_ALWAYS = ("A_log",)  # kept float32 whatever the checkpoint dtype (as released files do)


def _keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_ALWAYS)


def hf_effective_weights(weights: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """What `write_qwen35_hf(..., dtype)` reads back as (float32, HF names)."""
    return {n: w if _keeps_fp32(n) else stored_value(w, dtype) for n, w in weights.items()}


def _split_per_expert(weights: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Fused experts under `prefix` -> per-expert `experts.e.{gate,up,down}_proj.weight`."""
    out = dict(weights)
    for name in [n for n in weights if n.startswith(prefix) and n.endswith("experts.gate_up_proj")]:
        base = name.removesuffix("gate_up_proj")
        gate_up, down = out.pop(name), out.pop(base + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{base}{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{base}{e}.down_proj.weight"] = down[e]
    return out


def _write_folder_files(folder: Path, config: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))
    try:
        from tests.tiny_tokenizer import write_tiny_tokenizer
    except ModuleNotFoundError as exc:  # the tokenizer writer may not exist yet
        if exc.name != "tests.tiny_tokenizer":
            raise
        return
    write_tiny_tokenizer(folder)


def write_qwen35_hf(folder: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray],
                    dtype: str = "bf16", *, nested: bool = True, per_expert_mtp: bool = False,
                    with_mtp: bool = True) -> Path:
    """Write an HF folder: config (under text_config when `nested`, as released), floats in
    `dtype` (f32/f16/bf16; A_log stays f32), MoE experts fused (the MTP layer's per expert
    when `per_expert_mtp`), `mtp.*` unless `with_mtp=False` (config still declares it)."""
    folder = Path(folder)
    torch_dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]
    config = {**(as_vl_config(cfg) if nested else cfg), "torch_dtype": torch_dtype}
    _write_folder_files(folder, config)
    tensors = {n: w for n, w in weights.items() if with_mtp or not n.startswith("mtp.")}
    if per_expert_mtp:
        tensors = _split_per_expert(tensors, "mtp.")
    fp32 = {n: w for n, w in tensors.items() if _keeps_fp32(n)}
    rest = {n: w for n, w in tensors.items() if not _keeps_fp32(n)}
    write_safetensors(folder / "model-00001-of-00002.safetensors", rest, dtype=dtype)
    write_safetensors(folder / "model-00002-of-00002.safetensors", fp32)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in rest}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in fp32})
    index = {"metadata": {"total_size": int(sum(w.nbytes for w in tensors.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


# ---------------------------------------------------------------------------------------
# MLX folder (mlx-lm conversion of a Qwen3.5 HF checkpoint, affine quantization)

_SHIFTED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                  "k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
_ROUTER_GATES = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # kept at 8 bits
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def is_shifted_norm(hf_name: str) -> bool:
    """N2 norms that MLX stores as w + 1 (never linear_attn.norm)."""
    return hf_name.endswith(_SHIFTED_NORMS) or hf_name in (LM + "norm.weight", "mtp.norm.weight")


def mlx_quant_params(hf_name: str, w: np.ndarray, bits: int, group_size: int
                     ) -> tuple[int, int] | None:
    """(bits, group_size) MLX uses for this HF tensor, or None if it stays float."""
    linear = (hf_name.endswith(".weight") and w.ndim >= 2 and "conv1d" not in hf_name)
    if not (linear or hf_name.endswith(_FUSED_EXPERTS)):
        return None
    if hf_name.endswith(_ROUTER_GATES):
        router_group = 64 if w.shape[-1] % 64 == 0 else group_size
        return 8, router_group
    return (bits, group_size) if w.shape[-1] % group_size == 0 else None


def mlx_name(hf_name: str) -> str:
    if hf_name.startswith(LM):
        return "language_model.model." + hf_name.removeprefix(LM)
    if hf_name == "lm_head.weight":
        return "language_model.lm_head.weight"
    return hf_name  # mtp.* keeps its HF name


def _mlx_float_entries(hf_name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(MLX name, float array) pairs of one HF tensor, before quantization."""
    name = mlx_name(hf_name)
    if hf_name.endswith("experts.gate_up_proj"):
        inter = w.shape[1] // 2
        base = name.removesuffix("experts.gate_up_proj") + "switch_mlp."
        return [(base + "gate_proj.weight", w[:, :inter]), (base + "up_proj.weight", w[:, inter:])]
    if hf_name.endswith("experts.down_proj"):
        return [(name.removesuffix("experts.down_proj") + "switch_mlp.down_proj.weight", w)]
    if hf_name.endswith("conv1d.weight"):
        return [(name, np.ascontiguousarray(w.transpose(0, 2, 1)))]  # [C,1,K] -> [C,K,1]
    if is_shifted_norm(hf_name):
        return [(name, (w + np.float32(1.0)).astype(np.float32))]
    return [(name, w)]


def mlx_qwen35_tensors(weights: dict[str, np.ndarray], bits: int = 4, group_size: int = 32,
                       keep_mtp: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors as stored, per-module quantization overrides for config.json). Quantized
    linears: `.weight` uint32 codes, `.scales`/`.biases` float16; the rest float32."""
    out: dict[str, np.ndarray] = {}
    overrides: dict[str, Any] = {}
    for hf_name, w in weights.items():
        if hf_name.startswith("mtp.") and not keep_mtp:
            continue
        params = mlx_quant_params(hf_name, w, bits, group_size)
        for name, arr in _mlx_float_entries(hf_name, w):
            if params is None:
                out[name] = np.asarray(arr, np.float32)
                continue
            module = name.removesuffix(".weight")
            if params != (bits, group_size):
                overrides[module] = {"group_size": params[1], "bits": params[0]}
            q = quantize_affine(arr, *params)
            out[name] = q.codes
            out[module + ".scales"] = q.scales.astype(np.float16)
            out[module + ".biases"] = q.biases.astype(np.float16)
    return out, overrides


def write_qwen35_mlx(folder: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray],
                     bits: int = 4, group_size: int = 32, *, keep_mtp: bool = True,
                     nested: bool = True) -> Path:
    """Write an MLX-converted folder: `language_model.model.*` names, norms +1 shifted
    (not linear_attn.norm), conv1d [C,K,1], experts as switch_mlp, affine `bits`/`group_size`
    with routers and shared-expert gates at 8 bits/g64, A_log float32, unpadded header."""
    folder = Path(folder)
    tensors, overrides = mlx_qwen35_tensors(weights, bits, group_size, keep_mtp)
    quant = {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}
    config = {**(as_vl_config(cfg) if nested else cfg), "quantization": quant,
              "quantization_config": quant}
    _write_folder_files(folder, config)
    write_safetensors(folder / "model.safetensors", tensors, align=False,
                      metadata={"format": "mlx"})
    return folder


def mlx_effective_weights(weights: dict[str, np.ndarray], bits: int = 4, group_size: int = 32,
                          keep_mtp: bool = True) -> dict[str, np.ndarray]:
    """HF-named weights equal to what `write_qwen35_mlx` stores, decoded (dequantized with
    float16 scales/biases; shifted norms as float64 (w+1 in float32) - 1, so that the
    reference's 1 + w reproduces the stored value exactly)."""
    out: dict[str, np.ndarray] = {}
    for hf_name, w in weights.items():
        if hf_name.startswith("mtp.") and not keep_mtp:
            continue
        params = mlx_quant_params(hf_name, w, bits, group_size)
        if params is not None:
            q = quantize_affine(w, *params)
            scales = q.scales.astype(np.float16).astype(np.float32)
            biases = q.biases.astype(np.float16).astype(np.float32)
            out[hf_name] = dequantize_affine(q.codes, scales, biases, *params)
        elif is_shifted_norm(hf_name):
            out[hf_name] = (w + np.float32(1.0)).astype(np.float32).astype(np.float64) - 1.0
        else:
            out[hf_name] = w
    return out
