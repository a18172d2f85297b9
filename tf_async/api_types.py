"""Plain dataclasses that cross the API boundary (engine -> loop -> callers / server)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from .errors import BadInputError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries in one logit_bias map (OpenAI's limit)
_MASK63 = (1 << 63) - 1


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise BadInputError(message, param=param)


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """A constraint on the generated text (constrained decoding, engine/grammar.py)."""

    kind: Literal["json_schema", "lark", "regex"]
    source: str  # the JSON schema's text, the Lark grammar or the regex
    param: str | None = None  # the request field it came from (for error messages)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """The sampling parameters of one request: defined here once, checked here once.

    `SamplingParams.of(**kwargs)` is how the Python API builds them (lists accepted where
    tuples are stored); the server maps its request schema onto this in one function."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probs per generated token (chosen token included)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are masked until this many
    grammar: GrammarSpec | None = None  # constrained decoding: the text must match it

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens must be an integer >= 1", "max_tokens")
        _check(math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature must be in [0, 100]", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]",
               "repetition_penalty")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]",
               "frequency_penalty")
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer", "seed")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= MAX_STOP_STRINGS,
               f"stop must be up to {MAX_STOP_STRINGS} non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be token ids", "stop_token_ids")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS
               and all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
               f"logit_bias must map up to {MAX_LOGIT_BIAS} token ids to values in [-100, 100]",
               "logit_bias")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens must be an integer in [0, max_tokens]", "min_tokens")

    @classmethod
    def of(cls, **kwargs: object) -> SamplingParams:
        """From keyword arguments as the Python API takes them: `stop` a string or a list,
        `stop_token_ids` a list, `logit_bias` a {token id: bias} dict, `max_tokens` None for
        the default. An unknown keyword is a BadInputError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise BadInputError(f"unknown sampling argument(s): {', '.join(unknown)}", param=unknown[0])
        stop = kwargs.get("stop")
        if isinstance(stop, str):
            kwargs["stop"] = (stop,)
        for name in ("stop", "stop_token_ids"):
            kwargs[name] = tuple(kwargs.get(name) or ())  # type: ignore[arg-type]
        kwargs["logit_bias"] = _bias_pairs(kwargs.get("logit_bias") or {})
        if kwargs.get("max_tokens") is None:
            kwargs.pop("max_tokens", None)
        return cls(**kwargs)  # type: ignore[arg-type]

    def for_choice(self, index: int, base_seed: int) -> SamplingParams:
        """The parameters of choice `index` of an n-choice request: choice 0 keeps
        `base_seed`, choice i > 0 draws from a seed derived from (base_seed, i), so each
        choice is reproducible alone (send that seed with n=1)."""
        return replace(self, seed=choice_seed(base_seed, index))

    @property
    def needs_host(self) -> bool:
        """Anything only the host sampler does (penalties, min_p, logprobs, bias, min_tokens,
        grammar masks)."""
        return (self.logprobs is not None or self.repetition_penalty != 1.0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_p > 0.0 or bool(self.logit_bias) or self.min_tokens > 0
                or self.grammar is not None)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """{token id (int or decimal string): bias} -> sorted (id, bias) pairs."""
    _check(isinstance(bias, dict), "logit_bias must be a {token id: bias} mapping", "logit_bias")
    assert isinstance(bias, dict)
    try:
        return tuple(sorted((int(t), float(b)) for t, b in bias.items()))
    except (TypeError, ValueError):
        raise BadInputError("logit_bias keys must be token ids and values numbers",
                            param="logit_bias") from None


def choice_seed(base_seed: int, index: int) -> int:
    """Seed of choice `index` (splitmix64 of base_seed + index, in [0, 2**63)); index 0: base."""
    if index == 0:
        return base_seed
    z = (base_seed + 0x9E3779B97F4A7C15 * index) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0  # extension: tokens proposed by the drafter
    accepted_tokens: int = 0  # extension: drafted tokens accepted by verification
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Delta:
    """One streamed piece. `finish_reason` is None until the last delta ("stop" or "length").

    `logprobs` has one dict per token of `token_ids` (token id -> log-prob) when asked for.
    `usage` is set on the last delta only."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    usage: Usage | None = None


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    usage: Usage = field(default_factory=Usage)
