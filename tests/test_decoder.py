"""The decoder against an independent float64 reference, and stepped == whole bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from tests.reference import reference_logits
from tests.tiny import random_hf_weights, tiny_config
from tf_async.backend.cpu.ops import CpuOps
from tf_async.models.checkpoint import dense_hf_state
from tf_async.models.decoder import Decoder, ForwardBatch
from tf_async.models.loader import load_checkpoint

PAGE = 4


def run_steps(decoder: Decoder, tokens: list[int], cuts: list[int], kv_dtype: str = "f32") -> np.ndarray:
    """Feed `tokens` in chunks of the given sizes through a scattered page table; logits of every row."""
    ops, cfg = decoder.ops, decoder.config
    num_pages = -(-len(tokens) // PAGE) + 3
    kv = ops.alloc_kv(cfg.num_layers, num_pages * PAGE, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    scales = np.full((cfg.num_layers, 2), 0.05, np.float32)
    table = np.array([list(reversed(range(num_pages)))], np.int32)  # pages out of order
    out, start = [], 0
    for size in cuts:
        pos = np.arange(start, start + size, dtype=np.int64)
        slots = table[0, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
        batch = ForwardBatch(np.asarray(tokens[start:start + size], np.int64), pos, slots,
                             np.zeros(size, np.int32), table, np.arange(size, dtype=np.int64), PAGE)
        logits, _ = decoder.forward(batch, kv, scales)
        out.append(logits)
        start += size
    return np.concatenate(out)


def cuts_of(total: int, step: int) -> list[int]:
    return [min(step, total - s) for s in range(0, total, step)]


ARCHS = [("llama", {}), ("llama", {"tie_word_embeddings": False, "attention_bias": True}),
         ("qwen2", {}), ("qwen3", {}), ("qwen3_moe", {}),
         ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
         ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
         ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})]


@pytest.mark.parametrize(("arch", "extra"), ARCHS)
def test_logits_match_float64_reference_and_steps_are_bit_identical(tmp_path, arch, extra):
    from tests.tiny_hf import write_hf

    cfg = tiny_config(arch, **extra)
    weights = random_hf_weights(cfg, seed=3)
    decoder = Decoder(load_checkpoint(write_hf(tmp_path, cfg, weights)), CpuOps())
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, cfg["vocab_size"], 23)]
    whole = run_steps(decoder, tokens, [len(tokens)])
    ref = reference_logits(cfg, weights, tokens)
    np.testing.assert_allclose(whole, ref, rtol=2e-4, atol=2e-4)
    for step in (1, 3, 7):
        assert np.array_equal(run_steps(decoder, tokens, cuts_of(len(tokens), step)), whole), step


@pytest.mark.parametrize("fmt", ["mlx4", "mlx8", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_quantized_checkpoints_match_reference_on_their_dequantized_weights(tmp_path, fmt):
    from tests.tiny_gguf import write_gguf
    from tests.tiny_hf import write_mlx

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2)
    weights = random_hf_weights(cfg, seed=5)
    if fmt.startswith("mlx"):
        path = write_mlx(tmp_path, cfg, weights, bits=int(fmt[3:]), group_size=64)
    else:
        path = write_gguf(tmp_path / "m.gguf", cfg, weights, qtype=fmt)
    ckpt = load_checkpoint(path)
    decoder = Decoder(ckpt, CpuOps(int8_x=False))  # float32 x: the reference's arithmetic
    tokens = [5, 9, 77, 200, 13, 42, 8]
    whole = run_steps(decoder, tokens, [len(tokens)])
    ref = reference_logits(cfg, dequantized_hf(ckpt), tokens)
    np.testing.assert_allclose(whole, ref, rtol=1e-3, atol=1e-3)
    assert np.array_equal(run_steps(decoder, tokens, [1] * len(tokens)), whole)


def dequantized_hf(ckpt) -> dict[str, np.ndarray]:
    """HF-named float64 weights of a loaded checkpoint (what the quantized file really holds)."""
    return {k: np.asarray(v, np.float64) for k, v in dense_hf_state(ckpt.weights).items()}


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_low_precision_kv_is_stepped_equal_whole_and_close_to_f32(tmp_path, kv_dtype):
    from tests.tiny_hf import write_hf

    cfg = tiny_config("qwen3")
    decoder = Decoder(load_checkpoint(write_hf(tmp_path, cfg, random_hf_weights(cfg, seed=4))), CpuOps())
    tokens = list(range(3, 20))
    whole = run_steps(decoder, tokens, [len(tokens)], kv_dtype)
    assert np.array_equal(run_steps(decoder, tokens, cuts_of(len(tokens), 3), kv_dtype), whole)
    f32 = run_steps(decoder, tokens, [len(tokens)])
    rel = np.abs(whole - f32).max() / np.abs(f32).max()
    assert rel < (0.02 if kv_dtype == "bf16" else 0.1), rel
    assert (whole.argmax(-1) == f32.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize(("arch", "extra"), ARCHS[:5])
@pytest.mark.parametrize("kv_dtype", ["f32", "fp8"])
def test_cpu_runs_the_fused_layer_code_with_the_bits_of_the_basic_ops(tmp_path, arch, extra, kv_dtype):
    """The CPU's layer ops (CpuOps.concat_linears, attn_inputs, ...) are the basic ops they
    stand for: the decoder's fused layer code gives the same bits as the per-op fallback."""
    from tests.tiny_hf import write_hf

    cfg = tiny_config(arch, **extra)
    ckpt = load_checkpoint(write_hf(tmp_path, cfg, random_hf_weights(cfg, seed=5)))
    fused, basic = Decoder(ckpt, CpuOps()), Decoder(ckpt, CpuOps())
    assert all(layer is not None for layer in fused.fused)  # every layer runs the fused code
    basic.fused = [None] * len(basic.fused)  # every layer through _attention and _mlp
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, cfg["vocab_size"], 13)]
    for cuts in ([13], [5, 1, 7]):
        assert np.array_equal(run_steps(fused, tokens, cuts, kv_dtype),
                              run_steps(basic, tokens, cuts, kv_dtype))
