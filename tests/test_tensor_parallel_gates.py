"""The gates within a tensor-parallel size, through the Engine on the CPU with the fake
communicator (concurrent == solo, paged with small pages == contiguous, stepped == whole,
decode steps, resumed == fresh, drafted == plain with ngram, bit for bit; idle is empty),
and TP=2 against TP=1 greedy tokens on the gate prompts."""

from __future__ import annotations

import pytest

from tests.tiny import random_hf_weights, tiny_config
from tf_async import Engine
from tf_async.gate import PROMPTS, generate, run_gates
from tf_async.models.tp_decoder import TPDecoder

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def tiny_four_kv_heads(tmp_path_factory: pytest.TempPathFactory):
    """A tiny qwen3 whose 4 KV heads split over 2 or 4 ranks."""
    from tests.tiny_hf import write_hf
    from tf_async.models.loader import load_checkpoint

    cfg = tiny_config("qwen3", num_key_value_heads=4)
    return load_checkpoint(write_hf(tmp_path_factory.mktemp("tp_qwen3"), cfg,
                                    random_hf_weights(cfg, seed=2)))


@pytest.mark.parametrize("size", [2, 4])
async def test_every_gate_holds_within_a_tp_size(tiny_four_kv_heads, size):
    rows, idle = await run_gates(tiny_four_kv_heads, device="cpu", max_tokens=12, ctx=128,
                                 drafter="ngram", tensor_parallel=size, page_size=4)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert any(r.name.startswith("drafted == plain") for r in rows)
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())


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
