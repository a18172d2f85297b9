"""Tensor parallel split/merge on the CPU with the fake communicator: sharded weights merged
give the unsharded results (column-parallel parts exactly, row-parallel sums within float
tolerance), the arena splits by KV heads, bad TP sizes are refused, and TP=2 against TP=1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny import random_hf_weights, tiny_config
from tf_async import BadInputError, Engine
from tf_async.backend.comm import FakeCommunicator, make_group
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.weights import DenseWeight, quantize_affine
from tf_async.models.batch_io import ForwardBatch
from tf_async.models.checkpoint import Checkpoint
from tf_async.models.decoder import Decoder
from tf_async.models.loader import load_checkpoint
from tf_async.models.tp_decoder import ShardedKV, TPDecoder
from tf_async.models.tp_shard import check_tensor_parallel, shard_checkpoint, slice_in, slice_out

PAGE = 4
RNG = np.random.default_rng(11)
WEIGHTS = {"dense": DenseWeight((RNG.standard_normal((96, 128)) / 8).astype(np.float32)),
           "affine4": quantize_affine((RNG.standard_normal((96, 128)) / 8).astype(np.float32), 4, 32),
           "affine8": quantize_affine((RNG.standard_normal((96, 128)) / 8).astype(np.float32), 8, 32)}


def write_tiny(tmp_path: Path, arch: str = "llama", *, mlx: bool = False, **overrides) -> Checkpoint:
    from tests.tiny_hf import write_hf, write_mlx

    cfg = tiny_config(arch, **overrides)
    weights = random_hf_weights(cfg, seed=5)
    folder = (write_mlx if mlx else write_hf)(tmp_path / f"{arch}-{mlx}", cfg, weights)
    return load_checkpoint(folder)


# ---------------------------------------------------------------- the fake communicator
def test_fake_all_reduce_sums_in_rank_order_into_every_buffer():
    parts = [np.array([[1e8, 1.0, -3.5]], np.float32), np.array([[1.0, 2.0, 0.25]], np.float32),
             np.array([[-1e8, 4.0, 1.0]], np.float32)]
    expect = (parts[0] + parts[1]) + parts[2]  # float32, rank 0 first: 1e8 + 1 - 1e8 = 0
    FakeCommunicator(3).all_reduce(parts)
    for part in parts:
        np.testing.assert_array_equal(part, expect)
    assert parts[0][0, 0] == 0.0  # not the other order (1e8 - 1e8 + 1 = 1)


def test_fake_all_reduce_refuses_mismatched_buffers():
    with pytest.raises(ValueError, match="2 buffers for 3 ranks"):
        FakeCommunicator(3).all_reduce([np.zeros(2, np.float32)] * 2)
    with pytest.raises(ValueError, match="float32"):
        FakeCommunicator(2).all_reduce([np.zeros(2, np.float32), np.zeros(2, np.float64)])


# ---------------------------------------------------------------- weights
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
@pytest.mark.parametrize("size", [2, 4])
def test_column_parallel_slices_concatenate_to_the_full_matmul_exactly(kind, size):
    ops, w = CpuOps(), WEIGHTS[kind]
    x = RNG.standard_normal((5, 128)).astype(np.float32)
    share = w.out_features // size
    parts = [ops.linear(x, slice_out(w, r * share, (r + 1) * share)) for r in range(size)]
    np.testing.assert_array_equal(np.concatenate(parts, axis=-1), ops.linear(x, w))


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
@pytest.mark.parametrize("size", [2, 4])
def test_row_parallel_partials_all_reduced_give_the_full_matmul(kind, size):
    ops, w = CpuOps(), WEIGHTS[kind]
    x = RNG.standard_normal((5, 128)).astype(np.float32)
    share = w.in_features // size
    parts = [ops.linear(np.ascontiguousarray(x[:, r * share:(r + 1) * share]),
                        slice_in(w, r * share, (r + 1) * share)) for r in range(size)]
    FakeCommunicator(size).all_reduce(parts)
    np.testing.assert_allclose(parts[0], ops.linear(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(parts[0], parts[-1])


def test_row_parallel_slice_refuses_to_cut_a_quantization_group():
    with pytest.raises(BadInputError, match="quantization group"):
        slice_in(WEIGHTS["affine4"], 0, 48)


def test_moe_experts_split_by_intermediate_columns_sum_to_the_full_moe(tmp_path):
    ckpt = write_tiny(tmp_path, "qwen3_moe")
    ops, layer, cfg = CpuOps(), ckpt.weights.layers[0], ckpt.config
    x = RNG.standard_normal((7, cfg.hidden_size)).astype(np.float32)
    full = ops.moe(x, layer.router, layer.experts_gate, layer.experts_up, layer.experts_down,
                   cfg.num_experts_per_tok, cfg.norm_topk_prob)
    parts = [ops.moe(x, part.router, part.experts_gate, part.experts_up, part.experts_down,
                     cfg.num_experts_per_tok, cfg.norm_topk_prob)
             for part in (shard_checkpoint(ckpt, r, 2).weights.layers[0] for r in range(2))]
    FakeCommunicator(2).all_reduce(parts)
    np.testing.assert_allclose(parts[0], full, rtol=1e-5, atol=1e-6)


def test_shard_checkpoint_splits_heads_by_kv_groups_and_keeps_replicated_weights(tmp_path):
    ckpt = write_tiny(tmp_path, "llama", attention_bias=True)  # o_bias: rank 0 only
    cfg, full = ckpt.config, ckpt.weights.layers[0]
    hd = cfg.head_dim
    for rank in range(2):
        part = shard_checkpoint(ckpt, rank, 2)
        layer = part.weights.layers[0]
        assert (part.config.num_heads, part.config.num_kv_heads) == (2, 1)
        q_rows = slice(rank * 2 * hd, (rank + 1) * 2 * hd)  # q heads 2r, 2r+1 -> KV head r
        np.testing.assert_array_equal(layer.q.w, full.q.w[q_rows])
        np.testing.assert_array_equal(layer.k.w, full.k.w[rank * hd:(rank + 1) * hd])
        np.testing.assert_array_equal(layer.o.w, full.o.w[:, q_rows])
        np.testing.assert_array_equal(layer.down.w, full.down.w[:, rank * 48:(rank + 1) * 48])
        assert (layer.o_bias is not None) == (rank == 0)
        assert part.weights.embed is ckpt.weights.embed and layer.input_norm is full.input_norm


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(("overrides", "size", "what"), [
    ({}, 3, "KV heads"), ({}, 4, "KV heads"),
    ({"num_key_value_heads": 4, "intermediate_size": 90}, 4, "intermediate size")])
def test_a_size_that_does_not_divide_the_model_is_refused(tmp_path, overrides, size, what):
    ckpt = write_tiny(tmp_path, **overrides)
    with pytest.raises(BadInputError, match=what):
        check_tensor_parallel(ckpt, size)
    with pytest.raises(BadInputError, match=what) as info:
        _start(ckpt, tensor_parallel=size)
    assert info.value.param == "tensor_parallel"


def test_quantized_groups_cut_by_the_split_are_refused(tmp_path):
    # o: 64 columns, down: 128, groups of 32: TP=2 keeps whole groups, TP=4 cuts o's
    ckpt = write_tiny(tmp_path, mlx=True, num_key_value_heads=4, intermediate_size=128)
    check_tensor_parallel(ckpt, 2)
    with pytest.raises(BadInputError, match="quantization groups"):
        check_tensor_parallel(ckpt, 4)


def test_more_ranks_than_gpus_and_model_drafters_are_refused(tmp_path):
    with pytest.raises(BadInputError, match="needs 64 GPUs"):
        make_group("cuda", 64)
    with pytest.raises(BadInputError, match="ngram and draft:PATH drafters") as info:
        Engine(None, device="cpu", tensor_parallel=2, drafter="mtp")
    assert info.value.param == "drafter"
    with pytest.raises(BadInputError, match="a drafter area a lane") as info:
        Engine(None, device="cpu", tensor_parallel=2, drafter="draft:x", parallel=4, draft_areas=2)
    assert info.value.param == "draft_areas"
    with pytest.raises(BadInputError, match=r"tensor_parallel must be in \[1, 64\]"):
        Engine(None, device="cpu", tensor_parallel=0)


def _start(ckpt: Checkpoint, **kw) -> None:
    from tf_async.engine.build import build_engine
    from tf_async.engine.options import EngineOptions

    build_engine(EngineOptions(ckpt, device="cpu", ctx=64, parallel=1, **kw), lambda events: None)


# ---------------------------------------------------------------- the split arena
def forward_rows(decoder, tokens: list[int], kv) -> np.ndarray:
    """All rows of one prompt through a page table out of order; logits of every row."""
    rows = len(tokens)
    table = np.array([list(reversed(range(int(kv.shape[2]) // PAGE)))], np.int32)
    pos = np.arange(rows, dtype=np.int64)
    slots = table[0, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE
    batch = ForwardBatch(np.asarray(tokens, np.int64), pos, slots, np.zeros(rows, np.int32), table,
                         pos.copy(), PAGE)
    scales = np.ones((decoder.config.num_layers, 2), np.float32)
    logits, _ = decoder.forward(batch, kv, scales)
    return logits


def tp_decoder(ckpt: Checkpoint, size: int) -> TPDecoder:
    rank_ops, comm = make_group("cpu", size)
    return TPDecoder(ckpt, rank_ops, comm)


@pytest.mark.parametrize(("arch", "size", "mlx"), [
    ("llama", 2, False), ("qwen3", 2, False), ("qwen3_moe", 2, False), ("llama", 4, False),
    ("qwen2", 2, False), ("llama", 2, True)])
def test_rank_r_arena_holds_kv_heads_of_its_share_and_logits_match(tmp_path, arch, size, mlx):
    ckpt = write_tiny(tmp_path, arch, mlx=mlx, num_key_value_heads=4, intermediate_size=128)
    cfg, tokens = ckpt.config, [int(t) for t in RNG.integers(3, 300, 19)]
    plain, split = Decoder(ckpt, CpuOps()), tp_decoder(ckpt, size)
    kv = plain.ops.alloc_kv(cfg.num_layers, 8 * PAGE, cfg.num_kv_heads, cfg.head_dim, "f32")
    sharded = split.alloc_kv(8 * PAGE, "f32")
    assert isinstance(sharded, ShardedKV) and sharded.shape == kv.shape
    logits, tp_logits = forward_rows(plain, tokens, kv), forward_rows(split, tokens, sharded)
    per_rank = cfg.num_kv_heads // size
    for rank, part in enumerate(sharded.ranks):
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        assert sharded.heads_of(rank) == range(heads.start, heads.stop)
        # layer 0's K/V come from the embedding through column-parallel k, v: exact
        np.testing.assert_array_equal(part[0], kv[0][:, :, heads])
        np.testing.assert_allclose(part, kv[:, :, :, heads], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tp_logits, logits, rtol=1e-5, atol=1e-5)


def test_tp2_logprobs_match_tp1_on_the_gate_prompts(tiny_llama):
    """TP=2 against TP=1, every row of every gate prompt: log-probs within 1e-4 (the only
    difference is the order of the row-parallel sums)."""
    from tf_async.gate import PROMPTS

    cfg = tiny_llama.config
    plain, split = Decoder(tiny_llama, CpuOps()), tp_decoder(tiny_llama, 2)
    worst = 0.0
    for prompt in PROMPTS:
        tokens = tiny_llama.tokenizer.encode(prompt)
        pages = -(-len(tokens) // PAGE)
        kv = plain.ops.alloc_kv(cfg.num_layers, pages * PAGE, cfg.num_kv_heads, cfg.head_dim, "f32")
        a = log_softmax(forward_rows(plain, tokens, kv))
        b = log_softmax(forward_rows(split, tokens, split.alloc_kv(pages * PAGE, "f32")))
        worst = max(worst, float(np.abs(a - b).max()))
        assert (a.argmax(-1) == b.argmax(-1)).all()
    print(f"TP=2 vs TP=1: max |logprob difference| {worst:.3g} over the gate prompts")
    assert worst < 1e-4


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---------------------------------------------------------------- Qwen3.5 hybrids
def write_hybrid(tmp_path: Path, moe: bool, *, mlx: bool = False) -> Checkpoint:
    from tests import tiny_qwen35 as tq

    # FFN columns that split into whole groups of 32 at TP=2 (MLX)
    sizes = (dict(moe_intermediate_size=64, shared_expert_intermediate_size=64) if moe
             else dict(intermediate_size=128))
    cfg = tq.tiny_qwen35_config(moe=moe, **sizes)
    weights = tq.random_qwen35_weights(cfg, seed=7)
    folder = tmp_path / f"hybrid-{moe}-{mlx}"
    if mlx:
        return load_checkpoint(tq.write_qwen35_mlx(folder, cfg, weights, 4, 32))
    return load_checkpoint(tq.write_qwen35_hf(folder, cfg, weights, "f32"))


def test_hybrid_gdn_split_keeps_each_value_head_with_its_key_head(tmp_path):
    from tf_async.models.tp_hybrid import shard_hybrid_checkpoint

    ckpt = write_hybrid(tmp_path, moe=False)
    hyb, full = ckpt.weights.hybrid, ckpt.weights.layers[0].mixer
    hk, dk, dv = hyb.linear_num_key_heads, hyb.linear_key_head_dim, hyb.linear_value_head_dim
    for rank in range(2):
        mixer = shard_hybrid_checkpoint(ckpt, rank, 2).weights.layers[0].mixer
        key = np.arange(rank * dk, (rank + 1) * dk)  # key head r (value heads 2r, 2r+1 read it)
        value = np.arange(2 * rank * dv, 2 * (rank + 1) * dv)
        rows = np.concatenate([key, hk * dk + key, 2 * hk * dk + value])
        np.testing.assert_array_equal(mixer.conv, full.conv[rows])
        np.testing.assert_array_equal(mixer.in_qkv.w, full.in_qkv.w[rows])
        np.testing.assert_array_equal(mixer.out.w, full.out.w[:, value])
        np.testing.assert_array_equal(mixer.a_log, full.a_log[2 * rank: 2 * rank + 2])


@pytest.mark.parametrize(("moe", "mlx"), [(False, False), (True, False), (True, True)])
def test_hybrid_tp2_logits_kv_and_states_match_tp1(tmp_path, moe, mlx):
    from tf_async.models.qwen35 import HybridDecoder
    from tf_async.models.tp_hybrid import TPHybridDecoder

    ckpt = write_hybrid(tmp_path, moe, mlx=mlx)
    cfg = ckpt.config
    plain = HybridDecoder(ckpt, CpuOps())
    plain.attach_states(plain.new_states(1))
    rank_ops, comm = make_group("cpu", 2)
    split = TPHybridDecoder(ckpt, rank_ops, comm, num_lanes=1)
    tokens = [int(t) for t in RNG.integers(3, 300, 13)]
    kv = plain.ops.alloc_kv(cfg.num_layers, 4 * PAGE, cfg.num_kv_heads, cfg.head_dim, "f32")
    sharded = split.alloc_kv(4 * PAGE, "f32")
    logits = forward_rows_hybrid(plain, tokens, kv)
    np.testing.assert_allclose(forward_rows_hybrid(split, tokens, sharded), logits,
                               rtol=1e-4, atol=1e-4)
    for rank, part in enumerate(sharded.ranks):
        heads = sharded.heads_of(rank)
        np.testing.assert_allclose(part, kv[:, :, :, heads.start:heads.stop], rtol=1e-4, atol=1e-4)
        state = split.states.ranks[rank]
        hv = ckpt.weights.hybrid.linear_num_value_heads // 2
        assert state.delta.shape[2] == hv  # its value heads' delta-rule state only
        np.testing.assert_allclose(state.delta, plain.states.delta[:, :, rank * hv:(rank + 1) * hv],
                                   rtol=1e-4, atol=1e-4)


def forward_rows_hybrid(decoder, tokens: list[int], kv) -> np.ndarray:
    """forward_rows with lane 0's recurrent state (zeroed first)."""
    decoder.states.zero(0)
    rows = len(tokens)
    table = np.array([list(range(int(kv.shape[2]) // PAGE))], np.int32)
    pos = np.arange(rows, dtype=np.int64)
    batch = ForwardBatch(np.asarray(tokens, np.int64), pos, pos.copy(), np.zeros(rows, np.int32),
                         table, pos.copy(), PAGE, seq_lanes=np.zeros(1, np.int32))
    logits, _ = decoder.forward(batch, kv, np.ones((decoder.config.num_layers, 2), np.float32))
    return logits


def test_hybrid_sizes_that_do_not_divide_are_refused(tmp_path):
    from tf_async.models.tp_hybrid import check_hybrid_tensor_parallel

    ckpt = write_hybrid(tmp_path, moe=False)
    check_hybrid_tensor_parallel(ckpt, 2)
    with pytest.raises(BadInputError, match="KV heads"):
        check_hybrid_tensor_parallel(ckpt, 4)
    with pytest.raises(BadInputError, match="KV heads") as info:
        _start(ckpt, tensor_parallel=4)
    assert info.value.param == "tensor_parallel"


def test_a_tp2_run_checked_against_a_tp1_baseline_within_1e4(tiny_llama):
    """`tf-async gate --against FILE --tensor-parallel 2`: the recorded TP=1 requests at TP=2,
    tokens equal and log-probs within 1e-4 in every section (flags off, paging, contiguous,
    resumed)."""
    import asyncio

    from tf_async import baseline

    settings = baseline.BaselineSettings(device="cpu", max_tokens=6, num_prompts=2)
    doc = asyncio.run(baseline.record(tiny_llama, settings, reason="test"))
    results = asyncio.run(baseline.check(tiny_llama, doc, tolerance=1e-4, tensor_parallel=2))
    assert len(results) == len(baseline.SECTIONS)
    assert all(r.ok for r in results), [r.mismatches for r in results]
