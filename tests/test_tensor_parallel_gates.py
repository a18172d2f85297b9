"""The gates within a tensor-parallel size, through the Engine on the CPU with the fake
communicator (concurrent == solo, paged with small pages == contiguous, stepped == whole,
decode steps, resumed == fresh, drafted == plain with ngram, bit for bit; idle is empty),
and TP=2 against TP=1 greedy tokens on the gate prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import random_hf_weights, tiny_config
from tf_async import Engine
from tf_async.gate import PROMPTS, generate, run_gates
from tf_async.models.tp_decoder import TPDecoder

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny qwen3 whose 4 KV heads split over 2 or 4 ranks, and a different tiny llama
    (same tokenizer) to draft for it."""
    from tests.tiny_hf import write_hf

    target = tiny_config("qwen3", num_key_value_heads=4)
    draft = tiny_config("llama", num_hidden_layers=1, num_key_value_heads=4)
    return {"target": write_hf(tmp_path_factory.mktemp("tp_qwen3"), target,
                               random_hf_weights(target, seed=2)),
            "draft": write_hf(tmp_path_factory.mktemp("tp_draft"), draft,
                              random_hf_weights(draft, seed=9))}


@pytest.fixture(scope="module")
def tiny_four_kv_heads(tiny_dirs):
    from tf_async.models.loader import load_checkpoint

    return load_checkpoint(tiny_dirs["target"])


@pytest.mark.parametrize("size", [2, 4])
async def test_every_gate_holds_within_a_tp_size(tiny_four_kv_heads, size):
    rows, idle = await run_gates(tiny_four_kv_heads, device="cpu", max_tokens=12, ctx=128,
                                 drafter="ngram", tensor_parallel=size, page_size=4)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert any(r.name.startswith("drafted == plain") for r in rows)
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())


@pytest.mark.parametrize("size", [2, 4])
async def test_drafted_equals_plain_with_a_draft_model_whose_ring_splits_by_heads(
        tiny_dirs, tiny_four_kv_heads, size):
    """draft:PATH at TP: the draft model is itself split (a TPDecoder), each rank's drafter
    area holds its KV heads' ring; the target as its own drafter accepts every draft."""
    drafters = (f"draft:{tiny_dirs['draft']}", f"draft:{tiny_dirs['target']}")
    rows, idle = await run_gates(tiny_four_kv_heads, device="cpu", max_tokens=10, ctx=128,
                                 drafters=drafters, tensor_parallel=size, page_size=4)
    drafted = [r for r in rows if r.name.startswith("drafted == plain")]
    assert len(drafted) == 4 and all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert all(s.get("draft_areas_in_use", 0) == 0 for s in idle.values())
    async with Engine(tiny_four_kv_heads, device="cpu", parallel=2, ctx=128, page_size=4,
                      tensor_parallel=size, drafter=f"draft:{tiny_dirs['target']}") as eng:
        await eng.complete(PROMPTS[0], max_tokens=12)
        region = eng.parts.runner.arena.drafter_region
        per_rank = {int(part.nbytes) for part in region.ranks}
        stats = eng.stats()
    assert len(region.ranks) == size and len(per_rank) == 1  # the same offsets on every rank
    assert stats["accepted_tokens"] == stats["drafted_tokens"] > 0, stats


async def test_tp2_greedy_tokens_equal_tp1_on_the_gate_prompts(tiny_llama):
    outs = {}
    for size in (1, 2):
        async with Engine(tiny_llama, device="cpu", parallel=4, ctx=256, page_size=4,
                          step_tokens=32, tensor_parallel=size) as eng:
            assert isinstance(eng.parts.decoder, TPDecoder) == (size > 1)
            outs[size] = await generate(eng, list(PROMPTS), "greedy", 16, concurrent=True)
    assert all(len(tokens) == 16 for tokens in outs[1])
    assert outs[2] == outs[1]


@pytest.mark.parametrize("moe", [False, True])
async def test_every_gate_holds_at_tp2_on_a_hybrid(tmp_path, moe):
    """Qwen3.5 hybrids (GDN heads and their recurrent state split by value heads) at TP=2."""
    from tests import tiny_qwen35 as tq
    from tf_async.models.loader import load_checkpoint

    cfg = tq.tiny_qwen35_config(moe=moe)
    ckpt = load_checkpoint(tq.write_qwen35_hf(tmp_path, cfg, tq.random_qwen35_weights(cfg, seed=5),
                                              "bf16"))
    rows, idle = await run_gates(ckpt, device="cpu", max_tokens=10, ctx=128, drafter="ngram",
                                 tensor_parallel=2, page_size=4)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    async with Engine(ckpt, device="cpu", parallel=4, ctx=128, page_size=4, step_tokens=16) as eng:
        tp1 = await generate(eng, list(PROMPTS), "greedy", 16, concurrent=True)
    async with Engine(ckpt, device="cpu", parallel=4, ctx=128, page_size=4, step_tokens=16,
                      tensor_parallel=2) as eng:
        assert await generate(eng, list(PROMPTS), "greedy", 16, concurrent=True) == tp1
