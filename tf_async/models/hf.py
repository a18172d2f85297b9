"""Hugging Face / MLX checkpoint folders -> Checkpoint.

A folder holds config.json, generation_config.json (optional), model.safetensors or shards
listed in model.safetensors.index.json, and the tokenizer files. MLX-quantized folders add a
`quantization` dict to config.json and store each quantized module `P` as `P.weight` (packed
uint32 codes, LSB first per row: the same packing as AffineWeight), `P.scales`, `P.biases`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..backend.weights import AffineWeight, DenseWeight, Linear
from ..errors import ModelFormatError
from .checkpoint import Checkpoint, LayerWeights, ModelWeights
from .config import ModelConfig, config_from_hf
from .progress import LoadProgress
from .safetensors_io import SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelFormatError(f"{path}: file not found (a model folder needs it)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot parse JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _id_list(value: Any, source: Path, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelFormatError(f"{source}: {key} must be an int or a list of ints, got {value!r}")
    return list(values)


def merge_generation_config(config: ModelConfig, folder: Path) -> ModelConfig:
    """Add generation_config.json's eos ids (after config.json's, no duplicates) and its
    bos id when config.json has none."""
    path = folder / "generation_config.json"
    gen = _read_json(path, required=False)
    if gen is None:
        return config
    eos = list(config.eos_token_ids)
    eos += [t for t in dict.fromkeys(_id_list(gen.get("eos_token_id"), path, "eos_token_id"))
            if t not in eos]
    bos = config.bos_token_id
    if bos is None:
        gen_bos = _id_list(gen.get("bos_token_id"), path, "bos_token_id")
        bos = gen_bos[0] if gen_bos else None
    return replace(config, eos_token_ids=tuple(eos), bos_token_id=bos)


class TensorSource:
    """Tensor name -> shard file over one folder; records which names were read."""

    def __init__(self, folder: Path, files: list[SafetensorsFile],
                 progress: LoadProgress | None = None):
        self.folder = folder
        self.files = files
        self.progress = progress
        self.owner: dict[str, SafetensorsFile] = {}
        self.used: set[str] = set()
        for st in files:
            for name in st.names():
                if name in self.owner:
                    raise ModelFormatError(f"{st.path}: tensor {name!r} also in {self.owner[name].path}")
                self.owner[name] = st

    @classmethod
    def open(cls, folder: Path, progress: LoadProgress | None = None) -> TensorSource:
        if (folder / INDEX_FILE).is_file():
            return cls(folder, _open_shards(folder), progress)
        if (folder / SINGLE_FILE).is_file():
            return cls(folder, [SafetensorsFile(folder / SINGLE_FILE)], progress)
        raise ModelFormatError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} in the model folder")

    def has(self, name: str) -> bool:
        return name in self.owner

    def file_of(self, name: str) -> Path:
        st = self.owner.get(name)
        if st is not None:
            return st.path
        return self.folder / (INDEX_FILE if len(self.files) > 1 else SINGLE_FILE)

    def get(self, name: str) -> tuple[np.ndarray, str]:
        """(array, safetensors dtype name) of a tensor that must exist."""
        st = self.owner.get(name)
        if st is None:
            raise ModelFormatError(f"{self.file_of(name)}: missing tensor {name!r}")
        self.used.add(name)
        if self.progress is not None:
            info = st.tensors[name]
            self.progress.advance(info.end - info.begin)
        return st.get(name), st.tensors[name].dtype


def _open_shards(folder: Path) -> list[SafetensorsFile]:
    index_path = folder / INDEX_FILE
    index = _read_json(index_path, required=True) or {}
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFormatError(f"{index_path}: missing or empty 'weight_map'")
    shards: dict[str, SafetensorsFile] = {}
    for name, shard in weight_map.items():
        if shard not in shards:
            if not isinstance(shard, str) or not (folder / shard).is_file():
                raise ModelFormatError(f"{index_path}: shard {shard!r} (holding tensor {name!r}) "
                                       f"is missing from {folder}")
            shards[shard] = SafetensorsFile(folder / shard)
        if name not in shards[shard]:
            raise ModelFormatError(f"{shards[shard].path}: missing tensor {name!r} (listed in {INDEX_FILE})")
    return list(shards.values())


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """MLX quantization from config.json: defaults plus per-module overrides."""

    bits: int = 0
    group_size: int = 0
    overrides: dict[str, Any] | None = None  # module path -> dict | bool
    source: str = "config.json"

    @classmethod
    def from_config(cls, raw: dict[str, Any], source: Path) -> QuantSpec:
        quant = raw.get("quantization")
        if quant is None:
            quant = raw.get("quantization_config")
            if isinstance(quant, dict) and "quant_method" in quant:
                raise ModelFormatError(f"{source}: unsupported quantization_config.quant_method "
                                       f"{quant['quant_method']!r} (only MLX affine quantization loads)")
        if quant is None:
            return cls(source=str(source))
        if not isinstance(quant, dict) or quant.get("mode", "affine") != "affine":
            raise ModelFormatError(f"{source}: unsupported MLX quantization {quant!r} (affine only)")
        overrides = {k: v for k, v in quant.items() if isinstance(v, dict | bool)}
        return cls(int(quant.get("bits", 4)), int(quant.get("group_size", 64)), overrides, str(source))

    @property
    def enabled(self) -> bool:
        return self.bits > 0

    def params_for(self, module: str, has_scales: bool) -> tuple[int, int] | None:
        """(bits, group_size) when `module` is quantized, else None (left in float)."""
        override = (self.overrides or {}).get(module)
        if override is False or (override is None and not has_scales):
            return None
        if not self.enabled:
            raise ModelFormatError(f"{self.source}: tensor {module + '.scales'!r} is present but "
                                   f"config.json has no 'quantization'")
        params = override if isinstance(override, dict) else {}
        bits = int(params.get("bits", self.bits))
        group_size = int(params.get("group_size", self.group_size))
        if bits not in QUANT_BITS or group_size not in QUANT_GROUP_SIZES:
            raise ModelFormatError(f"{self.source}: module {module!r}: unsupported quantization "
                                   f"bits={bits} group_size={group_size}; supported bits "
                                   f"{QUANT_BITS}, group sizes {QUANT_GROUP_SIZES}")
        return bits, group_size


def _stack(weights: list[Linear], what: str) -> Linear:
    """Per-expert Linears -> one Linear with a leading [E] axis."""
    if all(isinstance(w, DenseWeight) for w in weights):
        return DenseWeight(np.stack([w.w for w in weights]))  # type: ignore[union-attr]
    first = weights[0]
    if isinstance(first, AffineWeight) and all(
        isinstance(w, AffineWeight) and (w.bits, w.group_size) == (first.bits, first.group_size)
        for w in weights
    ):
        return AffineWeight(
            np.stack([w.codes for w in weights]),  # type: ignore[union-attr]
            np.stack([w.scales for w in weights]),  # type: ignore[union-attr]
            np.stack([w.biases for w in weights]),  # type: ignore[union-attr]
            first.bits, first.group_size,
        )
    raise ModelFormatError(f"{what}: experts are quantized differently from each other")


class WeightReader:
    """Reads tensors by HF/MLX name with dtype and shape checks against the config."""

    def __init__(self, source: TensorSource, config: ModelConfig, quant: QuantSpec):
        self.src = source
        self.cfg = config
        self.quant = quant

    def tensor(self, name: str, shape: tuple[int, ...], *, dtype: str = "float") -> np.ndarray:
        arr, stored = self.src.get(name)
        file = self.src.file_of(name)
        wanted = FLOAT_DTYPES if dtype == "float" else (dtype,)
        if stored not in wanted:
            what = "a float dtype (module not quantized)" if dtype == "float" else f"{dtype} (quantized codes)"
            raise ModelFormatError(f"{file}: tensor {name!r} has dtype {stored}, expected {what}; "
                                   f"check config.json 'quantization'")
        if tuple(arr.shape) != tuple(shape):
            raise ModelFormatError(f"{file}: tensor {name!r} has shape {list(arr.shape)}, "
                                   f"expected {list(shape)} from config.json")
        return arr.astype(np.float32, copy=False) if dtype == "float" else arr

    def optional(self, name: str, shape: tuple[int, ...], present: bool) -> np.ndarray | None:
        return self.tensor(name, shape) if present else None

    def linear(self, module: str, out_f: int, in_f: int, num_experts: int = 0) -> Linear:
        """A dense or MLX-quantized linear `module` with float shape [(E,) out_f, in_f]."""
        lead = (num_experts,) if num_experts else ()
        params = self.quant.params_for(module, self.src.has(module + ".scales"))
        if params is None:
            return DenseWeight(self.tensor(module + ".weight", (*lead, out_f, in_f)))
        bits, group_size = params
        if in_f % group_size:
            raise ModelFormatError(f"{self.src.file_of(module + '.weight')}: tensor "
                                   f"{module + '.weight'!r}: in-features {in_f} is not a multiple "
                                   f"of group_size {group_size}")
        groups = (*lead, out_f, in_f // group_size)
        return AffineWeight(
            self.tensor(module + ".weight", (*lead, out_f, in_f * bits // 32), dtype="U32"),
            self.tensor(module + ".scales", groups),
            self.tensor(module + ".biases", groups),
            bits, group_size,
        )

    def attention(self, prefix: str) -> dict[str, Any]:
        cfg = self.cfg
        H, qs, kvs, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
        p = prefix + "self_attn."
        return {
            "q": self.linear(p + "q_proj", qs, H),
            "k": self.linear(p + "k_proj", kvs, H),
            "v": self.linear(p + "v_proj", kvs, H),
            "o": self.linear(p + "o_proj", H, qs),
            "q_bias": self.optional(p + "q_proj.bias", (qs,), cfg.qkv_bias),
            "k_bias": self.optional(p + "k_proj.bias", (kvs,), cfg.qkv_bias),
            "v_bias": self.optional(p + "v_proj.bias", (kvs,), cfg.qkv_bias),
            "o_bias": self.optional(p + "o_proj.bias", (H,), cfg.o_bias),
            "q_norm": self.optional(p + "q_norm.weight", (hd,), cfg.qk_norm),
            "k_norm": self.optional(p + "k_norm.weight", (hd,), cfg.qk_norm),
        }

    def dense_mlp(self, prefix: str) -> dict[str, Any]:
        H, inter = self.cfg.hidden_size, self.cfg.intermediate_size
        p = prefix + "mlp."
        return {
            "gate": self.linear(p + "gate_proj", inter, H),
            "up": self.linear(p + "up_proj", inter, H),
            "down": self.linear(p + "down_proj", H, inter),
        }

    def moe(self, prefix: str) -> dict[str, Any]:
        H, E = self.cfg.hidden_size, self.cfg.num_experts
        p = prefix + "mlp."
        if self.src.has(p + "switch_mlp.gate_proj.weight"):
            experts = self._switch_experts(p + "switch_mlp.")
        elif self.src.has(p + "experts.gate_up_proj"):
            experts = self._fused_experts(p + "experts.")
        else:
            experts = self._per_expert(p + "experts.")
        return {"router": self.linear(p + "gate", E, H), **experts}

    def _switch_experts(self, p: str) -> dict[str, Linear]:
        H, E, Im = self.cfg.hidden_size, self.cfg.num_experts, self.cfg.moe_intermediate_size
        return {
            "experts_gate": self.linear(p + "gate_proj", Im, H, E),
            "experts_up": self.linear(p + "up_proj", Im, H, E),
            "experts_down": self.linear(p + "down_proj", H, Im, E),
        }

    def _fused_experts(self, p: str) -> dict[str, Linear]:
        # transformers-5 layout: gate_up_proj [E, 2*Im, H], gate rows first
        H, E, Im = self.cfg.hidden_size, self.cfg.num_experts, self.cfg.moe_intermediate_size
        gate_up = self.tensor(p + "gate_up_proj", (E, 2 * Im, H))
        return {
            "experts_gate": DenseWeight(np.ascontiguousarray(gate_up[:, :Im])),
            "experts_up": DenseWeight(np.ascontiguousarray(gate_up[:, Im:])),
            "experts_down": DenseWeight(self.tensor(p + "down_proj", (E, H, Im))),
        }

    def _per_expert(self, p: str) -> dict[str, Linear]:
        H, E, Im = self.cfg.hidden_size, self.cfg.num_experts, self.cfg.moe_intermediate_size
        shapes = {"gate_proj": (Im, H), "up_proj": (Im, H), "down_proj": (H, Im)}
        stacked = {
            proj: _stack([self.linear(f"{p}{e}.{proj}", *shape) for e in range(E)], p + proj)
            for proj, shape in shapes.items()
        }
        return {"experts_gate": stacked["gate_proj"], "experts_up": stacked["up_proj"],
                "experts_down": stacked["down_proj"]}

    def layer(self, layer: int) -> LayerWeights:
        prefix = f"model.layers.{layer}."
        H = self.cfg.hidden_size
        mlp = self.moe(prefix) if self.cfg.is_moe_layer(layer) else self.dense_mlp(prefix)
        return LayerWeights(
            input_norm=self.tensor(prefix + "input_layernorm.weight", (H,)),
            post_norm=self.tensor(prefix + "post_attention_layernorm.weight", (H,)),
            **self.attention(prefix),
            **mlp,
        )

    def model(self) -> ModelWeights:
        cfg = self.cfg
        embed = self.linear("model.embed_tokens", cfg.vocab_size, cfg.hidden_size)
        layers = [self.layer(i) for i in range(cfg.num_layers)]
        final_norm = self.tensor("model.norm.weight", (cfg.hidden_size,))
        # tied: the head IS the embedding; any lm_head.* on disk is ignored
        lm_head = embed if cfg.tie_word_embeddings else self.linear(
            "lm_head", cfg.vocab_size, cfg.hidden_size)
        self._check_all_used()
        return ModelWeights(embed=embed, lm_head=lm_head, final_norm=final_norm, layers=layers)

    def _check_all_used(self) -> None:
        ignored = ("rotary_emb.inv_freq",)
        unused = [
            name for name in self.src.owner
            if name not in self.src.used and not name.endswith(ignored)
            and not (self.cfg.tie_word_embeddings and name.startswith("lm_head."))
        ]
        if unused:
            # an unknown tensor means a variant we do not implement (e.g. mlp bias): refuse
            raise ModelFormatError(f"{self.src.file_of(unused[0])}: unexpected tensor(s) for "
                                   f"{self.cfg.arch}: {unused[:5]}"
                                   + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))


def load_hf_weights(folder: str | os.PathLike, progress: LoadProgress | None = None,
                    ) -> tuple[ModelConfig, ModelWeights, dict[str, object]]:
    """Config, weights and meta of an HF or MLX folder (everything but the tokenizer)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFormatError(f"{folder}: not a model folder")
    config_path = folder / "config.json"
    raw = _read_json(config_path, required=True) or {}
    config = config_from_hf(raw, source=str(config_path))
    config = replace(merge_generation_config(config, folder), name=folder.name)
    quant = QuantSpec.from_config(raw, config_path)
    source = TensorSource.open(folder, progress)
    weights = WeightReader(source, config, quant).model()
    meta: dict[str, object] = {
        "format": "mlx" if quant.enabled else "hf",
        "num_shards": len(source.files),
        "quantization": {"bits": quant.bits, "group_size": quant.group_size} if quant.enabled else None,
    }
    return config, weights, meta


def load_hf_folder(path: str | os.PathLike, progress: LoadProgress | None = None) -> Checkpoint:
    """Load a Hugging Face (float) or MLX (affine 4/8-bit) checkpoint folder.

    Raises ModelFormatError naming the file and tensor for anything missing or malformed.
    """
    config, weights, meta = load_hf_weights(path, progress)
    from .tokenizer import Tokenizer  # lazy: the tokenizer module is heavier and optional here

    tokenizer = Tokenizer.from_hf_folder(Path(path))
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, path=str(path), meta=meta)
