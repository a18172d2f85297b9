"""MLX-quantized DFlash drafters (the layout of the public 4-bit DFlash2 drafters, e.g. made
with mlx_vlm.convert / mlx_lm: config.json's `quantization` entry, projections as affine
packed codes + scales + biases, norms / conv base kernels / codebooks float or quantized):
loaded through the same affine weights as MLX targets; the forward equals the one of the
dequantized float drafter; drafted == plain with it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.tiny_dflash import dflash_config, dflash_weights, mlx_quantize_dflash, write_dflash
from tf_async import Engine
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.weights import AffineWeight, DenseWeight
from tf_async.errors import ModelFormatError
from tf_async.gate import PROMPTS
from tf_async.models.dflash import load_dflash
from tf_async.models.dflash_model import DFlashModel


def _quantized(tmp_path, generation: int, *, codebooks: bool = False, quant: dict | None = None):
    cfg = dflash_config(generation)
    if codebooks:  # rows of the codebooks quantize in groups of 32
        cfg["dflash_config"]["selector_rank"] = 32
    cfg["quantization"] = quant if quant is not None else {"group_size": 32, "bits": 4}
    weights = mlx_quantize_dflash(dflash_weights(cfg, seed=generation), 4, 32, codebooks=codebooks)
    return write_dflash(tmp_path / f"q{generation}{codebooks}", cfg, weights), cfg


def _dequantized_folder(tmp_path, ckpt, cfg):
    """The float drafter with the quantized one's dequantized weights (f32 on disk)."""
    out = {}
    w = ckpt.weights
    out["fc.weight"] = w.fc.dequantize()
    out["hidden_norm.weight"], out["norm.weight"] = w.hidden_norm, w.norm
    for i, layer in enumerate(w.layers):
        p = f"layers.{i}."
        for name, lin in (("self_attn.q_proj", layer.q), ("self_attn.k_proj", layer.k),
                          ("self_attn.v_proj", layer.v), ("self_attn.o_proj", layer.o),
                          ("mlp.gate_proj", layer.gate), ("mlp.up_proj", layer.up),
                          ("mlp.down_proj", layer.down)):
            out[p + name + ".weight"] = lin.dequantize()
        out.update({p + "input_layernorm.weight": layer.input_norm,
                    p + "post_attention_layernorm.weight": layer.post_norm,
                    p + "self_attn.q_norm.weight": layer.q_norm,
                    p + "self_attn.k_norm.weight": layer.k_norm})
        for conv_name, conv in (("attention_conv", layer.attention_conv), ("mlp_conv", layer.mlp_conv)):
            if conv is not None:
                out[p + conv_name + ".base_kernel"] = conv.base_kernel
                out[p + conv_name + ".kernel_projection.weight"] = conv.kernel_projection.dequantize()
    if w.selector is not None:
        s = w.selector
        out["candidate_selector.hidden_projection.weight"] = s.hidden_projection.dequantize()
        out["candidate_selector.predecessor_codebook"] = s.predecessor_codebook
        out["candidate_selector.successor_codebook"] = s.successor_codebook
    plain_cfg = {k: v for k, v in cfg.items() if k != "quantization"}
    return write_dflash(tmp_path / "deq", plain_cfg, out, dtype="f32")


@pytest.mark.parametrize(("generation", "codebooks"), [(1, False), (2, False), (2, True)])
def test_mlx_quantized_drafter_loads_as_affine_and_drafts_as_its_dequantized_twin(
        tiny_llama, tmp_path, generation, codebooks):
    path, cfg = _quantized(tmp_path, generation, codebooks=codebooks)
    ckpt = load_dflash(path)
    assert isinstance(ckpt.weights.fc, AffineWeight) and ckpt.weights.fc.bits == 4
    assert all(isinstance(x, AffineWeight) for x in (ckpt.weights.layers[0].q, ckpt.weights.layers[1].down))
    if generation == 2:
        conv = ckpt.weights.layers[0].attention_conv
        assert conv is not None and isinstance(conv.kernel_projection, AffineWeight)
        assert ckpt.weights.selector is not None
        assert ckpt.weights.selector.predecessor_codebook.dtype == np.float32
    twin = load_dflash(_dequantized_folder(tmp_path, ckpt, cfg))
    assert isinstance(twin.weights.fc, DenseWeight)
    ops = CpuOps(int8_x=False)  # float32 x: the quantized drafter against its dequantized twin
    target = tiny_llama.weights
    models = [DFlashModel(c, ops, ops.upload_linear(target.embed), ops.upload_linear(target.lm_head))
              for c in (ckpt, twin)]
    rng = np.random.default_rng(0)
    features = rng.standard_normal((9, 2 * 64)).astype(np.float32)
    outs = []
    for model in models:
        ring = model.new_ring(16)
        model.write_context(ring, features, np.arange(9, dtype=np.int64))
        logits, _ = model.block_logits(ring, 9, 17)
        outs.append((np.asarray(logits), model.propose(ring, 9, 17)))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=2e-4, atol=2e-4)
    assert (outs[0][1] == outs[1][1]).mean() >= 0.6


@pytest.mark.asyncio
@pytest.mark.parametrize("generation", [1, 2])
async def test_drafted_equals_plain_with_an_mlx_quantized_drafter(tiny_llama, tmp_path, generation):
    path, _ = _quantized(tmp_path, generation)
    opts = dict(device="cpu", parallel=2, ctx=128, page_size=4, step_tokens=16)
    params = [{"max_tokens": 12}, {"max_tokens": 12, "temperature": 0.8, "seed": 3}]
    async with Engine(tiny_llama, **opts) as eng:
        plain = [(await eng.complete(PROMPTS[i], **p)).token_ids for i, p in enumerate(params)]
    async with Engine(tiny_llama, **opts, drafter=f"dflash:{path}", draft_tokens=3) as eng:
        got = [(await eng.complete(PROMPTS[i], **p)).token_ids for i, p in enumerate(params)]
        stats = eng.parts.scheduler.drafter_stats()
    assert got == plain and stats["drafted_tokens"] > 0


def test_scales_without_a_quantization_entry_is_a_clear_error(tmp_path):
    path, cfg = _quantized(tmp_path, 1)
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match="no 'quantization'"):
        load_dflash(path)


def test_unsupported_bits_is_a_clear_error(tmp_path):
    path, _ = _quantized(tmp_path, 1, quant={"group_size": 32, "bits": 3})
    with pytest.raises(ModelFormatError, match="unsupported quantization"):
        load_dflash(path)
