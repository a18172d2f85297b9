"""Plain dataclasses that cross the API boundary (engine -> loop -> callers / server)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class SamplingParams:
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
