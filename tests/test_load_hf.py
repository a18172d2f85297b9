"""Hugging Face / MLX folder loading, the safetensors reader, and the float64 reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.reference import (
    apply_rope,
    attention,
    mlp,
    moe,
    reference_logits,
    rms_norm,
    rope_inv_freq,
)
from tests.tiny import random_hf_weights, tiny_config
from tests.tiny_hf import (
    bf16_round,
    mlx_tensors,
    stack_experts,
    stored_value,
    write_hf,
    write_mlx,
    write_safetensors,
)
from tf_async.backend.weights import AffineWeight, DenseWeight
from tf_async.errors import ModelFormatError
from tf_async.models.checkpoint import ModelWeights
from tf_async.models.hf import load_hf_folder, load_hf_weights
from tf_async.models.loader import load_checkpoint
from tf_async.models.safetensors_io import load_safetensors, read_safetensors_header

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
_LINEAR_FIELDS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                  "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                  "down": "mlp.down_proj", "router": "mlp.gate"}
_VECTOR_FIELDS = {"input_norm": "input_layernorm.weight",
                  "post_norm": "post_attention_layernorm.weight",
                  "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
                  "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
                  "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
_EXPERT_FIELDS = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}


def hf_view(mw: ModelWeights, tied: bool) -> dict[str, np.ndarray]:
    """Loaded weights back under HF per-expert names, dequantized to float32."""
    out = {"model.embed_tokens.weight": mw.embed.dequantize(), "model.norm.weight": mw.final_norm}
    if not tied:
        out["lm_head.weight"] = mw.lm_head.dequantize()
    for i, lw in enumerate(mw.layers):
        p = f"model.layers.{i}."
        for field, name in _LINEAR_FIELDS.items():
            if getattr(lw, field) is not None:
                out[p + name + ".weight"] = getattr(lw, field).dequantize()
        for field, name in _VECTOR_FIELDS.items():
            if getattr(lw, field) is not None:
                out[p + name] = getattr(lw, field)
        for field, proj in _EXPERT_FIELDS.items():
            stacked = getattr(lw, field)
            for e, w in enumerate([] if stacked is None else stacked.dequantize()):
                out[f"{p}mlp.experts.{e}.{proj}.weight"] = w
    return out


def assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


# --- safetensors reader ---------------------------------------------------------------------


def test_reader_aligned_and_unaligned(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": np.arange(7, dtype=np.uint32), "c": np.arange(-3, 3, dtype=np.int8),
               "d": rng.standard_normal(4).astype(np.float16), "e": rng.standard_normal(2)}
    for align in (True, False):
        path = write_safetensors(tmp_path / f"x{align}.safetensors", tensors, align=align)
        header = read_safetensors_header(path)
        assert any(info.begin % 4 for info in header.values()) == (not align)
        got = load_safetensors(path)
        for name, arr in tensors.items():
            assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
            assert got[name].flags.aligned and got[name].flags.c_contiguous  # kernels need both
            np.testing.assert_array_equal(got[name], arr)
        got["a"][0, 0] = 99.0  # copy-on-write: the file is untouched
        assert load_safetensors(path)["a"][0, 0] == tensors["a"][0, 0]
    assert read_safetensors_header(path)["a"].shape == (3, 5)


def test_reader_bf16_widens_to_f32(tmp_path: Path) -> None:
    x = np.array([[1.0, -2.5, 3.14159, 1e-3]], np.float32)
    path = write_safetensors(tmp_path / "b.safetensors", {"x": x}, dtype="bf16")
    assert read_safetensors_header(path)["x"].dtype == "BF16"
    got = load_safetensors(path)["x"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, bf16_round(x))
    np.testing.assert_allclose(got, x, rtol=2**-8)
    assert got[0, 0] == 1.0 and got[0, 1] == -2.5


# --- HF float folders -------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_folder_loads_source_weights(tmp_path: Path, arch: str, dtype: str, num_shards: int) -> None:
    cfg = tiny_config(arch)
    weights = random_hf_weights(cfg, seed=1)
    folder = write_hf(tmp_path / "m", cfg, weights, dtype=dtype, num_shards=num_shards)
    config, mw, meta = load_hf_weights(folder)
    assert (config.arch, config.num_layers, config.head_dim) == (arch, 2, cfg.get("head_dim", 16))
    assert meta["format"] == "hf" and meta["num_shards"] == num_shards
    tied = cfg["tie_word_embeddings"]
    assert (mw.lm_head is mw.embed) == tied
    want = {n: stored_value(w, dtype) for n, w in weights.items()}
    assert_same_weights(hf_view(mw, tied), want)
    assert all(isinstance(lw.q, DenseWeight) for lw in mw.layers)


def test_load_checkpoint_folder_end_to_end(tmp_path: Path) -> None:
    cfg = tiny_config("qwen3")
    folder = write_hf(tmp_path / "tiny-qwen3", cfg, random_hf_weights(cfg))
    ckpt = load_checkpoint(str(folder))
    assert ckpt.config.arch == "qwen3" and ckpt.config.name == "tiny-qwen3"
    assert ckpt.path == str(folder) and ckpt.meta["format"] == "hf"
    ids = ckpt.tokenizer.encode("hello world")
    assert ids and ckpt.tokenizer.decode(ids) == "hello world"
    assert 2 in ckpt.tokenizer.eos_token_ids
    assert type(load_hf_folder(folder).tokenizer) is type(ckpt.tokenizer)


def test_tied_model_ignores_lm_head_on_disk(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    weights = random_hf_weights(cfg)
    weights["lm_head.weight"] = np.zeros((cfg["vocab_size"], cfg["hidden_size"]), np.float32)
    _, mw, _ = load_hf_weights(write_hf(tmp_path / "m", cfg, weights))
    assert mw.lm_head is mw.embed
    np.testing.assert_array_equal(mw.lm_head.dequantize(), weights["model.embed_tokens.weight"])


def test_rotary_inv_freq_is_ignored(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    weights = random_hf_weights(cfg)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    load_hf_weights(write_hf(tmp_path / "m", cfg, weights))


@pytest.mark.parametrize(("config_eos", "gen_eos", "want"), [
    (2, [2], (2,)),
    (2, [3, 2, 5, 3], (2, 3, 5)),
    ([2, 9], 7, (2, 9, 7)),
    (None, [4, 1], (4, 1)),
])
def test_generation_config_eos_merge(tmp_path: Path, config_eos, gen_eos, want) -> None:
    cfg = tiny_config("llama", eos_token_id=config_eos, bos_token_id=None)
    folder = write_hf(tmp_path / "m", cfg, random_hf_weights(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos, "bos_token_id": 1}))
    config, _, _ = load_hf_weights(folder)
    assert config.eos_token_ids == want
    assert config.bos_token_id == 1


# --- MLX quantized folders --------------------------------------------------------------------


def expected_from_mlx(tensors: dict[str, np.ndarray], source: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the loader must return (HF per-expert names): stored codes dequantized exactly."""
    stacked = {f"{k.rsplit('.', 1)[0]}.switch_mlp.{k.rsplit('.', 1)[1]}.weight": v
               for k, v in stack_experts(source).items()}
    floats = {**source, **stacked}
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        module = name.removesuffix(".weight")
        if module + ".scales" in tensors:
            in_f = floats[name].shape[-1]
            scales = tensors[module + ".scales"].astype(np.float32)
            bits, group_size = arr.shape[-1] * 32 // in_f, in_f // scales.shape[-1]
            biases = tensors[module + ".biases"].astype(np.float32)
            out[name] = AffineWeight(arr, scales, biases, bits, group_size).dequantize()
        elif not name.endswith((".scales", ".biases")):
            out[name] = arr
    for name in [n for n in out if ".switch_mlp." in n]:
        prefix, proj = name.split(".switch_mlp.")
        for e, w in enumerate(out.pop(name)):
            out[f"{prefix}.experts.{e}.{proj}"] = w
    return out


def moe_cfg_128(**overrides) -> dict:
    # hidden 128 so that group size 128 divides q/k/v/router/embed; down (in 96/32) stays float
    return tiny_config("qwen3_moe", hidden_size=128, **overrides)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_quantized_folder(tmp_path: Path, bits: int, group_size: int) -> None:
    cfg = moe_cfg_128()
    source = random_hf_weights(cfg, seed=2)
    folder = write_mlx(tmp_path / "m", cfg, source, bits=bits, group_size=group_size)
    config, mw, meta = load_hf_weights(folder)
    assert meta["format"] == "mlx" and meta["quantization"] == {"bits": bits, "group_size": group_size}
    tensors = mlx_tensors(cfg, source, bits=bits, group_size=group_size)
    assert_same_weights(hf_view(mw, tied=False), expected_from_mlx(tensors, source))
    lw = mw.layers[0]
    for w in (mw.embed, mw.lm_head, lw.q, lw.o, lw.router, lw.experts_gate):
        assert isinstance(w, AffineWeight) and (w.bits, w.group_size) == (bits, group_size)
        assert w.codes.dtype == np.uint32 and w.scales.dtype == np.float32
    # expert down_proj has in-features 32: quantized only at group size 32
    assert isinstance(lw.experts_down, AffineWeight) == (group_size == 32)
    assert isinstance(mw.layers[1].down, AffineWeight) == (group_size == 32)  # in-features 96
    # dequantized values are close to the float source (the packing round-trips)
    err = np.abs(lw.q.dequantize() - source["model.layers.0.self_attn.q_proj.weight"])
    assert err.max() <= lw.q.scales.max() * 0.51 + 1e-2


def test_mlx_overrides_router_8bit_and_float_module(tmp_path: Path) -> None:
    cfg = moe_cfg_128()
    source = random_hf_weights(cfg, seed=3)
    overrides = {"model.layers.0.mlp.gate": {"bits": 8, "group_size": 64},
                 "model.layers.0.self_attn.o_proj": False,
                 "model.embed_tokens": {"bits": 8}}
    folder = write_mlx(tmp_path / "m", cfg, source, bits=4, group_size=32, overrides=overrides,
                       scale_dtype="f32")
    _, mw, _ = load_hf_weights(folder)
    lw = mw.layers[0]
    assert isinstance(lw.router, AffineWeight) and (lw.router.bits, lw.router.group_size) == (8, 64)
    assert isinstance(lw.o, DenseWeight)
    np.testing.assert_array_equal(lw.o.w, source["model.layers.0.self_attn.o_proj.weight"])
    assert isinstance(mw.embed, AffineWeight) and (mw.embed.bits, mw.embed.group_size) == (8, 32)
    assert isinstance(mw.lm_head, AffineWeight) and mw.lm_head.bits == 4
    tensors = mlx_tensors(cfg, source, bits=4, group_size=32, overrides=overrides, scale_dtype="f32")
    assert_same_weights(hf_view(mw, tied=False), expected_from_mlx(tensors, source))


def test_mlx_tied_quantized_embedding(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    source = random_hf_weights(cfg, seed=4)
    _, mw, _ = load_hf_weights(write_mlx(tmp_path / "m", cfg, source, bits=8, group_size=64))
    assert isinstance(mw.embed, AffineWeight) and mw.lm_head is mw.embed
    assert mw.embed.codes.shape == (cfg["vocab_size"], cfg["hidden_size"] * 8 // 32)


def test_mlx_override_disagreeing_with_tensors(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    folder = write_mlx(tmp_path / "m", cfg, random_hf_weights(cfg))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["model.layers.0.mlp.up_proj"] = False  # but it is quantized on disk
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has dtype U32"):
        load_hf_weights(folder)
    folder = write_mlx(tmp_path / "n", cfg, random_hf_weights(cfg),
                       overrides={"model.layers.1.self_attn.k_proj": False})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["model.layers.1.self_attn.k_proj"] = True  # but stored in float
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has dtype F32, expected U32"):
        load_hf_weights(folder)


# --- MoE expert layouts -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_expert", "fused", "switch"])
def test_expert_layouts_stack_to_e_out_in(tmp_path: Path, layout: str) -> None:
    cfg = tiny_config("qwen3_moe")
    source = random_hf_weights(cfg, seed=5)
    if layout == "switch":
        keep_float = {f"model.layers.0.mlp.switch_mlp.{p}": False for p in ("gate_proj", "up_proj", "down_proj")}
        folder = write_mlx(tmp_path / "m", cfg, source, overrides=keep_float)
    else:
        folder = write_hf(tmp_path / "m", cfg, source, expert_layout=layout)
    _, mw, _ = load_hf_weights(folder)
    lw = mw.layers[0]
    E, Im, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    assert lw.experts_gate.w.shape == (E, Im, H) and lw.experts_down.w.shape == (E, H, Im)
    for e in range(E):
        p = f"model.layers.0.mlp.experts.{e}."
        np.testing.assert_array_equal(lw.experts_gate.w[e], source[p + "gate_proj.weight"])
        np.testing.assert_array_equal(lw.experts_up.w[e], source[p + "up_proj.weight"])
        np.testing.assert_array_equal(lw.experts_down.w[e], source[p + "down_proj.weight"])
    assert lw.experts_gate.w.flags.c_contiguous and lw.experts_up.w.flags.c_contiguous
    assert mw.layers[1].experts_gate is None and mw.layers[1].gate is not None  # mlp_only_layers


# --- bad input ---------------------------------------------------------------------------------


def good_folder(tmp_path: Path, arch: str = "llama", **kw) -> tuple[Path, dict, dict]:
    cfg = tiny_config(arch)
    weights = random_hf_weights(cfg)
    return write_hf(tmp_path / "m", cfg, weights, **kw), cfg, weights


def raw_file(path: Path, header: dict, data: bytes, header_bytes: bytes | None = None) -> Path:
    head = json.dumps(header).encode() if header_bytes is None else header_bytes
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)
    return path


def test_missing_config_json(tmp_path: Path) -> None:
    folder, _, _ = good_folder(tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json.*not found"):
        load_hf_weights(folder)


def test_unknown_model_type(tmp_path: Path) -> None:
    folder, cfg, _ = good_folder(tmp_path)
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ModelFormatError, match=r"config\.json.*gpt_neox"):
        load_hf_weights(folder)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_missing_tensor(tmp_path: Path, num_shards: int) -> None:
    cfg = tiny_config("llama")
    weights = random_hf_weights(cfg)
    del weights["model.layers.1.mlp.up_proj.weight"]
    folder = write_hf(tmp_path / "m", cfg, weights, num_shards=num_shards)
    with pytest.raises(ModelFormatError, match=r"model\.safetensors.*missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_weights(folder)


def test_missing_expert_tensor(tmp_path: Path) -> None:
    cfg = tiny_config("qwen3_moe")
    weights = random_hf_weights(cfg)
    del weights["model.layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ModelFormatError, match=r"experts\.3\.down_proj\.weight"):
        load_hf_weights(write_hf(tmp_path / "m", cfg, weights))


def test_wrong_shape_names_file_tensor_and_shapes(tmp_path: Path) -> None:
    cfg = tiny_config("qwen2")
    weights = random_hf_weights(cfg)
    weights["model.layers.0.self_attn.k_proj.bias"] = np.zeros(7, np.float32)
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.bias' has shape \[7\], expected \[32\]"):
        load_hf_weights(write_hf(tmp_path / "m", cfg, weights))


def test_unexpected_tensor_is_refused(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    weights = random_hf_weights(cfg)
    weights["model.layers.0.mlp.down_proj.bias"] = np.zeros(cfg["hidden_size"], np.float32)
    with pytest.raises(ModelFormatError, match=r"unexpected tensor.*mlp\.down_proj\.bias"):
        load_hf_weights(write_hf(tmp_path / "m", cfg, weights))


def test_truncated_safetensors(tmp_path: Path) -> None:
    folder, _, _ = good_folder(tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor '[^']+': .*truncated"):
        load_hf_weights(folder)
    path.write_bytes(b"\x10\x00")
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: truncated"):
        load_hf_weights(folder)


def test_corrupt_header_json(tmp_path: Path) -> None:
    folder, _, _ = good_folder(tmp_path)
    raw_file(folder / "model.safetensors", {}, b"\x00" * 16, header_bytes=b'{"a": {"dtype": ')
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: corrupt safetensors header"):
        load_hf_weights(folder)


def test_offsets_and_size_errors_name_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    raw_file(path, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, b"\x00" * 16)
    with pytest.raises(ModelFormatError, match=r"x\.safetensors: tensor 'w': 12 bytes but shape \[2, 2\]"):
        read_safetensors_header(path)
    raw_file(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}}, b"\x00" * 16)
    with pytest.raises(ModelFormatError, match=r"x\.safetensors: tensor 'w': data_offsets .* out of range"):
        read_safetensors_header(path)


def test_unknown_dtype(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "x.safetensors",
                    {"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, b"\x00" * 4)
    with pytest.raises(ModelFormatError, match=r"x\.safetensors: tensor 'w': unsupported dtype 'F8_E4M3'"):
        load_safetensors(path)


def test_missing_shard(tmp_path: Path) -> None:
    folder, _, _ = good_folder(tmp_path, num_shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"index\.json: shard 'model-00002-of-00003\.safetensors' .*is missing"):
        load_hf_weights(folder)


def test_no_weights_file(tmp_path: Path) -> None:
    folder, _, _ = good_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"no model\.safetensors"):
        load_hf_weights(folder)


def test_scales_without_quantization_config(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    folder = write_mlx(tmp_path / "m", cfg, random_hf_weights(cfg))
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=r"config\.json: tensor 'model\.embed_tokens\.scales' is present"):
        load_hf_weights(folder)


def test_foreign_quantization_is_refused(tmp_path: Path) -> None:
    folder, cfg, _ = good_folder(tmp_path)
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ModelFormatError, match=r"config\.json: unsupported .*'awq'"):
        load_hf_weights(folder)


def test_bad_generation_config(tmp_path: Path) -> None:
    folder, _, _ = good_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelFormatError, match=r"generation_config\.json: eos_token_id"):
        load_hf_weights(folder)


def test_loader_rejects_missing_path_and_other_files(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "model.bin").write_bytes(b"1234")
    with pytest.raises(ModelFormatError, match=r"model\.bin: not a model"):
        load_checkpoint(tmp_path / "model.bin")


# --- the float64 reference ----------------------------------------------------------------------


def test_rope_identity_at_zero_and_rotation() -> None:
    cfg = tiny_config("llama")  # hd 16
    x = np.random.default_rng(0).standard_normal((2, 3, 16))
    np.testing.assert_allclose(apply_rope(x, np.array([0, 0]), cfg), x, atol=0)
    out = apply_rope(x, np.array([0, 5]), cfg)
    i, angle = 2, 5 * 10000.0 ** (-4 / 16)  # pair (2, 10) rotates by p * theta^(-2i/hd)
    c, s = math.cos(angle), math.sin(angle)
    np.testing.assert_allclose(out[1, :, i], x[1, :, i] * c - x[1, :, i + 8] * s)
    np.testing.assert_allclose(out[1, :, i + 8], x[1, :, i + 8] * c + x[1, :, i] * s)


def test_rope_scaling_frequencies() -> None:
    base = rope_inv_freq(tiny_config("llama"))[0]
    lin, m = rope_inv_freq(tiny_config("llama", rope_scaling={"type": "linear", "factor": 4.0}))
    np.testing.assert_allclose(lin, base / 4)
    assert m == 1.0
    l3, _ = rope_inv_freq(tiny_config("llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(l3[wavelen < 16], base[wavelen < 16])  # high freq kept
    np.testing.assert_allclose(l3[wavelen > 64], base[wavelen > 64] / 8)  # low freq scaled
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all((l3[mid] < base[mid]) & (l3[mid] > base[mid] / 8))
    yarn_cfg = tiny_config("qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 128})
    yarn, mscale = rope_inv_freq(yarn_cfg)
    base32 = rope_inv_freq(tiny_config("qwen3"))[0]  # head_dim 32
    assert mscale == pytest.approx(0.1 * math.log(4.0) + 1)
    # ramp over dims [floor(corr(32)), ceil(corr(1))] = [0, 6]: extrapolated below, interpolated above
    assert yarn[0] == base32[0] and yarn[-1] == pytest.approx(base32[-1] / 4)
    assert yarn[3] == pytest.approx(base32[3] / 4 * 0.5 + base32[3] * 0.5)
    x = np.random.default_rng(1).standard_normal((1, 1, 32))
    # yarn multiplies cos and sin by mscale, so the norm of a rotated vector grows by mscale
    assert np.linalg.norm(apply_rope(x, np.array([3]), yarn_cfg)) == pytest.approx(mscale * np.linalg.norm(x))


def test_attention_over_one_token_returns_v() -> None:
    cfg = tiny_config("llama")
    w = {k: v.astype(np.float64) for k, v in random_hf_weights(cfg).items()}
    x = np.random.default_rng(2).standard_normal((1, 64))
    p = "model.layers.0."
    v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(2, 16)
    heads = np.concatenate([v[0], v[0], v[1], v[1]])  # 4 query heads, 2 kv heads, contiguous groups
    want = heads @ w[p + "self_attn.o_proj.weight"].T
    np.testing.assert_allclose(attention(cfg, w, p, x)[0], want, rtol=1e-12)
    w[p + "self_attn.q_proj.weight"] *= 3.0  # q and k do not matter for one token
    np.testing.assert_allclose(attention(cfg, w, p, x)[0], want, rtol=1e-12)


def test_attention_with_zero_queries_is_a_causal_mean() -> None:
    cfg = tiny_config("qwen2")
    w = {k: v.astype(np.float64) for k, v in random_hf_weights(cfg).items()}
    p = "model.layers.0."
    w[p + "self_attn.q_proj.weight"][:] = 0
    w[p + "self_attn.q_proj.bias"][:] = 0
    x = np.random.default_rng(3).standard_normal((3, 64))
    v = (x @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).reshape(3, 2, 16)
    mean_v = np.cumsum(v, axis=0) / np.arange(1, 4)[:, None, None]
    heads = np.repeat(mean_v, 2, axis=1).reshape(3, 64)
    np.testing.assert_allclose(attention(cfg, w, p, x), heads @ w[p + "self_attn.o_proj.weight"].T,
                               rtol=1e-10)


def test_one_layer_one_token_by_hand() -> None:
    cfg = tiny_config("llama", num_hidden_layers=1, tie_word_embeddings=False)
    w = {k: v.astype(np.float64) for k, v in random_hf_weights(cfg, seed=6).items()}
    p, eps, tok = "model.layers.0.", cfg["rms_norm_eps"], 17
    h = w["model.embed_tokens.weight"][tok]
    a = h / np.sqrt(np.mean(h * h) + eps) * w[p + "input_layernorm.weight"]
    v = (w[p + "self_attn.v_proj.weight"] @ a).reshape(2, 16)
    h = h + w[p + "self_attn.o_proj.weight"] @ np.concatenate([v[0], v[0], v[1], v[1]])
    m = h / np.sqrt(np.mean(h * h) + eps) * w[p + "post_attention_layernorm.weight"]
    g, u = w[p + "mlp.gate_proj.weight"] @ m, w[p + "mlp.up_proj.weight"] @ m
    h = h + w[p + "mlp.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u)
    h = h / np.sqrt(np.mean(h * h) + eps) * w["model.norm.weight"]
    np.testing.assert_allclose(reference_logits(cfg, w, [tok])[0], w["lm_head.weight"] @ h, rtol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_is_causal(arch: str) -> None:
    cfg = tiny_config(arch)
    w = random_hf_weights(cfg, seed=7)
    ids = [5, 9, 250, 3, 77]
    full = reference_logits(cfg, w, ids)
    assert full.shape == (5, cfg["vocab_size"]) and full.dtype == np.float64
    np.testing.assert_allclose(reference_logits(cfg, w, ids[:3]), full[:3], rtol=1e-10, atol=1e-12)
    assert not np.allclose(full[3], full[4])


def test_qk_norm_makes_q_scale_irrelevant() -> None:
    cfg = tiny_config("qwen3", rms_norm_eps=1e-12)  # so rms(4q) == rms(q) to rounding
    w = random_hf_weights(cfg, seed=8)
    scaled = {**w, "model.layers.0.self_attn.q_proj.weight": w["model.layers.0.self_attn.q_proj.weight"] * 4}
    np.testing.assert_allclose(reference_logits(cfg, scaled, [1, 2, 3]), reference_logits(cfg, w, [1, 2, 3]),
                               rtol=1e-8, atol=1e-10)
    nonorm = tiny_config("llama", head_dim=32, rms_norm_eps=1e-12)  # same shapes, no q_norm: the scale matters
    plain = {k: v for k, v in w.items() if "_norm." not in k or "layernorm" in k}
    plain_scaled = {k: v for k, v in scaled.items() if "_norm." not in k or "layernorm" in k}
    assert not np.allclose(reference_logits(nonorm, plain_scaled, [1, 2, 3]),
                           reference_logits(nonorm, plain, [1, 2, 3]))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_with_identical_experts(norm_topk_prob: bool) -> None:
    cfg = tiny_config("qwen3_moe", norm_topk_prob=norm_topk_prob)
    w = {k: v.astype(np.float64) for k, v in random_hf_weights(cfg, seed=9).items()}
    p = "model.layers.0."
    for e in range(1, cfg["num_experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w[f"{p}mlp.experts.{e}.{proj}.weight"] = w[f"{p}mlp.experts.0.{proj}.weight"]
    x = np.random.default_rng(10).standard_normal((3, 64))
    dense = mlp(w, p + "mlp.experts.0.", x)
    logits = x @ w[p + "mlp.gate.weight"].T
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top2 = np.sort(probs, axis=-1)[:, -2:].sum(-1, keepdims=True)
    want = dense if norm_topk_prob else dense * top2
    np.testing.assert_allclose(moe(cfg, w, p, x), want, rtol=1e-10)


def test_reference_rms_norm() -> None:
    x = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(rms_norm(x, np.array([1.0, 2.0]), 0.0), [[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]])
