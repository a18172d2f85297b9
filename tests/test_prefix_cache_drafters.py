"""Ring drafters on resumed streams: a draft model (`draft:PATH`) and the MTP head draft exactly
as they would on a fresh engine, so their proposals, not only the outputs, are the same.

A draft model's ring is rebuilt by prefilling the reused prefix into it (its first proposal);
the MTP ring is rebuilt from the MTP slot rows kept beside the cached pages (drafters/
page_slots.py). Each test runs the same chat on an engine with the cache and on one without
it, both drafting, and compares outputs, per-request drafted/accepted counts and every
proposal (keyed by the stream's tokens); cached_tokens > 0 shows that reuse happened.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.resume_helpers import (
    Proposals,
    Turn,
    chat,
    differing,
    resumed_and_fresh,
    sampling,
    shared_prefix_twice,
    tokens,
    turn_of,
)
from tf_async import Engine

PAGE = 4
# draft_backoff=0: every round drafts in full, so proposals on the same tokens compare (the
# pacing follows each stream's own history of rejected rounds)
OPTIONS: dict[str, Any] = dict(device="cpu", parallel=4, ctx=256, page_size=PAGE, step_tokens=16,
                               draft_tokens=3, draft_backoff=0)


def _assert_same_drafting(resumed: list[Turn], fresh: list[Turn], seen: Proposals,
                          fresh_seen: Proposals) -> None:
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    assert sum(t[2] for t in resumed) > 0
    common, differ = differing(seen, fresh_seen)
    assert differ == 0 and common >= len(seen) // 2, (common, differ, len(seen))
    assert all(t[1] == 0 for t in fresh)


def _drafters(tiny_llama: Any, hybrid: Any) -> dict[str, tuple[Any, str]]:
    return {"draft": (tiny_llama, f"draft:{tiny_llama.path}"), "mtp": (hybrid, "mtp")}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.baseline_models import TINY_MODELS
    from tf_async.models.loader import load_checkpoint

    return load_checkpoint(TINY_MODELS["qwen3_5-mlx4"](tmp_path_factory.mktemp("hybrid")))


@pytest.mark.parametrize("kind", ["draft", "mtp"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
@pytest.mark.parametrize("turns", [2, 5])
async def test_resumed_chat_drafts_as_fresh(tiny_llama, hybrid, kind, mode, turns) -> None:
    ckpt, spec = _drafters(tiny_llama, hybrid)[kind]
    resumed, fresh, seen, fresh_seen, stats = await resumed_and_fresh(
        ckpt, {**OPTIONS, "drafter": spec}, lambda eng: chat(eng, turns, mode, seed=3))
    _assert_same_drafting(resumed, fresh, seen, fresh_seen)
    assert [t[2:] for t in resumed] == [t[2:] for t in fresh]  # drafted, accepted per turn
    assert resumed[0][1] == 0 and all(t[1] > 0 for t in resumed[1:]), resumed
    assert stats["prefix_cache_hit_pages"] > 0


@pytest.mark.parametrize("kind", ["draft", "mtp"])
@pytest.mark.parametrize("num_streams", [1, 4])
async def test_streams_sharing_a_prefix_draft_as_fresh(tiny_llama, hybrid, kind, num_streams) -> None:
    ckpt, spec = _drafters(tiny_llama, hybrid)[kind]
    # Hybrids resume at a kept state: one every 4 pages (16 rows) gives the shared 41-token
    # prefix one at row 32 (a stream's moving state moves on past the prefix as it decodes).
    states = {"prefix_state_pages": 4, "prefix_state_slots": 16}
    for mode in ("greedy", "seeded"):
        resumed, fresh, seen, fresh_seen, _ = await resumed_and_fresh(
            ckpt, {**OPTIONS, "drafter": spec, **states},
            lambda eng, mode=mode: shared_prefix_twice(eng, num_streams, mode))
        _assert_same_drafting(resumed, fresh, seen, fresh_seen)
        assert all(t[1] > 0 for t in resumed[num_streams:]), resumed


# ---- mutations: a ring not rebuilt for the reused prefix is caught ---------------------------
async def test_a_draft_model_ring_without_the_reused_prefix_is_caught(tiny_llama, monkeypatch) -> None:
    from tf_async.engine.drafters.model import ModelDrafter

    open_ring = ModelDrafter.open

    def open_past_the_prefix(self: ModelDrafter, seq: Any) -> None:  # prefix rows never fed
        open_ring(self, seq)
        ctx = self.contexts.get(seq)
        assert ctx is not None
        ctx.num_valid = seq.num_computed

    monkeypatch.setattr(ModelDrafter, "open", open_past_the_prefix)
    resumed, fresh, seen, fresh_seen, _ = await resumed_and_fresh(
        tiny_llama, {**OPTIONS, "drafter": f"draft:{tiny_llama.path}"},
        lambda eng: chat(eng, 3, "greedy", seed=3))
    assert [t[0] for t in resumed] == [t[0] for t in fresh]  # outputs never change
    assert differing(seen, fresh_seen)[1] > 0


async def test_an_mtp_ring_not_rebuilt_from_the_kept_slots_is_caught(hybrid, monkeypatch) -> None:
    from tf_async.engine.drafters.page_slots import PageSlots

    monkeypatch.setattr(PageSlots, "copy_to_ring", lambda self, *args: None)
    resumed, fresh, seen, fresh_seen, _ = await resumed_and_fresh(
        hybrid, {**OPTIONS, "drafter": "mtp"}, lambda eng: chat(eng, 3, "greedy", seed=3))
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    assert differing(seen, fresh_seen)[1] > 0


async def test_an_mtp_ring_is_rebuilt_when_a_hybrid_resumes_mid_prompt(hybrid) -> None:
    """Two streams with one long prefix admitted together (states every 8 rows, 12-row budget):
    the second computes its first 4 rows itself, then resumes mid-prompt from the first's pages
    and states; its MTP ring is rebuilt from its own pages and the first's."""
    prefix = tokens(30, 70)
    prompts = [prefix + tokens(31 + i, 6) for i in range(2)]
    options = {**OPTIONS, "drafter": "mtp", "prefix_state_pages": 2, "step_tokens": 12}

    async def run(eng: Engine) -> list[Turn]:
        done = await asyncio.gather(*(eng.complete(p, **sampling("seeded", i))
                                      for i, p in enumerate(prompts)))
        return [turn_of(d) for d in done]

    resumed, fresh, seen, fresh_seen, stats = await resumed_and_fresh(hybrid, options, run)
    _assert_same_drafting(resumed, fresh, seen, fresh_seen)
    assert resumed[1][1] >= 24 and stats["prefix_states_resumed"] > 0
    # (how many tokens a stream drafts may differ: resumed, its prompt is cut elsewhere, and
    # whether its last prompt token runs as a decode row with drafts depends on the cuts)


# ---- a ring shorter than the streams ----------------------------------------------------------
def _record_spans(kind: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(last position a drafter call attends, its ring's rows) of every call that reads it."""
    from tf_async.engine.drafters.model import ModelDrafter
    from tf_async.models.mtp import MtpHead

    spans: list[tuple[int, int]] = []
    if kind == "mtp":
        rows = MtpHead.rows

        def spy_rows(self: MtpHead, token_ids: Any, positions: Any, hidden: Any, ring: Any,
                     *args: Any) -> Any:
            spans.append((int(max(positions)), int(ring.shape[2])))
            return rows(self, token_ids, positions, hidden, ring, *args)

        monkeypatch.setattr(MtpHead, "rows", spy_rows)
    else:
        forward = ModelDrafter._forward

        def spy_forward(self: ModelDrafter, ctx: Any, tokens_in: list[int], start_pos: int) -> Any:
            spans.append((start_pos + len(tokens_in) - 1, int(ctx.views.ring.shape[2])))
            return forward(self, ctx, tokens_in, start_pos)

        monkeypatch.setattr(ModelDrafter, "_forward", spy_forward)
    return spans


@pytest.mark.parametrize("kind", ["draft", "mtp"])
async def test_drafts_end_where_a_shorter_ring_does(tiny_llama, hybrid, kind, monkeypatch) -> None:
    """--draft-ring shorter than the streams: a proposal never attends a position whose ring
    row a later position wrote (drafts stop once the stream passes the ring), so resumed
    streams propose as fresh ones (outputs equal plain's either way: the gates); MTP writes
    no slot past the ring."""
    from tf_async.models.mtp import MtpHead

    ckpt, spec = _drafters(tiny_llama, hybrid)[kind]
    spans = _record_spans(kind, monkeypatch)
    write, first_slots = MtpHead.write_slots, []

    def spy_write(self: MtpHead, token_ids: list[int], first_pos: int, *args: Any) -> None:
        first_slots.append(first_pos)
        write(self, token_ids, first_pos, *args)

    monkeypatch.setattr(MtpHead, "write_slots", spy_write)
    ring = 30  # the chat's first prompt (28 tokens) drafts; the later turns pass the ring
    resumed, fresh, seen, fresh_seen, _ = await resumed_and_fresh(
        ckpt, {**OPTIONS, "drafter": spec, "draft_ring": ring},
        lambda eng: chat(eng, 3, "greedy", seed=3))
    _assert_same_drafting(resumed, fresh, seen, fresh_seen)
    assert spans and all(last < rows == ring for last, rows in spans), spans
    assert resumed[0][2] > 0 and resumed[-1][2] == 0  # drafts while the stream fits, not after
    # MTP: no slot writes once a stream has passed its ring (nothing reads them again)
    assert (kind == "mtp") == bool(first_slots) and all(s < ring for s in first_slots), first_slots
