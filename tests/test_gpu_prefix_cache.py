"""The prefix cache on a real GPU (`pytest -m gpu`, needs CuPy and a CUDA GPU): resumed == fresh
with the row copies of a partial last page (dense), the hybrids' kept states, and the ring
drafters' rebuilt rings (draft model, MTP: proposals equal a fresh engine's), as on the CPU
(tests/test_prefix_cache.py, tests/test_prefix_cache_drafters.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests import resume_helpers
from tests import test_prefix_cache as dense
from tests import test_prefix_cache_drafters as drafted
from tests.engine_helpers import idle_stats
from tf_async import Engine

pytestmark = pytest.mark.gpu

GPU = {"device": "cuda"}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.baseline_models import TINY_MODELS
    from tf_async.models.loader import load_checkpoint

    return load_checkpoint(TINY_MODELS["qwen3_5-mlx4"](tmp_path_factory.mktemp("hybrid")))


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_dense_chat_with_copied_rows_equals_fresh_on_the_gpu(tiny_llama, mode) -> None:
    options = {**dense.OPTIONS, **GPU}
    async with Engine(tiny_llama, **options) as eng:
        resumed = await dense._chat_with_prompts(eng, 4, mode, 0, rewrite=False)
        stats = await idle_stats(eng)
    async with Engine(tiny_llama, **options, prefix_cache=False) as eng:
        fresh = await dense._chat_with_prompts(eng, 4, mode, 0, rewrite=False)
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    for k in range(1, 4):
        assert resumed[k][1] == resumed[k - 1][2] + len(resumed[k - 1][0]) - 1, resumed
    assert stats["prefix_cache_copied_rows"] > 0


@pytest.mark.parametrize("rewrite", [False, True])
async def test_hybrid_chat_equals_fresh_on_the_gpu(hybrid, rewrite) -> None:
    options = {**dense.OPTIONS, **GPU}
    async with Engine(hybrid, **options) as eng:
        resumed = await dense._chat_with_prompts(eng, 5, "seeded", 12, rewrite)
        stats = await idle_stats(eng)
    async with Engine(hybrid, **options, prefix_cache=False) as eng:
        fresh = await dense._chat_with_prompts(eng, 5, "seeded", 12, rewrite)
    assert [t[0] for t in resumed] == [t[0] for t in fresh]
    assert all(t[1] > resumed[0][2] for t in resumed[2:]), resumed
    assert stats["prefix_states_resumed"] >= 4


@pytest.mark.parametrize("kind", ["draft", "mtp"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_ring_drafters_on_resumed_chats_draft_as_fresh_on_the_gpu(tiny_llama, hybrid, kind,
                                                                        mode) -> None:
    ckpt, spec = drafted._drafters(tiny_llama, hybrid)[kind]
    resumed, fresh, seen, fresh_seen, _ = await resume_helpers.resumed_and_fresh(
        ckpt, {**drafted.OPTIONS, **GPU, "drafter": spec},
        lambda eng: resume_helpers.chat(eng, 4, mode, seed=3))
    drafted._assert_same_drafting(resumed, fresh, seen, fresh_seen)
    assert all(t[1] > 0 for t in resumed[1:]), resumed
