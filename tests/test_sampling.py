"""Sampling: the distribution, truncations, penalties and (seed, position) reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from tf_async.api_types import SamplingParams, choice_seed
from tf_async.engine.sampling import adjust_logits, sample_token, top_logprobs
from tf_async.errors import BadInputError

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32))


def freqs(params, draws: int = 4000) -> np.ndarray:
    counts = np.bincount([sample_token(LOGITS, params, 7, pos) for pos in range(draws)], minlength=5)
    return counts / draws


def test_temperature_one_follows_softmax_and_truncations_cut_the_tail():
    assert np.abs(freqs(SamplingParams(temperature=1.0)) - [0.5, 0.2, 0.15, 0.1, 0.05]).max() < 0.03
    top2 = freqs(SamplingParams(temperature=1.0, top_k=2))
    assert top2[2:].sum() == 0 and abs(top2[0] - 0.5 / 0.7) < 0.03
    nucleus = freqs(SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 + 0.15 reaches 0.8
    assert nucleus[3:].sum() == 0 and nucleus[2] > 0
    minp = freqs(SamplingParams(temperature=1.0, min_p=0.25))  # keeps p >= 0.125
    assert minp[3:].sum() == 0 and minp[2] > 0


def test_greedy_and_seeded_draws_depend_only_on_seed_and_position():
    assert sample_token(LOGITS, SamplingParams(), 1, 0) == 0
    p = SamplingParams(temperature=1.0, top_p=0.9)
    a = [sample_token(LOGITS, p, 3, pos) for pos in range(50)]
    assert a == [sample_token(LOGITS, p, 3, pos) for pos in range(50)]
    assert a != [sample_token(LOGITS, p, 4, pos) for pos in range(50)]


def test_penalties_and_logprobs():
    x = np.array([2.0, -1.0, 0.5], np.float32)
    rep = adjust_logits(x, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert np.allclose(rep, [1.0, -2.0, 0.5])
    pres = adjust_logits(x, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [], [2, 2])
    assert np.allclose(pres, [2.0, -1.0, 0.5 - 1.0 - 1.0])
    lp = top_logprobs(x, 1, 1)
    assert set(lp) == {0, 1} and np.isclose(np.exp(list(lp.values())).sum(), (np.exp(2) + np.exp(-1)) / np.exp(x).sum())


def test_logit_bias_and_min_tokens_shape_the_row():
    x = np.array([2.0, -1.0, 0.5], np.float32)
    biased = adjust_logits(x, SamplingParams.of(logit_bias={"1": 5.0, 0: -100}), [], [])
    assert np.allclose(biased, [-98.0, 4.0, 0.5])
    stop = frozenset({0})
    early = adjust_logits(x, SamplingParams(min_tokens=2, max_tokens=4), [], [1], stop)
    assert early[0] == -np.inf and np.allclose(early[1:], x[1:])
    late = adjust_logits(x, SamplingParams(min_tokens=2, max_tokens=4), [], [1, 2], stop)
    assert np.allclose(late, x)


def test_sampling_params_are_checked_once_naming_the_parameter():
    for kwargs, param in [(dict(top_p=0.0), "top_p"), (dict(max_tokens=0), "max_tokens"),
                          (dict(min_tokens=9, max_tokens=4), "min_tokens"),
                          (dict(logit_bias={"3": 101.0}), "logit_bias"), (dict(colour=1), "colour"),
                          (dict(stop=[""]), "stop")]:
        with pytest.raises(BadInputError) as info:
            SamplingParams.of(**kwargs)
        assert info.value.param == param
    p = SamplingParams.of(stop="x", stop_token_ids=[4], max_tokens=None, logit_bias={"7": 1})
    assert (p.stop, p.stop_token_ids, p.max_tokens, p.logit_bias) == (("x",), (4,), 256, ((7, 1.0),))


def test_choice_seeds_are_derived_and_reproducible():
    p = SamplingParams(temperature=1.0, seed=5)
    seeds = [p.for_choice(i, 5).seed for i in range(4)]
    assert seeds[0] == 5 and len(set(seeds)) == 4
    assert seeds == [choice_seed(5, i) for i in range(4)]
    assert all(0 <= s < 2**63 for s in seeds)
