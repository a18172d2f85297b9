"""EngineOptions: every setting of an engine, typed and validated once (at construction),
then carried unchanged from `Engine(...)` or the CLI to the parts that use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import BadInputError
from .pages import pages_for_rows

if TYPE_CHECKING:
    from ..models.checkpoint import Checkpoint

KV_DTYPES = ("f32", "bf16", "fp8")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    model: str | Checkpoint | None = None  # path, loaded checkpoint, or None: the default model
    device: str = "auto"  # auto | cpu | cuda
    parallel: int = 4  # lanes (concurrent streams)
    ctx: int = 4096  # context rows per stream
    kv_dtype: str = "f32"  # f32 | bf16 | fp8
    paging: bool = True  # KV pages on demand from a shared pool (else one run a lane)
    kv_pages: int | None = None  # pool size with paging (default: every lane's full ctx)
    step_tokens: int = 256  # prompt tokens per round (stepped prefill)
    drafter: str | None = None  # ngram | mtp | draft:PATH (engine/drafters/registry.py)
    draft_tokens: int = 4  # drafts a round at most
    page_size: int = 16  # token rows a KV page
    cuda_graphs: bool = True  # replay decode rounds from CUDA graphs where the ops can
    decode_steps: int = 1  # forwards a pure greedy/seeded decode round may run in a row
    draft_ring: int | None = None  # ring rows of a drafter context (default: ctx)
    draft_areas: int | None = None  # drafter areas in the arena (default: one a lane)
    ngram_min: int = 2  # shortest suffix the ngram drafter matches
    # After n rounds in a row whose drafts were all rejected, a stream decodes 2**(n-1) - 1
    # rounds without drafting, at most this many (0: it drafts every round); an accepted draft
    # resets n.
    draft_backoff: int = 32
    prefix_cache: bool = True  # share cached prefix pages between streams (needs paging)
    prefix_state_pages: int = 16  # hybrids: keep a recurrent state every N pages (and more)
    prefix_state_slots: int | None = None  # hybrids: kept recurrent states (default: one a lane)
    tensor_parallel: int = 1  # ranks the weights and KV heads split over (docs/TENSOR_PARALLEL.md)

    def __post_init__(self) -> None:
        _need(_is_int(self.parallel) and 1 <= self.parallel <= 1024, "parallel must be in [1, 1024]", "parallel")
        _need(_is_int(self.ctx) and 2 <= self.ctx <= 1 << 20, "ctx must be in [2, 1048576]", "ctx")
        _need(self.device in DEVICES, f"unknown device {self.device!r}: use auto, cpu or cuda", "device")
        _need(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}", "kv_dtype")
        _need(_is_int(self.page_size) and 1 <= self.page_size <= 1024, "page_size must be in [1, 1024]", "page_size")
        _need(_is_int(self.step_tokens) and self.step_tokens >= 1, "step_tokens must be >= 1", "step_tokens")
        _need(_is_int(self.draft_tokens) and 1 <= self.draft_tokens <= 16, "draft_tokens must be in [1, 16]", "draft_tokens")
        _need(_is_int(self.decode_steps) and 1 <= self.decode_steps <= 64, "decode_steps must be in [1, 64]", "decode_steps")
        per_lane = pages_for_rows(self.ctx, self.page_size)
        _need(self.kv_pages is None or (_is_int(self.kv_pages) and self.kv_pages >= per_lane),
              f"kv_pages must be at least ctx / page_size = {per_lane} so that one stream fits", "kv_pages")
        _need(self.draft_ring is None or (_is_int(self.draft_ring) and self.draft_ring >= 1),
              "draft_ring must be an integer >= 1", "draft_ring")
        _need(self.draft_areas is None or (_is_int(self.draft_areas) and self.draft_areas >= 0),
              "draft_areas must be an integer >= 0", "draft_areas")
        _need(_is_int(self.prefix_state_pages) and self.prefix_state_pages >= 1,
              "prefix_state_pages must be an integer >= 1", "prefix_state_pages")
        _need(self.prefix_state_slots is None
              or (_is_int(self.prefix_state_slots) and self.prefix_state_slots >= 1),
              "prefix_state_slots must be an integer >= 1", "prefix_state_slots")
        _need(_is_int(self.ngram_min) and 1 <= self.ngram_min <= 3, "ngram_min must be in [1, 3]", "ngram_min")
        _need(_is_int(self.draft_backoff) and 0 <= self.draft_backoff <= 4096,
              "draft_backoff must be in [0, 4096]", "draft_backoff")
        _need(_is_int(self.tensor_parallel) and 1 <= self.tensor_parallel <= 64,
              "tensor_parallel must be in [1, 64]", "tensor_parallel")
        _need(self.tensor_parallel == 1 or self.drafter in (None, "ngram")
              or self.drafter.startswith("draft:"),
              "tensor_parallel > 1 supports the ngram and draft:PATH drafters (the mtp and "
              "dflash drafters' memory is not split by heads yet)", "drafter")
        _need(self.tensor_parallel == 1 or self.draft_areas is None or self.draft_areas >= self.parallel,
              "tensor_parallel > 1 needs a drafter area a lane (draft_areas >= parallel): "
              "owned fallback rings are not split by heads", "draft_areas")

    @property
    def ring_capacity(self) -> int:
        """Ring rows of a drafter context."""
        return self.draft_ring or self.ctx

    def num_prefix_states(self, num_lanes: int) -> int:
        """Recurrent states a hybrid keeps for the prefix cache."""
        return self.prefix_state_slots or num_lanes

    def num_draft_areas(self, num_lanes: int) -> int:
        """Drafter areas in the arena's region."""
        return num_lanes if self.draft_areas is None else self.draft_areas


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise BadInputError(message, param=param)
