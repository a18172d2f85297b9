"""Token choice where the logits are: which rows may be chosen on the device, the one
launch that chooses them, and the drafters' way of choosing drafts exactly as the target will.

The scheduler marks a logit row with a TokenChoice (integers and floats only) when its request
needs nothing host-only; the runner then chooses every marked row of a round in one device
launch (argmax, or the seeded sampler of cuda_kernels/sampling.py) and copies only the ids.
Backends without a device sampler (the CPU) keep engine/sampling.py's host path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..api_types import SamplingParams
from ..backend.base import DeviceSampler, Ops, device_sampler
from .sampling import adjust_logits, sample_token
from .sequence import TokenChoice

if TYPE_CHECKING:
    from .sequence import Sequence

_MASK64 = (1 << 64) - 1


def token_choice_at(seq: Sequence, pos: int) -> TokenChoice | None:
    """The device choice of seq's token at position `pos`, or None when the request needs the
    host: logprobs, any penalty, logit_bias, min_tokens or min_p (adjust_logits / sample_token). The parameters are
    static per request, so a request takes the same path every round (and drafted == plain
    holds on either path)."""
    p = seq.params
    if p.needs_host:
        return None
    # sample_token's greedy test; top_k == 1 with t > 0 would sample among exact ties on the
    # device, so it is sent as greedy too (argmax, lowest id)
    greedy = p.temperature == 0.0 or p.top_k == 1
    return TokenChoice(0.0 if greedy else p.temperature, p.top_k, p.top_p, seq.seed & _MASK64, pos)


def token_choices(seq: Sequence, num_rows: int) -> tuple[TokenChoice, ...]:
    """Device choices of the next `num_rows` logit rows, or () for the host path. Row i draws
    for position seq.num_tokens + i, the position sample_token gets at that row (when drafts
    are kept, each accepted token lengthens the sequence by one before the next row)."""
    first = token_choice_at(seq, seq.num_tokens) if num_rows else None
    if first is None:
        return ()
    return tuple(TokenChoice(first.temperature, first.top_k, first.top_p, first.seed, first.position + i)
                 for i in range(num_rows))


def choose_on_device(ops: Ops, sampler: DeviceSampler, logits: Any, choices: list[TokenChoice],
                     uploaded: tuple[Any, ...] | None = None) -> Any:
    """One launch over logits [rows, V] (device): argmax when every row is greedy, else the
    seeded sampler (which is argmax too at temperature 0). Both pick the largest logit with
    ties to the lowest id, exactly as sample_token's np.argmax (first maximum); they differ
    only on NaN logits, which the device skips and np.argmax returns. `uploaded`: the choices'
    arrays already on the device (choice_arrays). -> [rows] int64 (device)."""
    if all(c.greedy for c in choices):
        return sampler.argmax(logits)
    return sampler.sample(logits, *(uploaded if uploaded is not None else choice_arrays(ops, choices)))


def choice_arrays(ops: Ops, choices: list[TokenChoice]) -> tuple[Any, ...]:
    """The sampler's per-row arrays of `choices` on the ops' device: temperatures, top_k, top_p,
    seeds, positions."""
    put = ops.asarray
    return (put(np.asarray([c.temperature for c in choices], np.float32)),
            put(np.asarray([c.top_k for c in choices], np.int32)),
            put(np.asarray([c.top_p for c in choices], np.float32)),
            put(np.asarray([c.seed for c in choices], np.uint64)),
            put(np.asarray([c.position for c in choices], np.int64)))


def choose_on_host(logits: np.ndarray, choice: TokenChoice) -> int:
    """The token the scheduler's host sampler picks for a row marked with `choice` (a request
    with choices has no penalty, min_p or logprobs: adjust_logits leaves its logits as they
    are, and sample_token sees the choice's own parameters, seed and position)."""
    params = SamplingParams(temperature=choice.temperature, top_k=choice.top_k, top_p=choice.top_p)
    return sample_token(logits, params, choice.seed, choice.position)


def choose_like_target(seq: Sequence, logits: np.ndarray, outputs: list[int], pos: int) -> int:
    """The token the target's host sampler picks at `pos` if its logits were these [V]."""
    x = adjust_logits(logits, seq.params, seq.prompt_ids, outputs, seq.stop_ids)
    return sample_token(x, seq.params, seq.seed, pos)


class TargetChooser:
    """How a drafter picks each draft: as the target will pick at that position, on the device
    when the runner chooses that request's tokens there (the same kernel, the same (seed,
    position)), else with the host sampler; so the target as its own drafter accepts every
    draft on either path."""

    def __init__(self, ops: Ops):
        self.ops = ops
        self.sampler = device_sampler(ops)

    def __call__(self, seq: Sequence, logits: Any, outputs: list[int], pos: int) -> int:
        """logits: [1, V] on the ops' device (the draft model's newest row)."""
        chosen = self.on_device(seq, logits, pos)
        if chosen is not None:
            return int(self.ops.to_host(chosen)[0])
        return choose_like_target(seq, self.ops.to_host(logits)[0], outputs, pos)

    def on_device(self, seq: Sequence, logits: Any, pos: int) -> Any | None:
        """The token as the target will pick it at `pos`, left on the device ([1] int64), or
        None when this request's tokens are chosen on the host."""
        choice = token_choice_at(seq, pos) if self.sampler is not None else None
        if choice is None:
            return None
        assert self.sampler is not None
        return choose_on_device(self.ops, self.sampler, logits, [choice])

    def chooses_on_device(self, seq: Sequence) -> bool:
        """Whether every draft of `seq` is chosen on the device (static per request)."""
        return self.sampler is not None and token_choice_at(seq, seq.num_tokens) is not None
