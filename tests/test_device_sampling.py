"""Token choice on the device: requests that need nothing host-only (no logprobs, penalties
or min_p) get their tokens from one device launch a round, and only the token ids travel to
the host; the others keep the host sampler. The engine runs on `DeviceStyleOps`: the CPU ops
plus device-style `argmax` / `sample` (the semantics of cuda_kernels/sampling.py, in NumPy),
counting what `to_host` copies. One check runs the real kernels in Numba's CUDA simulator."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.engine_helpers import engines_on_ops, idle_stats, record_plans
from tf_async import Engine
from tf_async.api_types import SamplingParams
from tf_async.backend.base import Capabilities, device_sampler
from tf_async.backend.cpu.ops import CpuOps
from tf_async.engine.choice import token_choices
from tf_async.engine.runner import Runner
from tf_async.engine.sequence import RoundPlan, SeqRows, Sequence
from tf_async.gate import PROMPTS

ROOT = Path(__file__).resolve().parents[1]
V = 320  # tests/tiny.py TINY_VOCAB
SEEDED = dict(temperature=8.0, top_k=40, top_p=0.9)  # far from greedy on a tiny random model


def twin_sample(row: np.ndarray, temp: float, top_k: int, top_p: float, seed: int, pos: int) -> int:
    """One row as the device sampler picks it (tests/cuda_sim_check.py's reference)."""
    from cuda_kernels.sampling import uniform_host  # the device's draw, in Python ints

    if not temp > 0:
        return int(np.argmax(row))
    z = row.astype(np.float64) / temp
    order = np.argsort(-z, kind="stable")
    order = order[:top_k] if top_k > 0 else order
    p = np.exp(z[order] - z[order[0]])
    kept = order[: np.searchsorted(np.cumsum(p) / p.sum(), top_p) + 1]
    kept = kept[np.lexsort((kept, kept % 256))]  # thread-major draw order
    pk = np.exp(z[kept] - z.max())
    return int(kept[min(np.searchsorted(np.cumsum(pk), uniform_host(seed, pos) * pk.sum(),
                                        side="right"), len(kept) - 1)])


class DeviceStyleOps:
    """CpuOps with the optional device-sampler capability; records every to_host copy."""

    capabilities = Capabilities(device_sampling=True)

    def __init__(self) -> None:
        self._inner = CpuOps()
        self.copies: list[tuple[tuple[int, ...], str]] = []  # (shape, dtype) of each to_host
        self.launches: list[tuple[str, int]] = []  # ("argmax" | "sample", rows)
        self.positions: list[int] = []  # of every sampled row, in launch order

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def to_host(self, array: np.ndarray) -> np.ndarray:
        self.copies.append((tuple(array.shape), str(array.dtype)))
        return self._inner.to_host(array)

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        assert logits.dtype == np.float32 and logits.ndim == 2 and logits.flags.c_contiguous
        self.launches.append(("argmax", logits.shape[0]))
        return np.argmax(logits, axis=1).astype(np.int64)

    def sample(self, logits, temps, top_ks, top_ps, seeds, positions) -> np.ndarray:
        rows = logits.shape[0]
        assert logits.dtype == np.float32 and logits.ndim == 2 and logits.flags.c_contiguous
        for arr, dtype in ((temps, np.float32), (top_ks, np.int32), (top_ps, np.float32),
                           (seeds, np.uint64), (positions, np.int64)):
            assert arr.dtype == dtype and arr.shape == (rows,), (arr.dtype, arr.shape)
        self.launches.append(("sample", rows))
        self.positions.extend(int(p) for p in positions)
        return np.asarray([twin_sample(logits[r], float(temps[r]), int(top_ks[r]), float(top_ps[r]),
                                       int(seeds[r]), int(positions[r])) for r in range(rows)],
                          np.int64)

    def logit_copies(self) -> list[tuple[int, ...]]:
        """Shapes of the float logits copied to the host."""
        return [shape for shape, dtype in self.copies if dtype == "float32" and shape[-1:] == (V,)]


# ---------------------------------------------------------------------- the plan's row specs


def seq_with(**kw: Any) -> Sequence:
    return Sequence(1, [5, 6, 7], SamplingParams(**kw), seed=-3, stop_ids=frozenset(),
                    output_ids=[9, 10])


@pytest.mark.parametrize("host_only", [dict(logprobs=0), dict(repetition_penalty=1.1),
                                       dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                                       dict(min_p=0.1)])
def test_host_only_requests_get_no_device_choice(host_only):
    assert token_choices(seq_with(**host_only), 1) == ()
    assert token_choices(seq_with(temperature=1.0, seed=4, **host_only), 3) == ()


def test_device_choices_carry_the_host_samplers_positions_and_seed():
    seeded = token_choices(seq_with(temperature=0.7, top_k=5, top_p=0.9), 3)
    assert [c.position for c in seeded] == [5, 6, 7]  # seq.num_tokens + i: the draft rows
    assert {(c.temperature, c.top_k, c.top_p, c.seed) for c in seeded} == {
        (0.7, 5, 0.9, (1 << 64) - 3)}  # the seed mod 2**64, as uniform_at takes it
    assert all(c.greedy for c in token_choices(seq_with(), 2))
    assert all(c.greedy for c in token_choices(seq_with(temperature=2.0, top_k=1), 2))  # as host
    assert token_choices(seq_with(), 0) == ()  # mid-prompt rows sample nothing


# ------------------------------------------------------------------- the runner's one launch


def bare_runner(ops: Any) -> Runner:
    runner = Runner.__new__(Runner)
    runner.ops = ops
    runner.decoder = SimpleNamespace(argmax_of=lambda logits: None)  # no graph: no argmax of its own
    runner.sampler = device_sampler(ops)
    return runner


def mixed_rows() -> tuple[SeqRows, ...]:
    greedy = token_choices(Sequence(1, [1, 2], SamplingParams(), 0, frozenset()), 1)
    seeded = token_choices(Sequence(3, [1, 2, 3, 4], SamplingParams(temperature=1.5, seed=8), 8,
                                    frozenset()), 3)
    return (SeqRows(1, 0, 1, (2,), 1, (), greedy),
            SeqRows(2, 1, 4, (7, 8), 2, (8,)),  # host path: logprobs or penalties
            SeqRows(4, 3, 0, (1, 2, 3), 0),  # mid-prompt
            SeqRows(3, 2, 3, (4, 11, 12), 3, (11, 12), seeded))


def test_one_launch_for_device_rows_and_only_host_rows_copied():
    ops = DeviceStyleOps()
    logits = np.random.default_rng(0).standard_normal((6, V)).astype(np.float32) * 4
    host, tokens = bare_runner(ops)._choose(mixed_rows(), logits)
    assert ops.launches == [("sample", 4)]
    assert ops.positions == [2, 4, 5, 6]
    assert ops.copies == [((4,), "int64"), ((2, V), "float32")]
    assert tokens[1] == [int(np.argmax(logits[0]))]
    assert tokens[3] == [twin_sample(logits[3 + i], 1.5, 0, 1.0, 8, 4 + i) for i in range(3)]
    assert set(host) == {2} and np.array_equal(host[2], logits[1:3])


def test_all_greedy_is_one_argmax_and_no_logits_copied():
    ops = DeviceStyleOps()
    rows = tuple(SeqRows(i, i, 3, (9,), 1, (), token_choices(
        Sequence(i, [1, 2, 3], SamplingParams(), 0, frozenset()), 1)) for i in range(3))
    logits = np.random.default_rng(1).standard_normal((3, V)).astype(np.float32)
    logits[1, 17] = logits[1, 250] = 99.0  # a tie: the lowest id, as np.argmax / sample_token
    host, tokens = bare_runner(ops)._choose(rows, logits)
    assert host == {} and ops.launches == [("argmax", 3)] and ops.logit_copies() == []
    assert tokens == {i: [int(np.argmax(logits[i]))] for i in range(3)} and tokens[1] == [17]


def test_without_a_device_sampler_every_row_goes_to_the_host_as_before():
    class HostOnly(DeviceStyleOps):
        capabilities = Capabilities()  # has the methods, does not declare the capability

    for ops in (HostOnly(), CpuOps()):
        assert device_sampler(ops) is None
    ops = HostOnly()
    logits = np.random.default_rng(2).standard_normal((6, V)).astype(np.float32)
    host, tokens = bare_runner(ops)._choose(mixed_rows(), logits)
    assert tokens == {} and ops.launches == [] and ops.copies == [((6, V), "float32")]
    assert {k: v.shape[0] for k, v in host.items()} == {1: 1, 2: 2, 3: 3}


# ------------------------------------------------------------------------- engines end to end


@pytest.fixture
def device_ops(monkeypatch: pytest.MonkeyPatch) -> list[DeviceStyleOps]:
    """Engines built while this is active run on DeviceStyleOps (one per engine, in order)."""
    return engines_on_ops(monkeypatch, DeviceStyleOps)


def make_engine(ckpt, **kw: Any) -> Engine:
    # ngram_min 1: random tiny-model text rarely repeats 2-grams
    opts: dict[str, Any] = dict(device="cpu", parallel=4, ctx=256, page_size=4, step_tokens=16,
                                ngram_min=1)
    return Engine(ckpt, **{**opts, **kw})


def check_plan_choices(plans: list[RoundPlan], device_ids: set[int]) -> int:
    """Every logit row of a device request carries its choice, drawn for the position after
    the row's token; host requests carry none. Returns the host path's logit rows."""
    host_rows = 0
    for plan in plans:
        for rows in plan.rows:
            if rows.request_id not in device_ids or not rows.num_logit_rows:
                assert rows.choices == (), rows
                host_rows += rows.num_logit_rows
                continue
            first = rows.start_pos + len(rows.token_ids) - rows.num_logit_rows
            assert [c.position for c in rows.choices] == [first + 1 + i for i in range(
                rows.num_logit_rows)], rows
    return host_rows


async def complete_all(eng: Engine, kwargs: list[dict[str, Any]]) -> list[Any]:
    return list(await asyncio.gather(*(eng.complete(PROMPTS[i % len(PROMPTS)], **kw)
                                       for i, kw in enumerate(kwargs))))


@pytest.mark.asyncio
async def test_greedy_on_the_device_equals_host_greedy_and_copies_no_logits(tiny_llama, device_ops):
    kwargs = [dict(max_tokens=16) for _ in PROMPTS]
    async with make_engine(tiny_llama) as eng:
        plans = record_plans(eng)
        got = [c.token_ids for c in await complete_all(eng, kwargs)]
        first_id = min(r.request_id for p in plans for r in p.rows)
        ids = {first_id + i for i in range(len(kwargs))}
        assert check_plan_choices(plans, ids) == 0
        await idle_stats(eng)
    ops = device_ops[-1]
    assert ops.logit_copies() == [] and ops.launches
    assert {kind for kind, _ in ops.launches} == {"argmax"}
    device_ops.clear()
    async with make_engine(tiny_llama) as eng:
        eng.parts.runner.sampler = None  # the host sampler, as on the CPU backend
        want = [c.token_ids for c in await complete_all(eng, kwargs)]
    assert got == want


@pytest.mark.asyncio
async def test_a_failed_step_isolates_with_device_choices_and_others_stay_unchanged(tiny_llama, device_ops):
    """A fault in one request's prompt step: the runner re-runs the round's requests one by
    one (Runner._isolate), and those still choose on the device; only that request fails."""
    kwargs = [dict(max_tokens=12, seed=40 + i, **SEEDED) for i in range(4)]
    # no prefix cache: the second run of a prompt must start at position 0 to meet the fault
    async with make_engine(tiny_llama, prefix_cache=False) as eng:
        want = [c.token_ids for c in await complete_all(eng, kwargs)]
        bad_ids = eng.tokenizer.encode(PROMPTS[2])

        def inject(rows: SeqRows) -> None:
            if rows.token_ids[:3] == tuple(bad_ids[:3]) and rows.start_pos == 0:
                raise RuntimeError("injected fault")

        eng.parts.runner.fault_injector = inject
        launches = len(device_ops[-1].launches)
        outs = await asyncio.gather(*(eng.complete(PROMPTS[i], **kwargs[i]) for i in range(4)),
                                    return_exceptions=True)
        assert isinstance(outs[2], Exception) and "injected fault" in str(outs[2])
        assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [want[i] for i in (0, 1, 3)]
        assert len(device_ops[-1].launches) > launches
        assert device_ops[-1].logit_copies() == []
        stats = await idle_stats(eng)
        assert stats["pages_in_use"] == 0 and stats["lanes_in_use"] == 0


@pytest.mark.asyncio
async def test_mixed_batch_host_requests_unchanged_device_requests_reproducible(tiny_llama,
                                                                                 device_ops):
    kwargs: list[dict[str, Any]] = [  # device and host rows interleaved in every round
        dict(max_tokens=12),  # device: greedy
        dict(max_tokens=12, logprobs=2),  # host: logprobs
        dict(max_tokens=12, seed=11, **SEEDED),  # device: seeded
        dict(max_tokens=12, repetition_penalty=1.5, seed=12, **SEEDED),  # host: penalty
        dict(max_tokens=12, seed=13, min_p=0.05, **SEEDED),  # host: min_p
        dict(max_tokens=12, seed=14, **SEEDED),  # device: seeded
        dict(max_tokens=12, frequency_penalty=0.7),  # host: penalty, greedy
    ]
    device = {0, 2, 5}
    async with make_engine(tiny_llama, parallel=7) as eng:
        plans = record_plans(eng)
        mixed = await complete_all(eng, kwargs)
        base = min(r.request_id for p in plans for r in p.rows)
        host_rows = check_plan_choices(plans, {base + i for i in device})
        solo = [await eng.complete(PROMPTS[i], **kw) for i, kw in enumerate(kwargs)]
        await idle_stats(eng)
    ops = device_ops[-1]
    assert sum(shape[0] for shape in ops.logit_copies()) >= host_rows > 0
    assert [c.token_ids for c in mixed] == [c.token_ids for c in solo]
    assert mixed[1].logprobs is not None and len(mixed[1].logprobs) == 12
    assert mixed[0].logprobs is None
    # the host path is today's: equal to an engine without the device sampler
    device_ops.clear()
    async with make_engine(tiny_llama, parallel=7) as eng:
        eng.parts.runner.sampler = None
        host = await complete_all(eng, kwargs)
    for i in range(len(kwargs)):
        if i not in device or "seed" not in kwargs[i]:  # greedy: the same on either path
            assert host[i].token_ids == mixed[i].token_ids, i
            assert host[i].logprobs == mixed[i].logprobs, i


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_drafted_equals_plain_with_device_choice(tiny_llama, tiny_llama_dir, device_ops, mode):
    def kw(i: int) -> dict[str, Any]:
        return dict(max_tokens=20) if mode == "greedy" else dict(max_tokens=20, seed=500 + i,
                                                                  **SEEDED)

    prompts = list(PROMPTS[:4])
    async with make_engine(tiny_llama, parallel=1) as eng:
        plain = [(await eng.complete(p, **kw(i))).token_ids for i, p in enumerate(prompts)]
    for spec in ("ngram", f"draft:{tiny_llama_dir}"):
        async with make_engine(tiny_llama, drafter=spec, draft_tokens=4) as eng:
            plans = record_plans(eng)
            outs = await asyncio.gather(*(eng.complete(p, **kw(i)) for i, p in enumerate(prompts)))
            assert [o.token_ids for o in outs] == plain, spec
            stats = await idle_stats(eng)
        ids = {r.request_id for p in plans for r in p.rows}
        assert check_plan_choices(plans, ids) == 0
        assert any(r.draft_ids for p in plans for r in p.rows)
        assert stats["drafted_tokens"] > 0, spec
        # A draft model chooses its drafts on the device too (engine/choice.py TargetChooser):
        # no logits travel, and the target drafting itself has every draft accepted, greedy
        # and seeded (the same sampler at the same (seed, position)).
        assert device_ops[-1].logit_copies() == []
        if spec != "ngram":
            assert stats["accepted_tokens"] == stats["drafted_tokens"]


class OracleDrafter:
    """Proposes the plain run's own next tokens (the last one spoiled when `spoil`): every
    unspoiled draft is accepted exactly when each verify row draws for the right position."""

    name = "oracle"

    def __init__(self, plain: dict[tuple[int, ...], list[int]], k: int, spoil: bool):
        self.plain, self.k, self.spoil = plain, k, spoil
        self.num_drafted = self.num_accepted = self.num_spoiled = 0

    def is_open(self, seq: Sequence) -> bool:
        return True

    def open(self, seq: Sequence) -> None:
        pass

    def release(self, lane: int) -> None:
        pass

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        drafts = self.plain[tuple(seq.prompt_ids)][len(seq.output_ids):][: min(limit, self.k)]
        if self.spoil and drafts:
            drafts[-1] = (drafts[-1] + 1) % V
            self.num_spoiled += 1
        return tuple(drafts)

    def absorb(self, seq: Sequence, rows: SeqRows, num_new_tokens: int, hidden: Any) -> None:
        from tf_async.engine.drafting import count_accepted

        count_accepted(self, rows, num_new_tokens)

    def stats(self) -> dict[str, int]:
        from tf_async.engine.drafting import zero_stats

        return {**zero_stats(), "drafted_tokens": self.num_drafted,
                "accepted_tokens": self.num_accepted}


@pytest.mark.asyncio
@pytest.mark.parametrize("spoil", [False, True])
async def test_seeded_verify_rows_draw_at_their_positions(tiny_llama, device_ops, spoil):
    kw = [dict(max_tokens=24, seed=700 + i, **SEEDED) for i in range(4)]
    async with make_engine(tiny_llama, parallel=1) as eng:
        prompts = [eng.tokenizer.encode(p) for p in PROMPTS[:4]]
        plain = [(await eng.complete(p, **kw[i])).token_ids for i, p in enumerate(prompts)]
    async with make_engine(tiny_llama) as eng:
        oracle = OracleDrafter({tuple(p): out for p, out in zip(prompts, plain, strict=True)}, 5,
                               spoil)
        eng.parts.scheduler.drafter = oracle  # type: ignore[assignment]
        outs = await asyncio.gather(*(eng.complete(p, **kw[i]) for i, p in enumerate(prompts)))
        await idle_stats(eng)
    assert [o.token_ids for o in outs] == plain
    assert oracle.num_drafted > 20 and device_ops[-1].logit_copies() == []
    if spoil:
        assert oracle.num_accepted == oracle.num_drafted - oracle.num_spoiled
    else:
        assert oracle.num_accepted == oracle.num_drafted


# ----------------------------------------------------------- the real kernels (simulator)

SIM_CHECK = """
import numpy as np
from cuda_kernels import launch
from tf_async.api_types import SamplingParams
from tf_async.engine.sampling import sample_token

rng = np.random.default_rng(3)
logits = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
logits[1, [17, 250]] = 40.0     # ties: the lowest id
logits[2, [3, 4, 299]] = 50.0
logits[3, :] = 1.0              # all equal: token 0
want = [sample_token(row, SamplingParams(), 0, 0) for row in logits]
out = np.full(4, -1, np.int64)
launch.argmax(logits, out)
assert out.tolist() == want == [int(np.argmax(logits[0])), 17, 3, 0], (out, want)
out[:] = -1
zeros = np.zeros(4, np.float32)
launch.sample(logits, zeros, np.zeros(4, np.int32), np.ones(4, np.float32),
              np.arange(4, dtype=np.uint64), np.arange(4, dtype=np.int64), out)
assert out.tolist() == want, (out, want)
print("ok")
"""


def test_device_greedy_convention_is_sample_tokens_in_the_simulator():
    pytest.importorskip("numba")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", SIM_CHECK], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_cuda_engine_chooses_tokens_on_the_device(tiny_llama) -> None:
    """On a real GPU (`pytest -m gpu`): greedy and seeded rows copy only token ids; a
    logprobs request still gets its logit rows; seeded output is reproducible."""
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    kwargs: list[dict[str, Any]] = [dict(max_tokens=10), dict(max_tokens=10, seed=3, **SEEDED),
                                    dict(max_tokens=10, logprobs=2)]
    async with make_engine(tiny_llama, device="cuda") as eng:
        ops = eng.parts.runner.ops
        assert eng.parts.runner.sampler is not None
        copies: list[tuple[int, ...]] = []
        to_host = ops.to_host

        def spy(array):
            copies.append(tuple(array.shape))
            return to_host(array)

        ops.to_host = spy
        device_only = await complete_all(eng, kwargs[:2])
        assert [s for s in copies if s[-1:] == (V,)] == []
        mixed = await complete_all(eng, kwargs)
        assert [s for s in copies if s[-1:] == (V,)] != []  # the logprobs request's rows
        await idle_stats(eng)
    assert [c.token_ids for c in mixed[:2]] == [c.token_ids for c in device_only]
    assert mixed[2].logprobs is not None and len(mixed[2].logprobs) == 10
