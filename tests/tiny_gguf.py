"""Write tiny GGUF checkpoints from tests/tiny.py configs and HF-named float32 weights.

Quantization uses gguf.quants where it can (Q8_0, Q4_0, Q4_1, Q5_0, BF16, ...); the K-quants
(Q4_K, Q5_K, Q6_K) use the small NumPy block encoders below. Tensors whose input dim is not a
whole number of blocks fall back to Q8_0 (or F32), as llama.cpp's quantizer does. llama-arch
files get llama.cpp's forward Q/K row permutation (FORMATS.md §8).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from tests.tiny_tokenizer import tiny_gguf_tokenizer_metadata

QType = GGMLQuantizationType
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


# ---- K-quant block encoders: float32 [N, 256] -> uint8 [N, type_size] -------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def _kquant_params(sub: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per block d, dmin (f16) and 6-bit sub-block scales/mins, plus the codes [N, 8, 32]."""
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - lo) / levels, -lo
    d = (scale.max(1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(_safe_div(sub + (dmin[:, None] * m)[..., None], step)), 0, levels)
    return d, dmin, sc, m, q.astype(np.uint8)


def _pack_kquant_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of ggml's 12-byte 6-bit scale/min layout (FORMATS.md §7)."""
    first = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    second = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _kquant_qs(q: np.ndarray) -> np.ndarray:
    """Codes [N, 8, 32] -> 128 bytes: byte 32c+l = sub-block 2c (low nibble), 2c+1 (high)."""
    q = q & 0xF
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _kquant_params(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_kquant_scales(sc, m), _kquant_qs(q)], axis=1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _kquant_params(x.reshape(-1, 8, 32), 31)
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << shifts, axis=1).astype(np.uint8)  # [N, 32]
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_kquant_scales(sc, m), qh, _kquant_qs(q)]
    return np.concatenate(parts, axis=1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = (q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)  # [N, half, 2, 32]
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(((q >> 4) & 3) << shifts, axis=2).astype(np.uint8)  # [N, 2, 32]
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)]
    return np.concatenate(parts, axis=1)


_KQUANT_ENCODERS = {QType.Q4_K: encode_q4_k, QType.Q5_K: encode_q5_k, QType.Q6_K: encode_q6_k}


def quantize(w: np.ndarray, qtype: QType) -> np.ndarray:
    """Float [..., in] -> what GGUFWriter.add_tensor takes for `qtype` (bytes for quant types)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == QType.F32:
        return w
    if qtype in _KQUANT_ENCODERS:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = _KQUANT_ENCODERS[qtype](w.reshape(-1, block_size))
        return blocks.reshape(*w.shape[:-1], w.shape[-1] // block_size * type_size)
    return quants.quantize(w, qtype)


def effective_type(shape: tuple[int, ...], qtype: QType) -> QType:
    """The type a tensor of `shape` is stored as: 1-D stays F32; blocks must tile the rows."""
    if len(shape) == 1:
        return QType.F32
    for candidate in (qtype, QType.Q8_0, QType.F32):
        if shape[-1] % GGML_QUANT_SIZES[candidate][0] == 0:
            return candidate
    return QType.F32


# ---- HF weights -> GGUF tensors -----------------------------------------------------------------


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF -> GGUF) on axis 0 of a weight or bias."""
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: dict[str, Any], weights: dict[str, np.ndarray], gguf_arch: str) -> dict[str, np.ndarray]:
    """HF-named float weights -> GGUF-named float tensors (experts stacked, llama Q/K permuted)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        if (match := _EXPERT.fullmatch(name)) is not None:
            layer, expert, proj = int(match[1]), int(match[2]), match[3]
            experts.setdefault((layer, proj), {})[expert] = w
        elif name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = w
        else:
            layer_str, rest = name.removeprefix("model.layers.").split(".", 1)
            out[f"blk.{layer_str}.{_LAYER_NAMES[rest]}"] = w
    for (layer, proj), by_expert in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    if gguf_arch == "llama":
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        for name in list(out):
            kind = name.split(".")[-2]  # blk.N.attn_q.weight -> attn_q
            if name.startswith("blk.") and kind in heads:
                out[name] = permute_qk(out[name], heads[kind])
    return out


def arch_metadata(cfg: dict[str, Any], gguf_arch: str) -> dict[str, Any]:
    """The `{arch}.*` hyperparameter keys for an HF config dict (FORMATS.md §5)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    meta: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": hidden,
        "block_count": cfg["num_hidden_layers"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "rope.freq_base": float(cfg["rope_theta"]),
        "rope.dimension_count": head_dim,
    }
    if "head_dim" in cfg:
        meta.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
    if cfg["model_type"] == "qwen3_moe":
        meta.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"]})
        if not cfg.get("norm_topk_prob", True):
            meta["expert_weights_norm"] = False
    meta.update(_rope_scaling_metadata(cfg.get("rope_scaling")))
    return {f"{gguf_arch}.{key}": value for key, value in meta.items()}


def _rope_scaling_metadata(scaling: dict[str, Any] | None) -> dict[str, Any]:
    if not scaling:
        return {}
    keys = {"factor": "factor", "original_max_position_embeddings": "original_context_length",
            "attention_factor": "attn_factor", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
    meta: dict[str, Any] = {"rope.scaling.type": scaling.get("rope_type", scaling.get("type"))}
    for hf_key, gguf_key in keys.items():
        if hf_key in scaling:
            value = scaling[hf_key]
            meta[f"rope.scaling.{gguf_key}"] = float(value) if hf_key != "original_max_position_embeddings" else int(value)
    return meta


def tokenizer_metadata() -> dict[str, Any]:
    """`tokenizer.*` keys of the tiny tokenizer (tests/tiny_tokenizer.py)."""
    return dict(tiny_gguf_tokenizer_metadata())


# ---- file writing -------------------------------------------------------------------------------


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, (list, tuple)):
        return GGUFValueType.ARRAY
    return GGUFValueType.STRING


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        sub = _value_type(value[0])
        sub = GGUFValueType.INT32 if sub == GGUFValueType.UINT32 else sub
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=sub)
    else:
        writer.add_key_value(key, value, _value_type(value))


def write_gguf_raw(path: str | Path, arch: str, metadata: dict[str, Any],
                   tensors: dict[str, tuple[np.ndarray, str | None]]) -> Path:
    """Write a GGUF with exactly these keys and tensors: name -> (array, ggml type name or None).

    With a type name the array is already encoded (uint8 [..., bytes_per_row] blocks);
    with None it is stored as its NumPy dtype (F32/F16)."""
    path = Path(path)
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        _add_value(writer, key, value)
    for name, (array, type_name) in tensors.items():
        raw_dtype = None if type_name is None else QType[type_name]
        if raw_dtype in (QType.F32, QType.F16):
            raw_dtype = None  # the writer infers float types from the dtype
        writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(path: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], *,
               qtype: str = "F32", arch: str | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:
    """Write the tiny model `cfg`/`weights` (tests/tiny.py) as a GGUF file.

    `qtype`: ggml type name for 2-D/3-D weights (norms and biases stay F32); `arch`: the
    general.architecture to write (default from model_type); `tensor_types`: per-GGUF-name
    type overrides, e.g. {"blk.0.attn_k.weight": "Q5_0"}."""
    gguf_arch = arch or GGUF_ARCH[cfg["model_type"]]
    metadata = {"general.name": f"tiny-{cfg['model_type']}", **arch_metadata(cfg, gguf_arch),
                **tokenizer_metadata()}
    tensors: dict[str, tuple[np.ndarray, str | None]] = {}
    for name, w in gguf_tensors(cfg, weights, gguf_arch).items():
        wanted = QType[(tensor_types or {}).get(name, qtype)]
        stored = effective_type(w.shape, wanted)
        tensors[name] = (quantize(w, stored), stored.name)
    return write_gguf_raw(path, gguf_arch, metadata, tensors)
