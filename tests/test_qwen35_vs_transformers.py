"""Qwen3.5 hybrids against transformers' own qwen3_5 classes: greedy tokens and log-probs.

Skipped when transformers (with qwen3_5) or torch is not installed.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.hf_greedy import hf_greedy
from tests.tiny_qwen35 import (
    hf_effective_weights,
    random_qwen35_weights,
    tiny_qwen35_config,
    write_qwen35_hf,
)
from tf_async import Engine

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5")
qwen3_5_moe = pytest.importorskip("transformers.models.qwen3_5_moe")


def hf_model(cfg: dict, weights: dict[str, np.ndarray], moe: bool):
    """transformers' Qwen3_5(Moe)ForCausalLM holding the same (stored) weights, in f32."""
    args = {k: v for k, v in cfg.items() if k != "architectures"}
    if moe:
        model = qwen3_5_moe.Qwen3_5MoeForCausalLM(qwen3_5_moe.Qwen3_5MoeTextConfig(**args))
    else:
        model = qwen3_5.Qwen3_5ForCausalLM(qwen3_5.Qwen3_5TextConfig(**args))
    model = model.eval().float()
    state = {k.replace("model.language_model.", "model."): torch.from_numpy(np.ascontiguousarray(v, np.float32))
             for k, v in weights.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_matches_transformers(tmp_path, moe):
    cfg = tiny_qwen35_config(moe)
    weights = random_qwen35_weights(cfg, seed=2)
    folder = write_qwen35_hf(tmp_path, cfg, weights, dtype="f32")
    prompt = [5, 17, 42, 99, 7, 3, 250, 31]
    want_ids, want_lp = hf_greedy(hf_model(cfg, hf_effective_weights(weights, "f32"), moe), prompt, 10)

    async def ours():
        async with Engine(str(folder), device="cpu", parallel=1, ctx=128) as eng:
            return await eng.complete(prompt, max_tokens=10, logprobs=5, ignore_eos=True)

    got = asyncio.run(ours())
    assert got.token_ids == want_ids
    for step, lp in enumerate(got.logprobs):
        for token_id, value in lp.items():
            assert abs(value - want_lp[step, token_id]) < 1e-3, (step, token_id)
