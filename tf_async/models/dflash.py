"""DFlash and DFlash2 block-diffusion drafters: config, weights and the check against the
target (docs/DFLASH.md).

A folder holds config.json (`architectures` = DFlashDraftModel | DFlash2DraftModel, the
drafter's Qwen3-style shapes, and `dflash_config`) and safetensors with the public names:
`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.N.{input_layernorm,
post_attention_layernorm}.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`,
`layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`; DFlash2
adds `layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}` and
`candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}`.
The drafter has no embedding and no LM head: it uses the target's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backend.weights import AffineWeight, DenseWeight, Linear
from ..errors import BadInputError, ModelFormatError
from .config import ModelConfig, _rope_from_hf, with_original_names
from .hf import FLOAT_DTYPES, QuantSpec, TensorSource

DFLASH_ARCHS = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}  # architecture -> generation


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    """The drafter's shapes and its dflash_config; per layer: attention window (None: full)
    and whether attention is causal (block positions see each other when not)."""

    generation: int  # 1 DFlash, 2 DFlash2
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # declared by DFlash2 configs; checked when present
    layer_windows: tuple[int | None, ...]
    layer_causal: tuple[bool, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0  # DFlash2: grouped dynamic convolution
    conv_group_size: int = 0
    selector_rank: int = 0  # DFlash2: candidate selector
    selector_top_k: int = 0

    @property
    def num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def rope_config(self) -> ModelConfig:
        """The fields rope_tables reads, as a ModelConfig."""
        return ModelConfig("qwen3", self.hidden_size, self.num_layers, self.num_heads,
                           self.num_kv_heads, self.head_dim, self.intermediate_size,
                           self.vocab_size, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling)


@dataclass(frozen=True, slots=True)
class DynamicConvWeights:
    """GroupedDynamicCausalConv: base_kernel [2, K, H] (0: before the sublayer, 1: after);
    kernel_projection [2 * K * G, H] (per row: (2, K, G) dynamic taps)."""

    base_kernel: np.ndarray
    kernel_projection: Linear


@dataclass(frozen=True, slots=True)
class DFlashLayerWeights:
    input_norm: np.ndarray  # [H]
    post_norm: np.ndarray  # [H]
    q: Linear  # [nh*hd, H]
    k: Linear  # [nkv*hd, H]
    v: Linear  # [nkv*hd, H]
    o: Linear  # [H, nh*hd]
    q_norm: np.ndarray  # [hd]
    k_norm: np.ndarray  # [hd]
    gate: Linear  # [I, H]
    up: Linear  # [I, H]
    down: Linear  # [H, I]
    attention_conv: DynamicConvWeights | None = None  # DFlash2
    mlp_conv: DynamicConvWeights | None = None


@dataclass(frozen=True, slots=True)
class SelectorWeights:
    """DFlash2's candidate selector: hidden_projection [r, H], codebooks [V, r]."""

    hidden_projection: Linear
    predecessor_codebook: np.ndarray
    successor_codebook: np.ndarray


@dataclass(frozen=True, slots=True)
class DFlashWeights:
    fc: Linear  # [H, len(target_layer_ids) * H]
    hidden_norm: np.ndarray  # [H]
    norm: np.ndarray  # [H]
    layers: tuple[DFlashLayerWeights, ...]
    selector: SelectorWeights | None  # DFlash2


@dataclass(frozen=True, slots=True)
class DFlashCheckpoint:
    config: DFlashConfig
    weights: DFlashWeights
    path: str


def is_dflash_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder whose config.json names a DFlash architecture."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    archs = json.loads(config_path.read_text()).get("architectures") or []
    return any(arch in DFLASH_ARCHS for arch in archs)


def load_dflash(path: str | os.PathLike) -> DFlashCheckpoint:
    """A DFlash / DFlash2 folder -> DFlashCheckpoint (float weights as float32);
    ModelFormatError naming the file and tensor on anything malformed."""
    folder = Path(path).expanduser()
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{folder}: no config.json in the DFlash drafter folder")
    raw = json.loads(config_path.read_text())
    config = dflash_config_from_hf(raw, source=str(config_path))
    reader = _Reader(TensorSource.open(folder), QuantSpec.from_config(raw, config_path))
    return DFlashCheckpoint(config, reader.weights(config), str(folder))


def _draft_value(cfg: dict[str, Any], name: str, default: Any = None) -> Any:
    """dflash_config's value, else the top level's (as the public loader reads them)."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name, default))


def _generation(cfg: dict[str, Any], source: str) -> int:
    archs = [a for a in cfg.get("architectures") or [] if a in DFLASH_ARCHS]
    if not archs:
        raise ModelFormatError(f"{source}: architectures {cfg.get('architectures')!r} names no "
                               f"DFlash drafter; expected one of {sorted(DFLASH_ARCHS)}")
    return DFLASH_ARCHS[archs[0]]


def _layer_attention(cfg: dict[str, Any], num_layers: int) -> tuple[tuple[int | None, ...],
                                                                     tuple[bool, ...]]:
    """Per layer (window, causal): a sliding layer has `sliding_window`; `is_causal` when set
    decides for every layer, else sliding layers are causal and full ones are not."""
    types = cfg.get("layer_types") or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"'layer_types' has {len(types)} entries for {num_layers} layers")
    is_causal = cfg.get("is_causal")
    windows = tuple(int(cfg["sliding_window"]) if t == "sliding_attention" else None for t in types)
    causal = tuple(t == "sliding_attention" if is_causal is None else bool(is_causal) for t in types)
    return windows, causal


def dflash_config_from_hf(cfg: dict[str, Any], *, source: str = "config.json") -> DFlashConfig:
    generation = _generation(cfg, source)
    cfg = with_original_names(cfg)
    try:
        return _parse_config(cfg, generation)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelFormatError):
            raise
        raise ModelFormatError(f"{source}: missing or invalid key {exc}") from exc


def _parse_config(cfg: dict[str, Any], generation: int) -> DFlashConfig:
    hidden, heads, num_layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    theta, scaling = _rope_from_hf(cfg)
    layer_ids = _draft_value(cfg, "target_layer_ids")
    mask_id = _draft_value(cfg, "mask_token_id")
    if layer_ids is None or mask_id is None:
        raise KeyError("dflash_config.target_layer_ids and dflash_config.mask_token_id")
    if cfg.get("attention_bias"):
        raise ValueError("'attention_bias' true: DFlash drafters with biases are not supported")
    windows, causal = _layer_attention(cfg, num_layers)
    softcap = _draft_value(cfg, "final_logit_softcapping")
    num_target = cfg.get("num_target_layers")
    v2 = generation == 2
    return DFlashConfig(
        generation, hidden, num_layers, heads, int(cfg.get("num_key_value_heads") or heads),
        int(cfg.get("head_dim") or hidden // heads), int(cfg["intermediate_size"]),
        int(cfg["vocab_size"]), float(cfg.get("rms_norm_eps", 1e-6)), theta, scaling,
        block_size=int(_draft_value(cfg, "block_size", 16)), mask_token_id=int(mask_id),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        num_target_layers=None if num_target is None else int(num_target),
        layer_windows=windows, layer_causal=causal,
        input_embedding_scale=float(_draft_value(cfg, "input_embedding_scale", 1.0)),
        output_multiplier=float(_draft_value(cfg, "output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        conv_kernel_size=int(_draft_value(cfg, "conv_kernel_size")) if v2 else 0,
        conv_group_size=int(_draft_value(cfg, "conv_group_size")) if v2 else 0,
        selector_rank=int(_draft_value(cfg, "selector_rank")) if v2 else 0,
        selector_top_k=int(_draft_value(cfg, "selector_top_k")) if v2 else 0)


class _Reader:
    """Tensors by public name, shapes checked against the config; MLX-quantized modules (the
    `quantization` entry, `P.weight` codes + `P.scales` + `P.biases`) as affine weights."""

    def __init__(self, source: TensorSource, quant: QuantSpec):
        self.src = source
        self.quant = quant

    def tensor(self, name: str, shape: tuple[int, ...], *, dtype: str = "float") -> np.ndarray:
        arr, stored = self.src.get(name)
        file = self.src.file_of(name)
        if stored not in (FLOAT_DTYPES if dtype == "float" else (dtype,)):
            what = "a float dtype" if dtype == "float" else f"{dtype} (quantized codes)"
            raise ModelFormatError(f"{file}: tensor {name!r} has dtype {stored}, expected {what}; "
                                   "check config.json 'quantization'")
        if tuple(arr.shape) != shape:
            raise ModelFormatError(f"{file}: tensor {name!r} has shape {list(arr.shape)}, "
                                   f"expected {list(shape)} from config.json")
        return np.ascontiguousarray(arr, dtype=np.float32 if dtype == "float" else arr.dtype)

    def linear(self, module: str, out_f: int, in_f: int) -> Linear:
        params = self.quant.params_for(module, self.src.has(module + ".scales"))
        if params is None:
            return DenseWeight(self.tensor(module + ".weight", (out_f, in_f)))
        bits, group_size = params
        if in_f % group_size:
            raise ModelFormatError(f"{self.src.file_of(module + '.weight')}: {module!r}: "
                                   f"in-features {in_f} not a multiple of group_size {group_size}")
        groups = (out_f, in_f // group_size)
        return AffineWeight(self.tensor(module + ".weight", (out_f, in_f * bits // 32), dtype="U32"),
                            self.tensor(module + ".scales", groups),
                            self.tensor(module + ".biases", groups), bits, group_size)

    def codebook(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """Stored without '.weight' in the public checkpoints; accept both, and an MLX-quantized
        one (an Embedding under nn.quantize), dequantized: the selector gathers rows on the host."""
        if self.src.has(name):
            return self.tensor(name, shape)
        if not self.src.has(name + ".scales"):
            return self.tensor(name + ".weight", shape)
        weight = self.linear(name, *shape)
        return weight.dequantize() if isinstance(weight, AffineWeight) else weight.w

    def conv(self, prefix: str, cfg: DFlashConfig) -> DynamicConvWeights:
        k, h = cfg.conv_kernel_size, cfg.hidden_size
        return DynamicConvWeights(self.tensor(prefix + ".base_kernel", (2, k, h)),
                                  self.linear(prefix + ".kernel_projection", 2 * k * cfg.num_groups, h))

    def layer(self, i: int, cfg: DFlashConfig) -> DFlashLayerWeights:
        p, h, hd = f"layers.{i}.", cfg.hidden_size, cfg.head_dim
        qs, kvs, inter = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
        v2 = cfg.generation == 2
        return DFlashLayerWeights(
            self.tensor(p + "input_layernorm.weight", (h,)),
            self.tensor(p + "post_attention_layernorm.weight", (h,)),
            self.linear(p + "self_attn.q_proj", qs, h), self.linear(p + "self_attn.k_proj", kvs, h),
            self.linear(p + "self_attn.v_proj", kvs, h), self.linear(p + "self_attn.o_proj", h, qs),
            self.tensor(p + "self_attn.q_norm.weight", (hd,)),
            self.tensor(p + "self_attn.k_norm.weight", (hd,)),
            self.linear(p + "mlp.gate_proj", inter, h), self.linear(p + "mlp.up_proj", inter, h),
            self.linear(p + "mlp.down_proj", h, inter),
            self.conv(p + "attention_conv", cfg) if v2 else None,
            self.conv(p + "mlp_conv", cfg) if v2 else None)

    def selector(self, cfg: DFlashConfig) -> SelectorWeights:
        p, shape = "candidate_selector.", (cfg.vocab_size, cfg.selector_rank)
        return SelectorWeights(self.linear(p + "hidden_projection", cfg.selector_rank, cfg.hidden_size),
                               self.codebook(p + "predecessor_codebook", shape),
                               self.codebook(p + "successor_codebook", shape))

    def weights(self, cfg: DFlashConfig) -> DFlashWeights:
        _check_groups(cfg)
        h = cfg.hidden_size
        return DFlashWeights(self.linear("fc", h, len(cfg.target_layer_ids) * h),
                             self.tensor("hidden_norm.weight", (h,)), self.tensor("norm.weight", (h,)),
                             tuple(self.layer(i, cfg) for i in range(cfg.num_layers)),
                             self.selector(cfg) if cfg.generation == 2 else None)


def _check_groups(cfg: DFlashConfig) -> None:
    if cfg.generation == 2 and (cfg.conv_group_size <= 0 or cfg.hidden_size % cfg.conv_group_size):
        raise ModelFormatError(f"DFlash2 config: conv_group_size {cfg.conv_group_size} does not "
                               f"divide hidden_size {cfg.hidden_size}")


def check_against_target(cfg: DFlashConfig, target: ModelConfig, num_target_layers: int | None = None,
                         *, where: str = "drafter") -> None:
    """BadInputError naming every mismatch between the drafter and the target it drafts for:
    vocabulary, hidden size, target layers (num_target_layers: the trunk's layers, default
    target.num_layers; a hybrid's config counts only its attention layers), the mask token."""
    num_layers = target.num_layers if num_target_layers is None else num_target_layers
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != the target's {target.vocab_size}")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != the target's {target.hidden_size}")
    outside = [i for i in cfg.target_layer_ids if not 0 <= i < num_layers]
    if outside or not cfg.target_layer_ids:
        problems.append(f"target_layer_ids {list(cfg.target_layer_ids)} not within the target's "
                        f"{num_layers} layers")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_layers:
        problems.append(f"num_target_layers {cfg.num_target_layers} != the target's {num_layers}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the vocabulary")
    if problems:
        raise BadInputError(f"--drafter dflash: the DFlash{'' if cfg.generation == 1 else '2'} "
                            f"{where} does not fit model {target.name!r}: " + "; ".join(problems),
                            param="drafter")
