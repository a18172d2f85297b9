"""transformers' greedy continuation of a prompt, for the comparisons against transformers
(tests/test_vs_transformers.py, tests/test_qwen35_vs_transformers.py; torch imported here
only when called)."""

from __future__ import annotations

from typing import Any

import numpy as np


def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> tuple[list[int], np.ndarray]:
    """A transformers causal LM's greedy tokens after `prompt` (no cache: the whole sequence
    each step) and the float64 log-softmax of each step's logits."""
    import torch

    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logprobs.append(torch.log_softmax(logits, -1).numpy())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], np.stack(logprobs)
