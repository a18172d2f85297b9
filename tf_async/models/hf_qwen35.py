"""Qwen3.5 / Qwen3.6 hybrid folders (HF bf16/f16/f32, MLX affine 4/8-bit) -> Checkpoint.

Layouts accepted (MODELS.md 5.10): trunk under `model.language_model.` (HF), `language_model.model.`
(MLX), `model.` or `language_model.`; config nested under `text_config` or flat. Norm convention:
HF files store zero-centred N2 weights (applied as 1 + w), MLX conversions store w + 1; which one a
file uses is read from the conv1d layout as mlx-lm does ([C,1,K] HF, [C,K,1] MLX), and the loader
folds the +1 once for HF files. `linear_attn.norm` (N3) is never shifted. Experts: fused
`experts.gate_up_proj`, per expert, or MLX `switch_mlp`; routers / shared-expert gates may be 8-bit.
`mtp.*` is loaded when `mtp.fc.weight` exists; `checkpoint.meta["mtp"]` says why it is absent.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFormatError
from .checkpoint import Checkpoint
from .config import ROPE_TYPES, ModelConfig
from .hf import QuantSpec, TensorSource, WeightReader, _read_json, merge_generation_config
from .progress import LoadProgress
from .qwen35 import (
    FULL_ATTENTION,
    HYBRID_ARCHS,
    LINEAR_ATTENTION,
    DeltaNetWeights,
    DenseFfnWeights,
    FfnWeights,
    GatedAttentionWeights,
    HybridConfig,
    HybridLayerWeights,
    HybridWeights,
    MoeFfnWeights,
    MtpWeights,
)

LM_LAYOUTS = (  # (trunk prefix, lm_head candidates)
    ("model.language_model.", ("lm_head.weight",)),
    ("language_model.model.", ("language_model.lm_head.weight",)),
    ("model.", ("lm_head.weight",)),
    ("language_model.", ("language_model.lm_head.weight", "lm_head.weight")),
)
IGNORED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "mtp.")
MTP_OK = "present"
MTP_NONE = "not declared"
MTP_MISSING = ("missing: config.json declares mtp_num_hidden_layers={} but the files hold no "
               "mtp.* tensors (converters such as mlx-lm drop them)")
MTP_DEDICATED = "unsupported: mtp_use_dedicated_embeddings is true"


# ---------------------------------------------------------------------------------------
# config


def hybrid_model_type(raw: dict[str, Any]) -> str | None:
    """`qwen3_5` / `qwen3_5_moe` when config.json describes a hybrid, else None."""
    inner = raw.get("text_config")
    inner = inner if isinstance(inner, dict) else {}
    model_type = str(raw.get("model_type") or inner.get("model_type") or "").removesuffix("_text")
    return model_type if model_type in HYBRID_ARCHS else None


def is_hybrid_folder(folder: Path) -> bool:
    raw = _read_json(folder / "config.json", required=False)
    return raw is not None and hybrid_model_type(raw) is not None


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The LM keys: text_config when present (tie_word_embeddings there first), else the top."""
    inner = raw.get("text_config")
    if not isinstance(inner, dict):
        return dict(raw)
    merged = dict(inner)
    merged.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    for key in ("bos_token_id", "eos_token_id"):
        merged.setdefault(key, raw.get(key))
    return merged


def _layer_types(cfg: dict[str, Any], source: str) -> tuple[str, ...]:
    num_layers = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        types = tuple(str(t) for t in cfg["layer_types"])
    else:
        interval = int(cfg.get("full_attention_interval", 4))
        types = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                      for i in range(num_layers))
    for layer, kind in enumerate(types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ModelFormatError(f"{source}: unknown layer type {kind!r} at layer {layer}; "
                                   f"supported: {LINEAR_ATTENTION}, {FULL_ATTENTION}")
    if len(types) != num_layers:
        raise ModelFormatError(f"{source}: layer_types has {len(types)} entries for "
                               f"num_hidden_layers={num_layers}")
    return types


def _rope(cfg: dict[str, Any], head_dim: int, source: str
          ) -> tuple[float, dict[str, Any] | None, int]:
    """(theta, scaling or None, rotary dims). Text-only M-RoPE is plain 1-D partial RoPE."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ModelFormatError(f"{source}: unsupported rope type {rtype!r}; supported: {ROPE_TYPES}")
    scaling = None if rtype == "default" else {**params, "rope_type": rtype}
    return theta, scaling, int(head_dim * factor)


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _kv_config(cfg: dict[str, Any], model_type: str, types: tuple[str, ...], source: str
               ) -> ModelConfig:
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    theta, scaling, rotary_dim = _rope(cfg, head_dim, source)
    moe = model_type == "qwen3_5_moe"
    return ModelConfig(
        arch=model_type, hidden_size=int(cfg["hidden_size"]),
        num_layers=types.count(FULL_ATTENTION), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=0 if moe else int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=True,
        num_experts=int(cfg["num_experts"]) if moe else 0,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]) if moe else 0,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]) if moe else 0,
        norm_topk_prob=True,  # Qwen3.5-MoE always renormalises the top-k weights
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg.get("eos_token_id")))


def hybrid_config_from_hf(raw: dict[str, Any], *, source: str = "config.json") -> HybridConfig:
    """Parse a qwen3_5 / qwen3_5_moe config.json dict (nested or flat)."""
    model_type = hybrid_model_type(raw)
    if model_type is None:
        raise ModelFormatError(f"{source}: model_type {raw.get('model_type')!r} is not a "
                               f"Qwen3.5 hybrid ({HYBRID_ARCHS})")
    cfg = text_config(raw)
    try:
        types = _layer_types(cfg, source)
        hybrid = HybridConfig(
            kv_config=_kv_config(cfg, model_type, types, source), layer_types=types,
            linear_num_key_heads=int(cfg["linear_num_key_heads"]),
            linear_num_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(cfg["linear_conv_kernel_dim"]),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
            mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
            mtp_use_dedicated_embeddings=bool(cfg.get("mtp_use_dedicated_embeddings", False)))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelFormatError):
            raise
        raise ModelFormatError(f"{source}: missing or invalid key {exc}") from exc
    if hybrid.linear_num_value_heads % hybrid.linear_num_key_heads:
        raise ModelFormatError(f"{source}: linear_num_value_heads {hybrid.linear_num_value_heads} "
                               f"is not a multiple of linear_num_key_heads "
                               f"{hybrid.linear_num_key_heads}")
    return hybrid


# ---------------------------------------------------------------------------------------
# tensors


class HybridReader:
    """Reads one hybrid folder's tensors (dtype/shape checked) into HybridWeights."""

    def __init__(self, src: TensorSource, quant: QuantSpec, hybrid: HybridConfig):
        self.src = src
        self.hybrid = hybrid
        self.cfg = hybrid.kv_config
        self.base = WeightReader(src, hybrid.kv_config, quant)
        self.prefix, self.head_names = self._layout()
        self.fold_norms = self._hf_norms()

    def _layout(self) -> tuple[str, tuple[str, ...]]:
        for prefix, heads in LM_LAYOUTS:
            if self.src.has(prefix + "embed_tokens.weight"):
                return prefix, heads
        raise ModelFormatError(f"{self.src.file_of('embed_tokens.weight')}: missing tensor "
                               f"'embed_tokens.weight' under any of "
                               f"{[p for p, _ in LM_LAYOUTS]}")

    def _shape(self, name: str) -> tuple[int, ...]:
        if not self.src.has(name):
            self.src.get(name)  # raises the missing-tensor error naming the file
        return tuple(self.src.owner[name].tensors[name].shape)

    def _hf_norms(self) -> bool:
        """HF convention (fold +1) iff a conv1d weight has the HF layout [C, 1, K]."""
        gdn = self.hybrid.gdn_layers
        if not gdn:
            return self.prefix == "model.language_model."
        shape = self._shape(f"{self.prefix}layers.{gdn[0]}.linear_attn.conv1d.weight")
        return len(shape) == 3 and shape[1] == 1

    def norm(self, name: str, dim: int) -> np.ndarray:
        """An N2 norm weight in the applied form (1 + w)."""
        w = self.base.tensor(name, (dim,))
        return (w + np.float32(1.0)).astype(np.float32) if self.fold_norms else w

    def conv(self, name: str) -> np.ndarray:
        """conv1d weight as [C, K] float32 from [C, 1, K] (HF) or [C, K, 1] (MLX)."""
        channels, kernel = self.hybrid.conv_channels, self.hybrid.linear_conv_kernel_dim
        shape = self._shape(name)
        if shape == (channels, 1, kernel):
            return np.ascontiguousarray(self.base.tensor(name, shape)[:, 0, :], np.float32)
        if shape == (channels, kernel, 1):
            return np.ascontiguousarray(self.base.tensor(name, shape)[:, :, 0], np.float32)
        raise ModelFormatError(f"{self.src.file_of(name)}: tensor {name!r} has shape "
                               f"{list(shape)}, expected [{channels}, 1, {kernel}] (HF) or "
                               f"[{channels}, {kernel}, 1] (MLX) from config.json")

    def deltanet(self, p: str) -> DeltaNetWeights:
        hyb, hidden = self.hybrid, self.cfg.hidden_size
        hv, v_size = hyb.linear_num_value_heads, hyb.linear_num_value_heads * hyb.linear_value_head_dim
        return DeltaNetWeights(
            in_qkv=self.base.linear(p + "in_proj_qkv", hyb.conv_channels, hidden),
            in_z=self.base.linear(p + "in_proj_z", v_size, hidden),
            in_b=self.base.linear(p + "in_proj_b", hv, hidden),
            in_a=self.base.linear(p + "in_proj_a", hv, hidden),
            conv=self.conv(p + "conv1d.weight"),
            a_log=self.base.tensor(p + "A_log", (hv,)),
            dt_bias=self.base.tensor(p + "dt_bias", (hv,)),
            norm=self.base.tensor(p + "norm.weight", (hyb.linear_value_head_dim,)),
            out=self.base.linear(p + "out_proj", hidden, v_size))

    def attention(self, p: str) -> GatedAttentionWeights:
        cfg = self.cfg
        hidden, q_size, hd = cfg.hidden_size, cfg.q_size, cfg.head_dim
        return GatedAttentionWeights(
            q=self.base.linear(p + "q_proj", 2 * q_size, hidden),
            k=self.base.linear(p + "k_proj", cfg.kv_size, hidden),
            v=self.base.linear(p + "v_proj", cfg.kv_size, hidden),
            o=self.base.linear(p + "o_proj", hidden, q_size),
            q_norm=self.norm(p + "q_norm.weight", hd), k_norm=self.norm(p + "k_norm.weight", hd))

    def ffn(self, layer_prefix: str) -> FfnWeights:
        if not self.hybrid.is_moe:
            return DenseFfnWeights(**self.base.dense_mlp(layer_prefix))
        p, hidden = layer_prefix + "mlp.", self.cfg.hidden_size
        shared = self.hybrid.shared_expert_intermediate_size
        return MoeFfnWeights(
            **self.base.moe(layer_prefix),
            shared_gate=self.base.linear(p + "shared_expert.gate_proj", shared, hidden),
            shared_up=self.base.linear(p + "shared_expert.up_proj", shared, hidden),
            shared_down=self.base.linear(p + "shared_expert.down_proj", hidden, shared),
            shared_expert_gate=self.base.linear(p + "shared_expert_gate", 1, hidden))

    def layer(self, p: str, kind: str) -> HybridLayerWeights:
        hidden = self.cfg.hidden_size
        mixer = (self.deltanet(p + "linear_attn.") if kind == LINEAR_ATTENTION
                 else self.attention(p + "self_attn."))
        return HybridLayerWeights(
            kind=kind, input_norm=self.norm(p + "input_layernorm.weight", hidden),
            post_norm=self.norm(p + "post_attention_layernorm.weight", hidden),
            mixer=mixer, ffn=self.ffn(p))

    def mtp(self) -> tuple[MtpWeights | None, str]:
        declared = self.hybrid.mtp_num_hidden_layers
        if not self.src.has("mtp.fc.weight"):
            return None, MTP_MISSING.format(declared) if declared else MTP_NONE
        if self.hybrid.mtp_use_dedicated_embeddings:
            return None, MTP_DEDICATED
        hidden = self.cfg.hidden_size
        return MtpWeights(
            fc=self.base.linear("mtp.fc", hidden, 2 * hidden),
            pre_fc_norm_embedding=self.norm("mtp.pre_fc_norm_embedding.weight", hidden),
            pre_fc_norm_hidden=self.norm("mtp.pre_fc_norm_hidden.weight", hidden),
            norm=self.norm("mtp.norm.weight", hidden),
            layer=self.layer("mtp.layers.0.", FULL_ATTENTION)), MTP_OK

    def model(self) -> HybridWeights:
        cfg, p = self.cfg, self.prefix
        embed = self.base.linear(p + "embed_tokens", cfg.vocab_size, cfg.hidden_size)
        layers = [self.layer(f"{p}layers.{i}.", kind)
                  for i, kind in enumerate(self.hybrid.layer_types)]
        final_norm = self.norm(p + "norm.weight", cfg.hidden_size)
        lm_head = embed if cfg.tie_word_embeddings else self.base.linear(
            self._head_module(), cfg.vocab_size, cfg.hidden_size)
        mtp, status = self.mtp()
        self._check_all_used(mtp is not None)
        return HybridWeights(self.hybrid, embed, lm_head, final_norm, layers, mtp, mtp_status=status)

    def _head_module(self) -> str:
        for name in self.head_names:
            if self.src.has(name):
                return name.removesuffix(".weight")
        return self.head_names[0].removesuffix(".weight")  # the missing-tensor error names it

    def _check_all_used(self, mtp_loaded: bool) -> None:
        ignored = IGNORED_PREFIXES if not mtp_loaded else IGNORED_PREFIXES[:-1]
        unused = [name for name in self.src.owner if name not in self.src.used
                  and not name.startswith(ignored) and not name.endswith("rotary_emb.inv_freq")
                  and not (self.cfg.tie_word_embeddings and "lm_head." in name)]
        if unused:
            raise ModelFormatError(f"{self.src.file_of(unused[0])}: unexpected tensor(s) for "
                                   f"{self.cfg.arch}: {unused[:5]}"
                                   + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))


# ---------------------------------------------------------------------------------------
# folder


def load_qwen35_weights(folder: str | os.PathLike, progress: LoadProgress | None = None,
                        ) -> tuple[HybridConfig, HybridWeights, dict[str, object]]:
    """Config, weights and meta of a hybrid folder (everything but the tokenizer)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    raw = _read_json(config_path, required=True) or {}
    hybrid = hybrid_config_from_hf(raw, source=str(config_path))
    kv_config = replace(merge_generation_config(hybrid.kv_config, folder), name=folder.name)
    hybrid = replace(hybrid, kv_config=kv_config)
    quant = QuantSpec.from_config(raw, config_path)
    source = TensorSource.open(folder, progress)
    reader = HybridReader(source, quant, hybrid)
    weights = reader.model()
    meta: dict[str, object] = {
        "format": "mlx" if quant.enabled else "hf",
        "num_shards": len(source.files),
        "quantization": ({"bits": quant.bits, "group_size": quant.group_size}
                         if quant.enabled else None),
        "arch": kv_config.arch,
        "num_trunk_layers": hybrid.num_trunk_layers,
        "layer_types": list(hybrid.layer_types),
        "norms": "hf: 1 + w folded at load" if reader.fold_norms else "mlx: stored shifted",
        "mtp": weights.mtp_status,
        "mtp_num_hidden_layers": hybrid.mtp_num_hidden_layers,
    }
    return hybrid, weights, meta


def load_qwen35_folder(path: str | os.PathLike, progress: LoadProgress | None = None,
                       ) -> Checkpoint:
    """Load a Qwen3.5 / Qwen3.6 hybrid folder. `checkpoint.config` is the KV view
    (num_layers = full-attention layers); the trunk is described by `weights.hybrid`."""
    hybrid, weights, meta = load_qwen35_weights(path, progress)
    from .tokenizer import Tokenizer  # lazy, as in hf.py

    tokenizer = Tokenizer.from_hf_folder(Path(path))
    return Checkpoint(config=hybrid.kv_config, weights=weights,  # type: ignore[arg-type]
                      tokenizer=tokenizer, path=str(path), meta=meta)
