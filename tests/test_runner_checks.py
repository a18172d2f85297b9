"""The runner checks a round's indices once on the packed host copy and runs the forward
without the backend's per-op index checks (on a GPU each is a host sync, on the CPU a kernel
call a layer); a batch that fails the host check never reaches the decoder, and outputs are
unchanged."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tests.engine_helpers import engines_on_ops
from tf_async.api import Engine
from tf_async.backend.base import Capabilities
from tf_async.backend.cpu.ops import CpuOps
from tf_async.errors import BadInputError
from tf_async.models.batch_io import pack_batch

pytestmark = pytest.mark.asyncio


class CheckTrackingOps:
    """CpuOps that also declares device checks (as CudaOps) and records its `unchecked()`
    switch at every embed call; the switch enters CpuOps' own too (its range checks skipped)."""

    capabilities = Capabilities(device_checks=True, round_checks=True)

    def __init__(self) -> None:
        self._inner = CpuOps()
        self.device_checks = True
        self.embeds_checked: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def unchecked(self):
        before, self.device_checks = self.device_checks, False
        try:
            with self._inner.unchecked():
                yield
        finally:
            self.device_checks = before

    def embed(self, w, ids):
        self.embeds_checked.append(self.device_checks)
        return self._inner.embed(w, ids)


@pytest.fixture
def tracking_ops(monkeypatch: pytest.MonkeyPatch) -> list[CheckTrackingOps]:
    return engines_on_ops(monkeypatch, CheckTrackingOps)


async def generate(ckpt, prompt: list[int]) -> list[int]:
    async with Engine(ckpt, device="cpu", parallel=2, ctx=128, page_size=4, step_tokens=5) as eng:
        out = await eng.complete(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        return list(out.token_ids)


async def test_forwards_run_unchecked_after_the_host_check_with_equal_outputs(tiny_llama, tracking_ops):
    prompt = [3, 17, 5, 9, 11, 2, 8, 30, 4, 6, 12]
    tracked = await generate(tiny_llama, prompt)
    ops = tracking_ops[0]
    assert ops.embeds_checked and not any(ops.embeds_checked)  # every forward: unchecked
    assert ops.device_checks  # switched back after each round
    tracking_ops.clear()
    plain = await generate(tiny_llama, prompt)  # the CPU path of today, for comparison
    assert tracked == plain


async def test_a_bad_batch_is_refused_on_the_host_before_the_forward(tiny_llama, tracking_ops) -> None:
    async with Engine(tiny_llama, device="cpu", parallel=2, ctx=64, page_size=4) as eng:
        await eng.complete([1, 2], max_tokens=1)  # builds the engine
        assert eng.parts is not None
        check_refusals(eng.parts.runner, tracking_ops[0])


def check_refusals(runner, ops: CheckTrackingOps) -> None:
    vocab = runner.decoder.weights.embed.out_features
    table = np.array([[0, 1]], np.int32)
    good = dict(token_ids=[1, 2], positions=[0, 1], row_seq=[0, 0], block_table=table,
                logit_rows=[1], page_size=4, slots=[0, 1])
    with runner._host_checked(pack_batch(ops, **good)):
        assert not ops.device_checks
    bad_cases = [dict(token_ids=[1, vocab]), dict(positions=[0, 8]), dict(row_seq=[0, 1]),
                 dict(block_table=np.array([[0, 10**6]], np.int32), positions=[0, 5])]
    for change in bad_cases:
        with pytest.raises(BadInputError, match="out of range"):
            runner._host_checked(pack_batch(ops, **{**good, **change}))
        assert ops.device_checks


async def test_a_row_past_its_lanes_pages_is_refused_not_read_from_another_lane(tiny_llama, tracking_ops) -> None:
    """A lane's table row is padded to the round's widest table: the padding is no page, so a
    row at a position its lane holds no page for (a scheduler bug) fails the check instead
    of reading the padding as a page, page 0, which another lane holds here."""
    from tf_async.engine.sequence import SeqRows

    async with Engine(tiny_llama, device="cpu", parallel=2, ctx=64, page_size=4) as eng:
        await eng.complete([1, 2], max_tokens=1)  # builds the engine
        assert eng.parts is not None
        runner = eng.parts.runner
        tables = {0: (5,), 1: (6, 7, 0)}  # lane 1 holds page 0; lane 0 holds one page
        inside = SeqRows(request_id=1, lane=1, start_pos=9, token_ids=(3,), num_logit_rows=1)
        past = SeqRows(request_id=2, lane=0, start_pos=8, token_ids=(3,), num_logit_rows=1)
        runner._forward((inside,), tables)  # a row inside its lane's pages runs
        with pytest.raises(BadInputError, match="out of range"):  # the runner's host check
            runner._forward((inside, past), tables)
        tracking_ops[0].capabilities = Capabilities()  # no host check: the backend's own checks refuse it
        with pytest.raises(ValueError, match="must lie in|outside"):
            runner._forward((inside, past), tables)


async def test_cpu_forwards_skip_the_per_op_index_checks_the_runner_made(tiny_llama, monkeypatch) -> None:
    """On the CPU too: inside the runner's rounds no layer calls the page or slot range
    kernels (the round was checked once), the same tokens come out, and outside unchecked()
    a bad slot or page is still refused by the op itself."""
    from tf_async.backend.cpu import kernels
    from tf_async.backend.cpu import ops as cpu_ops

    calls: dict[str, Any] = {"pages": 0, "ranges": []}
    pages, ranges = kernels.first_bad_page_row, cpu_ops._check_range

    def counted_pages(*args):
        calls["pages"] += 1
        return pages(*args)

    def counted_ranges(values, name, low, high):
        calls["ranges"].append(name)
        return ranges(values, name, low, high)

    prompt = [3, 17, 5, 9, 11, 2, 8, 30, 4, 6, 12]
    plain = await generate(tiny_llama, prompt)
    monkeypatch.setattr(kernels, "first_bad_page_row", counted_pages)
    monkeypatch.setattr(cpu_ops, "_check_range", counted_ranges)
    assert await generate(tiny_llama, prompt) == plain
    assert calls["pages"] == 0  # a new page's zeroing (no layer) still checks its ids
    assert calls["ranges"] and set(calls["ranges"]) == {"zero_pages page_ids"}
    ops = CpuOps()
    kv = ops.alloc_kv(1, 8, 1, 4, "f32")
    k = np.zeros((1, 1, 4), np.float32)
    with pytest.raises(BadInputError, match="must lie in"):
        ops.kv_write(kv, 0, k, k, np.array([8], np.int64), None)
    q = np.zeros((1, 1, 4), np.float32)
    with pytest.raises(BadInputError, match="block_table entry"):
        ops.attention(q, kv, 0, None, np.array([[5]], np.int32), np.zeros(1, np.int32),
                      np.zeros(1, np.int64), 4, 0.5)
    assert calls["pages"] == 1 and calls["ranges"][-1] == "kv_write slots"
    with ops.unchecked():
        assert not ops.index_checks
    assert ops.index_checks
