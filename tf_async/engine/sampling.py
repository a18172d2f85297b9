"""Host-side sampling of one logits row.

Seeded randomness is drawn from (seed, position) only, so a seeded stream samples the same
token at a position alone, in any batch, drafted or plain.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..api_types import SamplingParams


def uniform_at(seed: int, pos: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, pos)."""
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, pos]).random())


def top_logprobs(logits: np.ndarray, chosen: int, top_n: int) -> dict[int, float]:
    """Top-n log-softmax of the raw logits, chosen token included."""
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max()).sum()) + x.max()
    ids = np.argsort(-x, kind="stable")[:top_n] if top_n > 0 else np.empty(0, np.int64)
    out = {int(i): float(x[i] - lse) for i in ids}
    out[int(chosen)] = float(x[chosen] - lse)
    return out


def adjust_logits(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int],
                  output_ids: list[int], stop_ids: frozenset[int] = frozenset()) -> np.ndarray:
    """The logits [V] the host sampler draws from: penalties, logit_bias, and the stop ids
    masked while fewer than min_tokens are out. A function of this row's request only."""
    if not params.needs_host:
        return logits
    x = logits.astype(np.float32).copy()
    if params.repetition_penalty != 1.0:
        seen = np.fromiter(set(prompt_ids) | set(output_ids), dtype=np.int64)
        vals = x[seen]
        x[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = Counter(output_ids)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        freq = np.fromiter(counts.values(), dtype=np.float32)
        x[ids] -= params.frequency_penalty * freq + params.presence_penalty
    for token, bias in params.logit_bias:
        x[token] += bias
    if len(output_ids) < params.min_tokens and stop_ids:
        x[np.fromiter(stop_ids, dtype=np.int64)] = -np.inf
    return x


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, pos: int) -> int:
    """Pick the token for position `pos` from (penalised) logits [V]."""
    if params.temperature == 0.0 or params.top_k == 1:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    order = _candidates(x, params)
    xs = x[order]
    probs = np.exp(xs - xs.max())
    probs /= probs.sum()
    keep = len(probs)
    if params.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= params.min_p * probs[0]))))
    cdf = np.cumsum(probs[:keep])
    index = int(np.searchsorted(cdf, uniform_at(seed, pos) * cdf[-1], side="right"))
    return int(order[min(index, keep - 1)])


def _candidates(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Token ids to sample from, in descending logit order (ties: lower id first) where a
    truncation needs the order; plain temperature sampling needs no sort at all."""
    if params.top_k > 0:
        part = np.argpartition(-x, min(params.top_k, len(x) - 1))[: params.top_k]
        return part[np.lexsort((part, -x[part]))]
    if params.top_p < 1.0 or params.min_p > 0.0:
        # Tokens more than 40 nats below the best hold < 5e-18 of the mass each: never kept.
        near = np.flatnonzero(x >= x.max() - 40.0)
        return near[np.lexsort((near, -x[near]))]
    return np.arange(len(x))
