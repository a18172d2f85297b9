"""Sampling: the distribution, truncations, penalties and (seed, position) reproducibility."""

from __future__ import annotations

import numpy as np

from tf_async.api import make_params
from tf_async.engine.sampling import apply_penalties, sample_token, top_logprobs

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def freqs(params, draws: int = 4000) -> np.ndarray:
    counts = np.bincount([sample_token(LOGITS, params, 7, pos) for pos in range(draws)], minlength=5)
    return counts / draws


def test_temperature_one_follows_softmax_and_truncations_cut_the_tail():
    assert np.abs(freqs(make_params(temperature=1.0)) - [0.5, 0.2, 0.15, 0.1, 0.05]).max() < 0.03
    top2 = freqs(make_params(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.7) < 0.03
    nucleus = freqs(make_params(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 + 0.15 reaches 0.8
    assert nucleus[3:].sum() == 0 and nucleus[2] > 0
    minp = freqs(make_params(temperature=1.0, min_p=0.25))  # keeps p >= 0.125
    assert minp[3:].sum() == 0 and minp[2] > 0


def test_greedy_and_seeded_draws_depend_only_on_seed_and_position():
    assert sample_token(LOGITS, make_params(), 1, 0) == 0
    p = make_params(temperature=1.0, top_p=0.9)
    a = [sample_token(LOGITS, p, 3, pos) for pos in range(50)]
    assert a == [sample_token(LOGITS, p, 3, pos) for pos in range(50)]
    assert a != [sample_token(LOGITS, p, 4, pos) for pos in range(50)]


def test_penalties_and_logprobs():
    x = np.array([2.0, -1.0, 0.5], np.float32)
    rep = apply_penalties(x, make_params(repetition_penalty=2.0), [0], [1])
    assert np.allclose(rep, [1.0, -2.0, 0.5])
    pres = apply_penalties(x, make_params(presence_penalty=1.0, frequency_penalty=0.5), [], [2, 2])
    assert np.allclose(pres, [2.0, -1.0, 0.5 - 1.0 - 1.0])
    lp = top_logprobs(x, 1, 1)
    assert set(lp) == {0, 1} and np.isclose(np.exp(list(lp.values())).sum(), (np.exp(2) + np.exp(-1)) / np.exp(x).sum())
