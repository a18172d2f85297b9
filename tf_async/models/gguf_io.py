"""GGUF v3 loader (FORMATS.md §4-8): metadata -> ModelConfig, tensors -> ModelWeights.

Tensors are memory-mapped; F32 tensors are used in place, quantized ones are repacked into
AffineWeight (models/ggml_quants.py). llama-arch files have their Q/K rows permuted by
llama.cpp's converter; we undo that here so the decoder sees HF row order for every format.
The qwen35 / qwen35moe hybrids are read by models/gguf_qwen35.py (models/gguf_load.py dispatches).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from ..backend.weights import AffineWeight, DenseWeight, Linear
from ..errors import ModelFormatError
from .checkpoint import Checkpoint, LayerWeights, ModelWeights
from .config import ROPE_TYPES, ModelConfig
from .ggml_quants import float_array, to_linear
from .progress import LoadProgress

_GGUF_MAGIC = b"GGUF"


class _FastReader(GGUFReader):
    """GGUFReader that parses flat metadata arrays in one pass.

    The base class builds two NumPy views per array element (about 3 s for a 49k-token
    vocabulary); here a string array is one memoryview slice per string and a numeric array
    one view, laid out so that `ReaderField.contents()` still works unchanged.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._buf

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # Slicing np.memmap is slow (__array_finalize__); a plain view keeps the map alive.
        self._buf = value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
        if item_type == GGUFValueType.STRING:
            return self._string_array_parts(orig_offs)
        np_type = self.gguf_scalar_to_np.get(item_type)
        if np_type is None:  # nested arrays: rare, leave them to the base class
            return super()._get_field_parts(orig_offs, raw_type)
        count = int(self._get(orig_offs + 4, np.uint64)[0])
        values = self._get(orig_offs + 12, np_type, count)
        if len(values) != count:
            raise ValueError(f"metadata array at byte {orig_offs} runs past the end of the file")
        head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        return 12 + int(values.nbytes), [*head, values], [2], [GGUFValueType.ARRAY, item_type]

    def _string_array_parts(self, orig_offs: int) -> tuple[int, list, list[int], list]:
        count = int(self._get(orig_offs + 4, np.uint64)[0])
        buf = self._buf.data  # memoryview of the whole file
        parts: list[Any] = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        offs = orig_offs + 12
        if count * 8 > len(buf) - offs:  # every string needs its 8-byte length
            raise ValueError(f"string array at byte {orig_offs} claims {count} strings")
        for _ in range(count):
            length = int.from_bytes(buf[offs : offs + 8], "little")
            parts.append(buf[offs + 8 : offs + 8 + length])  # has .tobytes(), as contents() needs
            offs += 8 + length
        if offs > len(buf):
            raise ValueError(f"string array at byte {orig_offs} runs past the end of the file")
        types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
        return offs - orig_offs, parts, list(range(2, 2 + count)), types


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Open (memory-map) a GGUF file; any malformation is a ModelFormatError naming the path."""
    file_path = Path(path)
    if not file_path.is_file():
        raise ModelFormatError(f"{file_path}: GGUF file does not exist")
    with open(file_path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelFormatError(f"{file_path}: not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    try:
        reader = _FastReader(file_path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as exc:
        raise ModelFormatError(f"{file_path}: truncated or corrupt GGUF file ({exc})") from exc
    if reader.byte_order != "I":
        raise ModelFormatError(f"{file_path}: big-endian GGUF files are not supported")
    _check_tensor_extents(reader, file_path)
    return reader


def _check_tensor_extents(reader: GGUFReader, path: Path) -> None:
    size = len(reader.data)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelFormatError(f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes "
                                   f"[{t.data_offset}, {t.data_offset + t.n_bytes}) of {size}")


def reader_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/values of an open reader as plain Python values (str, int, float, bool, lists)."""
    out: dict[str, Any] = {}
    for key, meta_field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-keys (version, counts)
            continue
        value = meta_field.contents()
        if meta_field.types == [GGUFValueType.FLOAT32]:  # shortest spelling: 1e-05, not 9.99999974e-06
            value = float(str(np.float32(value)))
        out[key] = value
    return out


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a GGUF file as a plain dict (tokenizer arrays included)."""
    try:
        return reader_metadata(open_gguf(path))
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{path}: GGUF metadata string is not UTF-8 ({exc})") from exc


# general.architecture -> our arch name
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
# llama.cpp's Qwen3.5 / Qwen3.5-MoE hybrids (models/gguf_qwen35.py)
HYBRID_GGUF_ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
# rope.scaling.* key -> HF rope_scaling key (yarn_ext_factor/yarn_log_multiplier have no HF twin)
_ROPE_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
              "attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast",
              "yarn_beta_slow": "beta_slow"}


@dataclass(frozen=True, slots=True)
class GgufKeys:
    """Typed access to `{arch}.*` metadata keys with errors that name the file and key."""

    meta: dict[str, Any]
    arch: str
    source: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, list):  # per-layer arrays (head_count_kv): uniform only
            if len(set(value)) != 1:
                raise ModelFormatError(f"{self.source}: per-layer {self.arch}.{key}={value} "
                                       "is not supported")
            value = value[0]
        if value is None:
            raise ModelFormatError(f"{self.source}: missing GGUF metadata key '{self.arch}.{key}'")
        return int(value)


def rope_scaling_of(keys: GgufKeys) -> dict[str, Any] | None:
    rtype = keys.get("rope.scaling.type", "none")
    if rtype in ("none", "", None):
        return None
    if rtype not in ROPE_TYPES:
        raise ModelFormatError(f"{keys.source}: unsupported rope scaling type {rtype!r}")
    scaling: dict[str, Any] = {"rope_type": rtype}
    for gguf_key, hf_key in _ROPE_KEYS.items():
        value = keys.get(f"rope.scaling.{gguf_key}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def special_ids(meta: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return bos, tuple(dict.fromkeys(int(t) for t in eos if t is not None))


def vocab_size_of(meta: dict[str, Any], keys: GgufKeys, shapes: dict[str, tuple[int, ...]]) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    if keys.get("vocab_size") is not None:
        return keys.integer("vocab_size")
    return shapes.get("token_embd.weight", (0,))[0]


def _moe_fields(keys: GgufKeys, arch: str, shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict[str, Any]:
    if arch != "qwen3_moe":
        return {}
    # llama.cpp's qwen3moe graph always renormalises the top-k weights (build_moe_ffn norm_w=true)
    # and every released Qwen3-MoE sets norm_topk_prob; converters need not write the key.
    return {
        "num_experts": keys.integer("expert_count"),
        "num_experts_per_tok": keys.integer("expert_used_count"),
        "moe_intermediate_size": keys.integer("expert_feed_forward_length"),
        "norm_topk_prob": bool(keys.get("expert_weights_norm", True)),
        "mlp_only_layers": tuple(layer for layer in range(num_layers)
                                 if f"blk.{layer}.ffn_gate_inp.weight" not in shapes),
    }


def config_from_gguf(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], *,
                     source: str = "gguf") -> ModelConfig:
    """ModelConfig from GGUF metadata (FORMATS.md §5) and the file's tensor shapes by name."""
    gguf_arch = meta.get("general.architecture")
    arch = GGUF_ARCHS.get(gguf_arch)  # type: ignore[arg-type]
    if arch is None:
        raise ModelFormatError(f"{source}: unknown architecture general.architecture={gguf_arch!r}; "
                               f"supported: {sorted(GGUF_ARCHS) + sorted(HYBRID_GGUF_ARCHS)}")
    keys = GgufKeys(meta, str(gguf_arch), source)
    hidden, heads = keys.integer("embedding_length"), keys.integer("attention.head_count")
    if hidden <= 0 or heads <= 0:
        raise ModelFormatError(f"{source}: bad embedding_length={hidden} / head_count={heads}")
    head_dim = keys.integer("attention.key_length", hidden // heads)
    rotary = keys.integer("rope.dimension_count", head_dim)
    num_layers = keys.integer("block_count")
    bos, eos = special_ids(meta)
    return ModelConfig(
        arch=arch, hidden_size=hidden, num_layers=num_layers, num_heads=heads,
        num_kv_heads=keys.integer("attention.head_count_kv", heads), head_dim=head_dim,
        intermediate_size=keys.integer("feed_forward_length", 0),
        vocab_size=vocab_size_of(meta, keys, shapes),
        rms_norm_eps=float(keys.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(keys.get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling_of(keys),
        rotary_dim=0 if rotary == head_dim else rotary,
        max_position_embeddings=keys.integer("context_length", 4096),
        tie_word_embeddings="output.weight" not in shapes,
        qkv_bias="blk.0.attn_q.bias" in shapes,
        o_bias="blk.0.attn_output.bias" in shapes,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        **_moe_fields(keys, arch, shapes, num_layers),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        name=str(meta.get("general.name") or Path(source).stem),
        extra={"gguf_architecture": gguf_arch},
    )


def unpermute_rows(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (FORMATS.md §8) on axis 0 of `x` ([out, ...]).

    GGUF row 2i (2i+1) of a head holds HF row i (i + head_dim/2)."""
    head_dim = x.shape[0] // num_heads
    order = np.arange(x.shape[0]).reshape(num_heads, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
    return x[order]


def _unpermute_linear(w: Linear, num_heads: int) -> Linear:
    if isinstance(w, DenseWeight):
        return DenseWeight(unpermute_rows(w.w, num_heads))
    return AffineWeight(unpermute_rows(w.codes, num_heads), unpermute_rows(w.scales, num_heads),
                        unpermute_rows(w.biases, num_heads), w.bits, w.group_size)


@dataclass(slots=True)
class TensorTable:
    """The file's tensors by name, converted on demand with shape checks against the config."""

    tensors: dict[str, ReaderTensor]
    source: str
    progress: LoadProgress | None = None
    used: set[str] = field(default_factory=set)  # names read so far (unexpected-tensor checks)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """NumPy shape (reversed GGUF dims) of a tensor; a missing one is a ModelFormatError."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.source}: missing tensor {name!r}")
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    def _get(self, name: str, shape: tuple[int, ...]) -> ReaderTensor:
        got = self.shape(name)
        t = self.tensors[name]
        self.used.add(name)
        if got != shape:
            raise ModelFormatError(f"{self.source}: tensor {name!r} has shape {list(got)}, "
                                   f"expected {list(shape)} from the GGUF metadata")
        if self.progress is not None:
            self.progress.advance(int(t.n_bytes))
        return t

    def linear(self, name: str, shape: tuple[int, ...]) -> Linear:
        t = self._get(name, shape)
        return to_linear(t.data, t.tensor_type, name=name, source=self.source)

    def vector(self, name: str, size: int) -> np.ndarray:
        return self.floats(name, (size,))

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float (F32/F16/BF16) tensor of this NumPy shape as float32."""
        t = self._get(name, shape)
        return float_array(t.data, t.tensor_type, name=name, source=self.source).reshape(shape)

    def optional_vector(self, name: str, size: int) -> np.ndarray | None:
        return self.vector(name, size) if name in self.tensors else None


def _attention(table: TensorTable, cfg: ModelConfig, p: str, permuted: bool) -> dict[str, Any]:
    H, hd = cfg.hidden_size, cfg.head_dim
    out: dict[str, Any] = {
        "q": table.linear(p + "attn_q.weight", (cfg.q_size, H)),
        "k": table.linear(p + "attn_k.weight", (cfg.kv_size, H)),
        "v": table.linear(p + "attn_v.weight", (cfg.kv_size, H)),
        "o": table.linear(p + "attn_output.weight", (H, cfg.q_size)),
        "q_bias": table.optional_vector(p + "attn_q.bias", cfg.q_size),
        "k_bias": table.optional_vector(p + "attn_k.bias", cfg.kv_size),
        "v_bias": table.optional_vector(p + "attn_v.bias", cfg.kv_size),
        "o_bias": table.optional_vector(p + "attn_output.bias", H),
    }
    if cfg.qk_norm:
        out["q_norm"] = table.vector(p + "attn_q_norm.weight", hd)
        out["k_norm"] = table.vector(p + "attn_k_norm.weight", hd)
    if permuted:
        for key, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
            out[key] = _unpermute_linear(out[key], heads)
            if out[key + "_bias"] is not None:
                out[key + "_bias"] = unpermute_rows(out[key + "_bias"], heads)
    return out


def _mlp(table: TensorTable, cfg: ModelConfig, layer: int, p: str) -> dict[str, Any]:
    H = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        I = cfg.intermediate_size  # noqa: E741 (the spec's name)
        return {"gate": table.linear(p + "ffn_gate.weight", (I, H)),
                "up": table.linear(p + "ffn_up.weight", (I, H)),
                "down": table.linear(p + "ffn_down.weight", (H, I))}
    E, Im = cfg.num_experts, cfg.moe_intermediate_size
    return {"router": table.linear(p + "ffn_gate_inp.weight", (E, H)),
            "experts_gate": table.linear(p + "ffn_gate_exps.weight", (E, Im, H)),
            "experts_up": table.linear(p + "ffn_up_exps.weight", (E, Im, H)),
            "experts_down": table.linear(p + "ffn_down_exps.weight", (E, H, Im))}


def _layer(table: TensorTable, cfg: ModelConfig, layer: int, permuted: bool) -> LayerWeights:
    p = f"blk.{layer}."
    return LayerWeights(
        input_norm=table.vector(p + "attn_norm.weight", cfg.hidden_size),
        post_norm=table.vector(p + "ffn_norm.weight", cfg.hidden_size),
        **_attention(table, cfg, p, permuted),
        **_mlp(table, cfg, layer, p),
    )


def _model(table: TensorTable, cfg: ModelConfig, permuted: bool) -> ModelWeights:
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = table.linear("token_embd.weight", (V, H))
    lm_head = embed if cfg.tie_word_embeddings else table.linear("output.weight", (V, H))
    rot = cfg.rotary_dim or cfg.head_dim
    return ModelWeights(
        embed=embed,
        lm_head=lm_head,
        final_norm=table.vector("output_norm.weight", H),
        layers=[_layer(table, cfg, layer, permuted) for layer in range(cfg.num_layers)],
        rope_freq_divisors=table.optional_vector("rope_freqs.weight", rot // 2),
    )


def open_gguf_with_metadata(path: str | os.PathLike) -> tuple[GGUFReader, dict[str, Any]]:
    """The open reader and its metadata dict; bad files are ModelFormatErrors."""
    reader = open_gguf(path)
    try:
        return reader, reader_metadata(reader)
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{path}: GGUF metadata string is not UTF-8 ({exc})") from exc


def gguf_info(reader: GGUFReader, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": "gguf",
        "gguf_architecture": meta.get("general.architecture"),
        "file_type": meta.get("general.file_type"),
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "metadata": meta,
    }


def load_gguf_weights(path: str | os.PathLike, progress: LoadProgress | None = None,
                      ) -> tuple[ModelConfig, ModelWeights, dict[str, Any]]:
    """Config, weights and info of a dense GGUF file (everything but the tokenizer).

    info: {"format": "gguf", "gguf_architecture", "file_type", "tensor_types": {type: count},
    "metadata": the full metadata dict (as `gguf_metadata`)}."""
    reader, meta = open_gguf_with_metadata(path)
    return _dense_weights(reader, meta, str(path), progress)


def _dense_weights(reader: GGUFReader, meta: dict[str, Any], source: str,
                   progress: LoadProgress | None) -> tuple[ModelConfig, ModelWeights, dict[str, Any]]:
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}
    config = config_from_gguf(meta, shapes, source=source)
    permuted = meta.get("general.architecture") == "llama"
    weights = _model(TensorTable(tensors, source, progress), config, permuted)
    return config, weights, gguf_info(reader, meta)


def load_dense_gguf(reader: GGUFReader, metadata: dict[str, Any], source: str,
                    progress: LoadProgress | None = None) -> Checkpoint:
    """The checkpoint of an opened GGUF of a plain transformer (llama, qwen2, qwen3, qwen3moe)
    with its tokenizer (models/gguf_load.py picks the loader by architecture)."""
    from .tokenizer import Tokenizer  # lazy: heavier module, not needed for weights

    config, weights, info = _dense_weights(reader, metadata, source, progress)
    tokenizer = Tokenizer.from_gguf_metadata(metadata, source=source)
    meta = {key: value for key, value in info.items() if key != "metadata"}
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, path=source, meta=meta)
