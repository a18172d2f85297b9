"""Writers of tiny Hugging Face and MLX checkpoint folders for tests.

`write_hf` stores float weights (f32/f16/bf16, optionally sharded, per-expert or fused MoE
layout); `write_mlx` stores MLX affine-quantized weights (experts stacked as `switch_mlp`).
Both start from tests/tiny.py's config dict and HF-named float32 weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from tf_async.backend.weights import quantize_affine

_ST_DTYPES = {"float32": "F32", "float16": "F16", "uint32": "U32", "int32": "I32",
              "float64": "F64", "uint8": "U8", "int8": "I8"}
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits as uint16, rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values after a round trip through bfloat16."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def stored_value(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a float32 array reads back as after storing it as f32/f16/bf16."""
    if dtype == "bf16":
        return bf16_round(x)
    return np.asarray(x, np.float32).astype({"f32": np.float32, "f16": np.float16}[dtype]).astype(np.float32)


def _entry(arr: np.ndarray, dtype: str | None) -> tuple[str, bytes, list[int]]:
    """(safetensors dtype, raw bytes, shape); float32 arrays are stored as `dtype` if given."""
    arr = np.ascontiguousarray(arr)
    if dtype == "bf16" and arr.dtype == np.float32:
        return "BF16", bf16_bits(arr).astype("<u2").tobytes(), list(arr.shape)
    if dtype == "f16" and arr.dtype == np.float32:
        arr = arr.astype(np.float16)
    return _ST_DTYPES[arr.dtype.name], arr.astype(arr.dtype.newbyteorder("<")).tobytes(), list(arr.shape)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], *, dtype: str | None = None,
                      align: bool = True, metadata: dict[str, str] | None = None) -> Path:
    """Minimal safetensors writer. `align=True` pads the header to 8 bytes and orders tensors
    so each starts at a multiple of its item size; `align=False` leaves the header unpadded
    (as MLX does), so multi-byte tensors may start at odd file offsets."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    chunks: list[bytes] = []
    offset = 0
    # aligned files order tensors by descending item size (as the reference writer does)
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n)) if align else sorted(tensors)
    for name in order:
        st_dtype, raw, shape = _entry(tensors[name], dtype)
        header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    if align:
        head += b" " * (-(8 + len(head)) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(chunks))
    return path


def _write_tokenizer(folder: Path) -> None:
    try:
        from tests.tiny_tokenizer import write_tiny_tokenizer
    except ModuleNotFoundError as exc:  # the tokenizer writer may not exist yet
        if exc.name != "tests.tiny_tokenizer":
            raise
        return
    write_tiny_tokenizer(folder)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))


def _write_shards(folder: Path, tensors: dict[str, np.ndarray], num_shards: int, **kw: Any) -> None:
    if num_shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, **kw)
        return
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        write_safetensors(folder / file, part, **kw)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(int(t.nbytes) for t in tensors.values())
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert HF names -> {"<layer>.mlp.<proj>": [E, out, in]} (other names dropped)."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        m = _EXPERT_RE.match(name)
        if m:
            groups.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = w
    return {key: np.stack([per[e] for e in range(len(per))]) for key, per in groups.items()}


def _relayout_experts(weights: dict[str, np.ndarray], layout: str) -> dict[str, np.ndarray]:
    """Per-expert names -> 'fused' (transformers-5) or 'switch' (MLX) names."""
    if layout == "per_expert":
        return dict(weights)
    out = {n: w for n, w in weights.items() if not _EXPERT_RE.match(n)}
    stacked = stack_experts(weights)
    for key, arr in stacked.items():
        prefix, proj = key.rsplit(".", 1)
        if layout == "switch":
            out[f"{prefix}.switch_mlp.{proj}.weight"] = arr
        elif proj == "gate_proj":  # fused: gate rows first, then up
            out[f"{prefix}.experts.gate_up_proj"] = np.concatenate([arr, stacked[prefix + ".up_proj"]], axis=1)
        elif proj == "down_proj":
            out[f"{prefix}.experts.down_proj"] = arr
    return out


def write_hf(folder: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], *,
             dtype: str = "f32", num_shards: int = 1, expert_layout: str = "per_expert") -> Path:
    """Write a float HF folder (config, generation_config with eos [2], safetensors,
    tokenizer) and return it. `expert_layout`: "per_expert" or "fused"."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]
    _write_json(folder / "config.json", {**cfg, "torch_dtype": torch_dtype})
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2]})
    _write_shards(folder, _relayout_experts(weights, expert_layout), num_shards, dtype=dtype)
    _write_tokenizer(folder)
    return folder


def _module_params(module: str, in_f: int, bits: int, group_size: int,
                   overrides: dict[str, Any]) -> tuple[int, int] | None:
    """(bits, group_size) if the writer quantizes `module`, else None (MLX's rule)."""
    override = overrides.get(module)
    if override is False:
        return None
    if isinstance(override, dict):
        return int(override.get("bits", bits)), int(override.get("group_size", group_size))
    return (bits, group_size) if in_f % group_size == 0 else None


def mlx_tensors(cfg: dict[str, Any], weights: dict[str, np.ndarray], *, bits: int = 4,
                group_size: int = 32, overrides: dict[str, Any] | None = None,
                scale_dtype: str = "f16") -> dict[str, np.ndarray]:
    """The exact arrays write_mlx stores: quantized `.weight` codes (uint32) with
    `.scales`/`.biases` in `scale_dtype`, float32 for the rest, experts as switch_mlp."""
    scale_np = {"f16": np.float16, "f32": np.float32}[scale_dtype]
    out: dict[str, np.ndarray] = {}
    for name, w in _relayout_experts(weights, "switch").items():
        module = name.removesuffix(".weight")
        params = None
        if name.endswith(".weight") and w.ndim >= 2:
            params = _module_params(module, w.shape[-1], bits, group_size, overrides or {})
        if params is None:
            out[name] = w.astype(np.float32)
            continue
        q = quantize_affine(w, *params)
        out[name] = q.codes
        out[module + ".scales"] = q.scales.astype(scale_np)
        out[module + ".biases"] = q.biases.astype(scale_np)
    return out


def write_mlx(folder: str | Path, cfg: dict[str, Any], weights: dict[str, np.ndarray], *,
              bits: int = 4, group_size: int = 32, overrides: dict[str, Any] | None = None,
              scale_dtype: str = "f16") -> Path:
    """Write an MLX-quantized folder (unpadded safetensors header, as MLX writes) and
    return it. `overrides`: module path -> {"bits", "group_size"} | True | False."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    quant = {"group_size": group_size, "bits": bits, "mode": "affine", **(overrides or {})}
    _write_json(folder / "config.json", {**cfg, "quantization": quant, "quantization_config": quant})
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2]})
    tensors = mlx_tensors(cfg, weights, bits=bits, group_size=group_size, overrides=overrides,
                          scale_dtype=scale_dtype)
    write_safetensors(folder / "model.safetensors", tensors, align=False, metadata={"format": "mlx"})
    _write_tokenizer(folder)
    return folder
