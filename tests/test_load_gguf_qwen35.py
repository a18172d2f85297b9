"""llama.cpp Qwen3.5 / Qwen3.5-MoE GGUF files (`qwen35`, `qwen35moe`): a tiny GGUF written from the
same random weights as the HF folder (tests/tiny_gguf_qwen35.py applies the converter's
transforms) loads into the same HybridWeights (F32 exact; F16 / Q8_0 within their rounding),
gives the same logits and greedy tokens, serves in the engine and passes the gates; bad files
are ModelFormatErrors (BadInputError) naming the tensor or key."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import tiny_qwen35 as tq
from tests.test_qwen35_model import PROMPT, run_cuts
from tests.tiny_gguf_qwen35 import gguf_qwen35_tensors, to_tiled, write_qwen35_gguf
from tf_async import BadInputError, Engine
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.weights import AffineWeight, DenseWeight
from tf_async.errors import ModelFormatError
from tf_async.gate import PROMPTS, run_gates
from tf_async.models.checkpoint import Checkpoint
from tf_async.models.gguf_qwen35 import head_rows, v_head_order
from tf_async.models.loader import load_checkpoint, make_decoder
from tf_async.models.qwen35 import HybridDecoder, HybridWeights

# |loaded - HF| / max|HF| per tensor, for the writer's quantizers (as tests/test_load_gguf.py)
QUANT_TOLERANCE = {"F16": 1e-3, "Q8_0": 0.01}
CONFIG_FIELDS_FROM_TOKENIZER = ("name", "extra", "bos_token_id", "eos_token_ids")


@dataclasses.dataclass
class Pair:
    cfg: dict
    weights: dict
    hf: Checkpoint
    gguf: Checkpoint
    gguf_path: Path


def write_pair(folder: Path, moe: bool, qtype: str = "F32", **cfg_overrides: Any) -> Pair:
    cfg = tq.tiny_qwen35_config(moe=moe, **cfg_overrides)
    weights = tq.random_qwen35_weights(cfg, seed=31 if moe else 13)
    hf = load_checkpoint(tq.write_qwen35_hf(folder / "hf", cfg, weights, "f32"))
    path = write_qwen35_gguf(folder / f"tiny-{qtype}.gguf", cfg, weights, qtype=qtype)
    return Pair(cfg, weights, hf, load_checkpoint(path), path)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tmp_path_factory) -> Pair:
    return write_pair(tmp_path_factory.mktemp(request.param), request.param == "moe")


def leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, float array or plain value) for every leaf of a weights tree."""
    if isinstance(value, DenseWeight):
        yield path, value.w
    elif isinstance(value, AffineWeight):
        yield path, value.dequantize()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name != "hybrid":
                yield from leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def decay(a_log: np.ndarray) -> np.ndarray:
    return np.exp(a_log.astype(np.float64)).astype(np.float32)


def weight_pairs(gguf: Checkpoint, hf: Checkpoint) -> list[tuple[str, Any, Any]]:
    assert isinstance(gguf.weights, HybridWeights) and isinstance(hf.weights, HybridWeights)
    got, want = dict(leaves(gguf.weights, "w")), dict(leaves(hf.weights, "w"))
    assert got.keys() == want.keys()
    return [(name, got[name], want[name]) for name in want]


# ---------------------------------------------------------------------------------------
# the layout: transforms and their inverses


def test_v_head_order_undoes_the_converters_tiling():
    hk, hv, dv = 2, 6, 3
    x = np.arange(hv * dv * 5, dtype=np.float32).reshape(hv * dv, 5)
    tiled = to_tiled(x, 0, hk, hv, dv)
    assert not np.array_equal(tiled, x)
    np.testing.assert_array_equal(tiled[head_rows(v_head_order(hk, hv), dv)], x)
    # GGUF row block j*Hk + g holds HF head g*r + j (r = Hv/Hk = 3)
    np.testing.assert_array_equal(tiled[1 * dv:2 * dv], x[3 * dv:4 * dv])
    np.testing.assert_array_equal(v_head_order(hk, hv), [0, 2, 4, 1, 3, 5])


def test_the_file_holds_llama_cpp_names_and_transformed_tensors(pair):
    t = gguf_qwen35_tensors(pair.cfg, pair.weights)
    hf = pair.weights
    assert "blk.0.ssm_a" in t and "blk.0.ssm_dt.bias" in t and "blk.3.attn_q.weight" in t
    assert "blk.4.nextn.eh_proj.weight" in t and "blk.4.attn_q.weight" in t  # MTP = block n_layer
    assert t["blk.0.ssm_conv1d.weight"].shape == (128, 4)
    np.testing.assert_array_equal(t["blk.0.attn_norm.weight"],
                                  hf[tq.LM + "layers.0.input_layernorm.weight"] + np.float32(1))
    np.testing.assert_array_equal(t["blk.0.ssm_norm.weight"],
                                  hf[tq.LM + "layers.0.linear_attn.norm.weight"])
    assert np.all(t["blk.0.ssm_a"] < 0)
    assert not np.array_equal(t["blk.0.attn_gate.weight"],  # Hv 4 > Hk 2: reordered
                              hf[tq.LM + "layers.0.linear_attn.in_proj_z.weight"])


# ---------------------------------------------------------------------------------------
# same weights, logits and tokens as the HF path


def test_f32_weights_equal_the_hf_path(pair):
    assert pair.gguf.meta["mtp"] == "present" and pair.gguf.meta["format"] == "gguf"
    for name, got, want in weight_pairs(pair.gguf, pair.hf):
        if name.endswith(".a_log"):  # A_log -> -exp -> log: the same decay exp(A_log)
            np.testing.assert_array_equal(decay(got), decay(want), err_msg=name)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-7, err_msg=name)
        elif isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert got == want, name


def test_config_equals_the_hf_path(pair):
    g, h = pair.gguf.weights.hybrid, pair.hf.weights.hybrid
    assert dataclasses.replace(g, kv_config=h.kv_config) == h
    for f in dataclasses.fields(h.kv_config):
        if f.name not in CONFIG_FIELDS_FROM_TOKENIZER:
            assert getattr(pair.gguf.config, f.name) == getattr(h.kv_config, f.name), f.name


def test_logits_equal_the_hf_path(pair):
    decoders = [make_decoder(ckpt, CpuOps(), num_lanes=1) for ckpt in (pair.gguf, pair.hf)]
    assert all(isinstance(d, HybridDecoder) for d in decoders)
    got, want = (run_cuts(d, PROMPT, [len(PROMPT)]) for d in decoders)  # type: ignore[arg-type]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # bit-equal here (same decay bits)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def engine(model: Any, **kw: Any) -> Engine:
    return Engine(model, **{**dict(device="cpu", parallel=4, ctx=128, page_size=4,
                                   step_tokens=16, ngram_min=1), **kw})


async def greedy(model: Any, **kw: Any) -> list[list[int]]:
    async with engine(model, **kw) as eng:
        outs = await asyncio.gather(*(eng.complete(p, max_tokens=12) for p in PROMPTS[:4]))
    return [o.token_ids for o in outs]


def test_the_engine_serves_the_gguf_path_with_the_hf_greedy_tokens(pair):
    from_file = asyncio.run(greedy(str(pair.gguf_path)))  # Engine(path_to.gguf, device="cpu")
    assert from_file == asyncio.run(greedy(pair.hf))
    assert all(len(tokens) > 0 for tokens in from_file)


@pytest.mark.asyncio
async def test_all_gates_pass_on_the_gguf(pair):
    rows, idle = await run_gates(pair.gguf, device="cpu", max_tokens=8, ctx=128,
                                 prompts=PROMPTS[:4], drafters=("mtp", "ngram"), temperature=8.0)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert len(rows) == 2 * (4 + 1 + 3 + 1 + 1 + 2) + 1  # as tests/test_qwen35_engine.py
    assert idle["drafted-mtp-seeded"]["drafted_tokens"] > 0


# ---------------------------------------------------------------------------------------
# quantized files, fused experts, no MTP


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("moe", [False, True])
def test_quantized_weights_are_the_hf_weights_within_rounding(tmp_path, qtype, moe):
    pair = write_pair(tmp_path, moe, qtype)
    assert pair.gguf.meta["tensor_types"].get(qtype, 0) > 0
    for name, got, want in weight_pairs(pair.gguf, pair.hf):
        if isinstance(want, np.ndarray) and want.size:
            scale = float(np.abs(want).max()) or 1.0
            tol = 3e-7 if want.ndim == 1 else QUANT_TOLERANCE[qtype] * scale
            np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)
    assert isinstance(pair.gguf.weights, HybridWeights)
    if qtype == "Q8_0":  # stays quantized; ssm_out (dv 16 < 32-wide groups) is regrouped dense
        mixer = pair.gguf.weights.layers[0].mixer
        assert isinstance(mixer.in_qkv, AffineWeight) and isinstance(mixer.out, DenseWeight)


def test_q8_0_ssm_out_keeps_its_blocks_when_a_v_head_is_whole_groups(tmp_path):
    pair = write_pair(tmp_path, False, "Q8_0", linear_value_head_dim=32)
    assert isinstance(pair.gguf.weights, HybridWeights)
    out = pair.gguf.weights.layers[0].mixer.out
    assert isinstance(out, AffineWeight)
    for name, got, want in weight_pairs(pair.gguf, pair.hf):
        if name.endswith("mixer.out"):
            np.testing.assert_allclose(got, want, rtol=0, atol=0.01 * np.abs(want).max())
    logits = [run_cuts(make_decoder(c, CpuOps(int8_x=False)), PROMPT, [len(PROMPT)])  # type: ignore[arg-type]
              for c in (pair.gguf, pair.hf)]
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=0.05 * np.abs(logits[1]).max())


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_fused_gate_up_experts_load_the_same(tmp_path, qtype):
    pair = write_pair(tmp_path, True, qtype)
    fused = load_checkpoint(write_qwen35_gguf(tmp_path / "fused.gguf", pair.cfg, pair.weights,
                                              qtype=qtype, fused_experts=True))
    for name, got, want in weight_pairs(fused, pair.gguf):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize(("extra", "status"), [
    ("nextn.embed_tokens.weight", "unsupported: mtp_use_dedicated_embeddings is true"),
    ("nextn.shared_head_head.weight", "unsupported: the GGUF's MTP block has its own head"),
])
def test_an_mtp_block_we_cannot_run_loads_without_it_and_says_why(tmp_path, extra, status):
    cfg = tq.tiny_qwen35_config(moe=False)
    weights = tq.random_qwen35_weights(cfg, seed=8)
    path = write_qwen35_gguf(tmp_path / "mtp.gguf", cfg, weights, edit=lambda a: a.update(
        {f"blk.4.{extra}": np.ones((cfg["vocab_size"], cfg["hidden_size"]), np.float32)}))
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt.weights, HybridWeights) and ckpt.weights.mtp is None
    assert str(ckpt.meta["mtp"]).startswith(status)


def test_a_squeezed_shared_expert_gate_loads_the_same(tmp_path):
    pair = write_pair(tmp_path, True)

    def squeeze(arrays: dict[str, np.ndarray]) -> None:
        for name in [n for n in arrays if n.endswith("ffn_gate_inp_shexp.weight")]:
            arrays[name] = arrays[name][0]  # [1, H] -> [H]

    squeezed = load_checkpoint(write_qwen35_gguf(tmp_path / "sq.gguf", pair.cfg, pair.weights,
                                                 edit=squeeze))
    for name, got, want in weight_pairs(squeezed, pair.gguf):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_file_without_mtp_says_so(tmp_path):
    cfg = tq.tiny_qwen35_config(moe=False, mtp_num_hidden_layers=0)
    weights = tq.random_qwen35_weights(cfg, seed=2)
    ckpt = load_checkpoint(write_qwen35_gguf(tmp_path / "nomtp.gguf", cfg, weights))
    assert isinstance(ckpt.weights, HybridWeights)
    assert ckpt.weights.mtp is None and ckpt.meta["mtp"] == "not declared"


@pytest.fixture(scope="module")
def dense_source() -> tuple[dict, dict]:
    cfg = tq.tiny_qwen35_config(moe=False)
    return cfg, tq.random_qwen35_weights(cfg, seed=4)


def test_the_qwen35_pre_tokenizer_keeps_combining_marks_in_words(tmp_path, dense_source):
    cfg, weights = dense_source
    path = write_qwen35_gguf(tmp_path / "pre.gguf", cfg, weights,
                             metadata={"tokenizer.ggml.pre": "qwen35"})  # as llama.cpp writes it
    pre = load_checkpoint(path).tokenizer.hf_tokenizer.pre_tokenizer
    assert [p for p, _ in pre.pre_tokenize_str("cafe\u0301 x\u0301!")] == ["cafeÌģ", "ĠxÌģ", "!"]
    assert [p for p, _ in pre.pre_tokenize_str("I'M 12345 abc!!\n\n  x")] == [  # as qwen2
        "I", "'M", "Ġ", "1", "2", "3", "4", "5", "Ġabc", "!!ĊĊ", "Ġ", "Ġx"]


# ---------------------------------------------------------------------------------------
# bad files


@pytest.mark.parametrize(("edit", "message"), [
    ({"drop": ("blk.1.ssm_a",)}, r"missing tensor 'blk\.1\.ssm_a'"),
    ({"drop": ("blk.4.nextn.hnorm.weight",)}, r"missing tensor 'blk\.4\.nextn\.hnorm\.weight'"),
    ({"drop": ("blk.3.attn_q_norm.weight",)}, r"missing tensor 'blk\.3\.attn_q_norm\.weight'"),
    ({"metadata": {"qwen35.ssm.inner_size": 96}},
     r"tensor 'blk\.0\.attn_qkv\.weight' has shape \[128, 64\], expected \[160, 64\]"),
    ({"metadata": {"qwen35.ssm.group_count": None}}, r"missing GGUF metadata key 'qwen35\.ssm\.group_count'"),
    ({"metadata": {"qwen35.ssm.inner_size": 62}}, r"ssm\.inner_size=62 is not a multiple"),
    ({"metadata": {"qwen35.full_attention_interval": 2}}, r"missing tensor 'blk\.1\.attn_q\.weight'"),
    ({"metadata": {"qwen35.nextn_predict_layers": None, "qwen35.block_count": 4}},
     r"unexpected tensor\(s\) for qwen35: \['blk\.4\."),
    ({"edit": lambda a: a.update({"blk.0.ssm_in.weight": np.zeros((8, 64), np.float32)})},
     r"unexpected tensor\(s\) for qwen35: \['blk\.0\.ssm_in\.weight'\]"),
    ({"metadata": {"general.architecture": "qwen3next"}},
     r"unknown architecture general\.architecture='qwen3next'"),
])
def test_bad_files_name_the_tensor_or_key(tmp_path, dense_source, edit, message):
    cfg, weights = dense_source
    path = write_qwen35_gguf(tmp_path / "bad.gguf", cfg, weights, **edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_checkpoint(path)
    assert isinstance(info.value, BadInputError) and str(path) in str(info.value)


def test_a_positive_ssm_a_is_refused(tmp_path, dense_source):
    cfg, weights = dense_source
    bad = dict(weights)
    bad[tq.LM + "layers.2.linear_attn.A_log"] = np.full(4, np.nan, np.float32)  # -exp(nan) = nan
    with pytest.raises(ModelFormatError, match=r"'blk\.2\.ssm_a' must be negative"):
        load_checkpoint(write_qwen35_gguf(tmp_path / "nan.gguf", cfg, bad))
