"""ModelConfig: the one description of a decoder (llama, qwen2, qwen3, qwen3_moe).

Loaders build it from config.json or GGUF metadata; the decoder reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelFormatError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys transformers 5 saves under another name (its configuration classes' `attribute_map`,
# e.g. Qwen3MoeConfig stores num_experts as num_local_experts): original -> v5 name.
TRANSFORMERS5_NAMES = {"num_experts": "num_local_experts"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHS
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": ..., "factor": ..., ...}
    rotary_dim: int = 0  # 0 = head_dim
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def with_original_names(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with keys saved under transformers 5 names also under the original names."""
    renamed = {old: cfg[new] for old, new in TRANSFORMERS5_NAMES.items()
               if old not in cfg and new in cfg}
    return {**cfg, **renamed} if renamed else cfg


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's `rope_parameters`; keyed by layer type when layers differ (the
    full-attention layers' entry is the one the KV layers use)."""
    params = cfg.get("rope_parameters") or {}
    nested = params.get("full_attention") if isinstance(params, dict) else None
    return dict(nested) if isinstance(nested, dict) else dict(params)


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = rope_parameters(cfg)
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params else None)
    if scaling:
        scaling = dict(scaling)
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = rtype
        if rtype not in ROPE_TYPES:
            raise ModelFormatError(f"config.json: unsupported rope scaling type {rtype!r}; supported: {ROPE_TYPES}")
        if rtype == "default":
            scaling = None
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(cfg: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    cfg = with_original_names(cfg)
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(f"{source}: unknown architecture model_type={arch!r}; supported: {SUPPORTED_ARCHS}")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope_from_hf(cfg)
        return ModelConfig(
            arch=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=int(cfg.get("num_experts", 0)) if arch == "qwen3_moe" else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(x) for x in cfg.get("mlp_only_layers", []) or []),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelFormatError):
            raise
        raise ModelFormatError(f"{source}: missing or invalid key {exc}") from exc
