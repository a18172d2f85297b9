"""Write tiny Qwen3.5 / Qwen3.5-MoE GGUF files (`qwen35`, `qwen35moe`) from the HF-named float32
weights of tests/tiny_qwen35.py, transformed as llama.cpp's converter does (docs/QWEN35.md
"GGUF layout"): V heads grouped -> tiled, A_log -> -exp(A_log), N2 norms + 1, conv1d squeezed,
dt_bias -> ssm_dt.bias, fused experts split (or kept fused), `mtp.*` -> block n_layer `nextn.*`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny_gguf import QType, effective_type, quantize, tokenizer_metadata, write_gguf_raw
from tests.tiny_qwen35 import LM

_GLOBAL = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_MTP = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
        "mtp.norm.weight": "nextn.shared_head_norm.weight"}
_ALWAYS_F32 = ("ssm_conv1d.weight",)  # llama.cpp keeps conv kernels (and 1-D tensors) F32


def to_tiled(w: np.ndarray, axis: int, num_k_heads: int, num_v_heads: int, head_dim: int
             ) -> np.ndarray:
    """V heads along `axis` from grouped [Hk, r, d] to tiled [r, Hk, d] order (the converter's
    `_reorder_v_heads`)."""
    shape = list(w.shape)
    split = shape[:axis] + [num_k_heads, num_v_heads // num_k_heads, head_dim] + shape[axis + 1:]
    return np.swapaxes(w.reshape(split), axis, axis + 1).reshape(shape)


def _linear_attn(rest: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dv, qk = cfg["linear_value_head_dim"], 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    if rest.endswith("conv1d.weight"):
        w = w[:, 0, :]  # squeeze [C, 1, K] -> [C, K]
    if hk != hv:
        if rest.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            w = np.concatenate([w[:qk], to_tiled(w[qk:], 0, hk, hv, dv)])
        elif rest.endswith("in_proj_z.weight"):
            w = to_tiled(w, 0, hk, hv, dv)
        elif rest.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            w = to_tiled(w, 0, hk, hv, 1)
        elif rest.endswith("out_proj.weight"):
            w = to_tiled(w, 1, hk, hv, dv)
    if rest.endswith("A_log"):
        # the converter's float32 -exp (torch); here the correctly rounded float32 of it
        w = (-np.exp(w.astype(np.float64))).astype(np.float32)
    return w


def _gguf_name(name: str, num_layers: int) -> str:
    """HF name -> 'blk.N.<hf rest>' / global GGUF name (the rest is mapped afterwards)."""
    if name == "lm_head.weight":
        return "output.weight"
    if name in _MTP:
        return f"blk.{num_layers}.{_MTP[name]}"
    if name.startswith("mtp.layers."):
        index, rest = name.removeprefix("mtp.layers.").split(".", 1)
        return f"blk.{num_layers + int(index)}.{rest}"
    rest = name.removeprefix(LM)
    if rest in _GLOBAL:
        return _GLOBAL[rest]
    index, rest = rest.removeprefix("layers.").split(".", 1)
    return f"blk.{index}.{rest}"


def gguf_qwen35_tensors(cfg: dict[str, Any], weights: dict[str, np.ndarray], *,
                        fused_experts: bool = False) -> dict[str, np.ndarray]:
    """HF-named float32 weights (flat tiny config) -> GGUF-named float32 arrays."""
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        target = _gguf_name(name, cfg["num_hidden_layers"])
        if not target.startswith("blk.") or ".nextn." in target:
            # the converter renames mtp.* first, so enorm / hnorm / shared_head_norm shift too
            out[target] = w + np.float32(1) if target.endswith("norm.weight") else w
            continue
        _, index, rest = target.split(".", 2)
        prefix = f"blk.{index}."
        if rest.startswith("linear_attn."):
            w = _linear_attn(rest, w, cfg)
        elif rest.endswith("norm.weight"):  # every N2 norm (linear_attn.norm is plain)
            w = w + np.float32(1)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2 Im, H], rows [0, Im) gate
            inter = w.shape[1] // 2
            if fused_experts:
                out[prefix + "ffn_gate_up_exps.weight"] = w
            else:
                out[prefix + "ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :inter])
                out[prefix + "ffn_up_exps.weight"] = np.ascontiguousarray(w[:, inter:])
            continue
        out[prefix + _LAYER[rest]] = np.ascontiguousarray(w, np.float32)
    return out


def qwen35_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    """`general.*`, `{arch}.*` and `tokenizer.*` keys for a flat tiny config."""
    moe = cfg["model_type"] == "qwen3_5_moe"
    arch = "qwen35moe" if moe else "qwen35"
    hd, mtp = cfg["head_dim"], int(cfg.get("mtp_num_hidden_layers", 0))
    rope = cfg["rope_parameters"]
    keys: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"] + mtp,
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": hd, "attention.value_length": hd,
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.dimension_count": int(hd * rope["partial_rotary_factor"]),
        "rope.dimension_sections": [11, 11, 10, 0],
        "ssm.conv_kernel": cfg["linear_conv_kernel_dim"], "ssm.state_size": cfg["linear_key_head_dim"],
        "ssm.group_count": cfg["linear_num_key_heads"],
        "ssm.time_step_rank": cfg["linear_num_value_heads"],
        "ssm.inner_size": cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"],
        "full_attention_interval": cfg["full_attention_interval"],
    }
    if mtp:
        keys["nextn_predict_layers"] = mtp
    if moe:
        keys.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"],
                     "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"]})
    else:
        keys["feed_forward_length"] = cfg["intermediate_size"]
    return {"general.name": f"tiny-{arch}", **{f"{arch}.{k}": v for k, v in keys.items()},
            **tokenizer_metadata()}


def write_qwen35_gguf(path: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], *,
                      qtype: str = "F32", fused_experts: bool = False,
                      drop: tuple[str, ...] = (), metadata: dict[str, Any] | None = None,
                      edit: Callable[[dict[str, np.ndarray]], None] | None = None) -> Path:
    """Write the tiny hybrid as a GGUF: 2-D/3-D weights as `qtype` (where blocks tile the rows,
    else Q8_0 / F32), conv kernels and vectors F32; `drop` leaves tensors out; `metadata`
    overrides keys (None deletes one); `edit` changes the GGUF-named float arrays in place."""
    arch = "qwen35moe" if cfg["model_type"] == "qwen3_5_moe" else "qwen35"
    meta = {**qwen35_metadata(cfg), **(metadata or {})}
    meta = {k: v for k, v in meta.items() if v is not None}
    arch = meta.pop("general.architecture", arch)  # the writer adds it first
    arrays = gguf_qwen35_tensors(cfg, weights, fused_experts=fused_experts)
    if edit is not None:
        edit(arrays)
    tensors: dict[str, tuple[np.ndarray, str | None]] = {}
    for name, w in arrays.items():
        if name in drop:
            continue
        wanted = QType.F32 if name.endswith(_ALWAYS_F32) else QType[qtype]
        stored = effective_type(w.shape, wanted)
        tensors[name] = (quantize(w, stored), stored.name)
    return write_gguf_raw(path, arch, meta, tensors)
