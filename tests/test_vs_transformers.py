"""Greedy tokens and log-probs against Hugging Face transformers on random tiny models.

Skipped when transformers (and torch) are not installed.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.hf_greedy import hf_greedy
from tests.tiny import random_hf_weights, tiny_config
from tf_async import Engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = [("llama", {}), ("qwen3", {}), ("qwen3_moe", {"norm_topk_prob": True}),
         ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": []})]


def folder_greedy(folder, prompt: list[int], num_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation of the checkpoint in `folder` (tests/hf_greedy.py)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return hf_greedy(model, prompt, num_tokens)


@pytest.mark.parametrize(("arch", "extra"), CASES)
def test_greedy_tokens_and_logprobs_match_transformers(tmp_path, arch, extra):
    from tests.tiny_hf import write_hf

    cfg = tiny_config(arch, **extra)
    folder = write_hf(tmp_path, cfg, random_hf_weights(cfg, seed=11))
    prompt = [5, 17, 42, 99, 7, 3, 250, 31]
    want_ids, want_lp = folder_greedy(folder, prompt, 12)

    async def ours():
        async with Engine(str(folder), device="cpu", parallel=1, ctx=128) as eng:
            return await eng.complete(prompt, max_tokens=12, logprobs=5, ignore_eos=True)

    got = asyncio.run(ours())
    assert got.token_ids == want_ids
    for step, (tok, lp) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
        for token_id, value in lp.items():
            assert abs(value - want_lp[step, token_id]) < 1e-3, (step, token_id, tok)
