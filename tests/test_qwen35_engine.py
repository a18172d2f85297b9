"""Qwen3.5 hybrids in the engine: tiny qwen3_5 / qwen3_5_moe checkpoints (HF and MLX) pass every
gate (drafted == plain with the MTP drafter and ngram, greedy and seeded at temperature 8);
the lane lifecycle zeroes the recurrent state at open (and on re-admission after preemption);
forced drafts roll the state back exactly; the MTP drafter's ring stays in sync (each of its
proposals equals drafts recomputed from scratch); cancels mid-draft; refusals."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests import tiny_qwen35 as tq
from tests.engine_helpers import idle_stats, run_with_cancels
from tf_async import BadInputError, Engine
from tf_async.engine.choice import choose_like_target
from tf_async.gate import PROMPTS, run_gates
from tf_async.models.decoder import ForwardBatch
from tf_async.models.loader import load_checkpoint

pytestmark = pytest.mark.asyncio

MAX_TOKENS = 16
HOT = 8.0  # seeded sampling this hot on a tiny random model is far from greedy
VARIANTS = {  # name: (moe, writer, writer kwargs)
    "dense-hf-bf16": (False, "hf", {"dtype": "bf16"}),
    "dense-mlx4": (False, "mlx", {"bits": 4}),
    "moe-hf-bf16-per-expert-mtp": (True, "hf", {"dtype": "bf16", "per_expert_mtp": True}),
    "moe-mlx4": (True, "mlx", {"bits": 4}),
}


def write_variant(folder: Path, moe: bool, kind: str, **kw) -> Path:
    cfg = tq.tiny_qwen35_config(moe=moe)
    weights = tq.random_qwen35_weights(cfg, seed=21 if moe else 5)
    if kind == "hf":
        return tq.write_qwen35_hf(folder, cfg, weights, kw.pop("dtype"), **kw)
    return tq.write_qwen35_mlx(folder, cfg, weights, kw.pop("bits"), 32, **kw)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for name, (moe, kind, kw) in VARIANTS.items():
        out[name] = load_checkpoint(write_variant(tmp_path_factory.mktemp(name), moe, kind, **kw))
    return out


def sampling(mode: str, index: int, max_tokens: int = MAX_TOKENS) -> dict:
    if mode == "greedy":
        return {"max_tokens": max_tokens}
    return {"max_tokens": max_tokens, "temperature": HOT, "top_k": 40, "seed": 300 + index}


def engine(ckpt, **kw) -> Engine:
    # ngram_min 1: random tiny-model text rarely repeats 2-grams
    return Engine(ckpt, **{**dict(device="cpu", parallel=4, ctx=128, page_size=4,
                                  step_tokens=16, ngram_min=1), **kw})


async def run_all(eng: Engine, mode: str, prompts=PROMPTS) -> list[list[int]]:
    outs = await asyncio.gather(*(eng.complete(p, **sampling(mode, i))
                                  for i, p in enumerate(prompts)))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(hybrids) -> dict:
    """Plain outputs of every checkpoint, solo (one lane), greedy and seeded."""
    async def solo(ckpt, mode: str) -> list[list[int]]:
        async with engine(ckpt, parallel=1) as eng:
            return [(await eng.complete(p, **sampling(mode, i))).token_ids
                    for i, p in enumerate(PROMPTS)]

    return {(name, mode): asyncio.run(solo(ckpt, mode))
            for name, ckpt in hybrids.items() for mode in ("greedy", "seeded")}


# ---- every gate ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
async def test_all_gates_pass(hybrids, name):
    rows, idle = await run_gates(hybrids[name], device="cpu", max_tokens=10, ctx=128,
                                 prompts=PROMPTS[:6], drafters=("mtp", "ngram"), temperature=HOT)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert len(rows) == 2 * (4 + 1 + 3 + 1 + 1 + 2) + 1
    mtp = idle["drafted-mtp-seeded"]
    assert mtp["drafted_tokens"] > 0 and mtp["recurrent_state_bytes_per_lane"] > 0


# ---- the lane lifecycle zeroes the recurrent state ------------------------------------------
async def test_state_is_zeroed_at_open_and_after_preemption(hybrids, plain):
    name = "moe-mlx4"
    # 24 pages of 4 rows for 3 lanes: streams are preempted and recompute from zero state
    async with engine(hybrids[name], parallel=3, ctx=96, kv_pages=24, step_tokens=8) as eng:
        states = eng.parts.runner.states
        states.conv[...] = 7.0  # garbage in every lane: only the zeroing at open removes it
        states.delta[...] = -3.0
        got = await run_all(eng, "greedy")
        stats = await idle_stats(eng)
        assert eng.parts.scheduler.num_preemptions > 0
    assert got == plain[name, "greedy"]
    lane_bytes = 4 * 3 * (3 * 128 + 4 * 16 * 16)  # gdn layers * ((K-1) * C + Hv * dk * dv)
    assert stats["recurrent_state_bytes_per_lane"] == lane_bytes
    assert stats["recurrent_stash_bytes_per_lane"] == 0  # no drafts: nothing stashed, no copy


async def test_mutation_without_zeroing_at_open_turns_red(hybrids, plain, monkeypatch):
    from tf_async.engine.runner import Runner

    monkeypatch.setattr(Runner, "prepare_lanes", lambda self, plan: None)
    async with engine(hybrids["dense-hf-bf16"], parallel=2) as eng:
        eng.parts.runner.states.delta[...] = -3.0
        got = await run_all(eng, "greedy", PROMPTS[:2])
    assert got != plain["dense-hf-bf16", "greedy"][:2]


# ---- forced drafts: exact rollback, and the MTP ring in sync --------------------------------
class ForcedDrafts:
    """Wraps the engine's drafter: its own proposal runs (recorded, to check against drafts
    recomputed from scratch); with `truth`, the verify rows then get the tokens the target will
    emit, made wrong at a cycling index, so every acceptance length 0..k happens."""

    WRONG_AT = (0, None, 1, 2, None, 3)

    def __init__(self, inner, vocab: int, truth: dict[tuple[int, ...], list[int]] | None = None):
        self.inner = inner
        self.truth = truth
        self.vocab = vocab
        self.proposals: list[tuple[list[int], object, int, tuple[int, ...]]] = []
        self._wrong = itertools.cycle(self.WRONG_AT)

    def __getattr__(self, name: str):  # the rest of the Drafter interface
        return getattr(self.inner, name)

    def propose(self, seq, limit: int) -> tuple[int, ...]:
        drafts = self.inner.propose(seq, limit)
        count = min(limit, self.inner.draft_tokens)
        if count > 0:
            tokens = [*seq.prompt_ids, *seq.output_ids]
            self.proposals.append((tokens, replace_seq(seq), count, drafts))
        if self.truth is None:
            return drafts
        done = len(seq.output_ids)
        forced = list(self.truth[tuple(seq.prompt_ids)][done:done + count])
        wrong = next(self._wrong)
        if wrong is not None and wrong < len(forced):
            forced[wrong] = (forced[wrong] + 1) % self.vocab
        return tuple(forced)

    def check_proposals(self) -> None:
        """Every proposal equals the drafts recomputed from scratch (the ring was in sync)."""
        assert len(self.proposals) > 5
        for tokens, seq, count, drafts in self.proposals:
            assert drafts == fresh_mtp_drafts(self.inner.head, tokens, seq, count), tokens


def replace_seq(seq):  # a frozen copy of what sampling reads
    return replace(seq, output_ids=list(seq.output_ids))


def fresh_mtp_drafts(head, tokens: list[int], seq, count: int) -> tuple[int, ...]:
    """Drafts from scratch: the target over tokens[:-1] on a fresh state, every MTP slot in a
    fresh ring, then `count` draft steps sampled as the target would."""
    decoder, ops = head.decoder, head.ops
    cfg, num = decoder.config, len(tokens)
    pos = np.arange(num - 1, dtype=np.int64)
    batch = ForwardBatch(np.asarray(tokens[:-1], np.int64), pos, pos.copy(),
                         np.zeros(num - 1, np.int32), np.zeros((1, 1), np.int32),
                         np.asarray([num - 2], np.int64), 128, np.zeros(1, np.int32))
    kv = ops.alloc_kv(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim, "f32")
    _, hidden = decoder.forward(batch, kv, np.ones((cfg.num_layers, 2), np.float32),
                                states=decoder.new_states(1), all_hidden=True)
    ring = ops.alloc_kv(1, 128, cfg.num_kv_heads, cfg.head_dim, "f32")
    logits, out = head.rows(np.asarray(tokens[1:], np.int64), pos, hidden, ring)
    row, prev, outputs, drafts = logits[-1], out[-1:], list(seq.output_ids), []
    for step in range(count):
        token = choose_like_target(seq, row, outputs, num + step)
        if token in seq.stop_ids:
            break
        drafts.append(token)
        outputs.append(token)
        logits, prev = head.rows(np.asarray([token], np.int64),
                                    np.asarray([num - 1 + step], np.int64), prev, ring)
        row = logits[-1]
    return tuple(drafts)


@pytest.mark.parametrize("name", ["dense-mlx4", "moe-hf-bf16-per-expert-mtp"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_forced_drafts_roll_back_exactly_and_mtp_stays_in_sync(hybrids, plain, name, mode):
    ckpt, truth = hybrids[name], plain[name, mode]
    one_area = name.startswith("moe")  # one drafter area: the other lanes own their context
    eng = engine(ckpt, parallel=4, step_tokens=7, drafter="mtp", draft_tokens=4,
                 draft_areas=1 if one_area else None)
    async with eng:
        ids = {tuple(eng.tokenizer.encode(p)): out for p, out in zip(PROMPTS, truth, strict=True)}
        forced = ForcedDrafts(eng.parts.scheduler.drafter, ckpt.config.vocab_size, ids)
        eng.parts.scheduler.drafter = forced
        got = await run_all(eng, mode)
        stats = await idle_stats(eng)
    assert got == truth
    assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"]
    assert (stats["draft_contexts_owned"] > 0) == one_area
    forced.check_proposals()


async def test_mtp_proposals_equal_drafts_from_scratch(hybrids, plain):
    """Unforced, seeded: the MTP drafter's own drafts equal a fresh recomputation."""
    ckpt = hybrids["moe-mlx4"]
    async with engine(ckpt, parallel=2, step_tokens=5, drafter="mtp", draft_tokens=3) as eng:
        spy = ForcedDrafts(eng.parts.scheduler.drafter, ckpt.config.vocab_size)
        eng.parts.scheduler.drafter = spy
        got = await run_all(eng, "seeded", PROMPTS[:3])
        await idle_stats(eng)
    assert got == plain["moe-mlx4", "seeded"][:3]
    spy.check_proposals()


class RingSnapshots:
    """Wraps the engine's MTP drafter: the stream's ring (host copy) after every proposal, and
    the head's slot writes (calls, rows)."""

    def __init__(self, inner):
        self.inner = inner
        self.rings: list[tuple[int, tuple[int, ...], np.ndarray]] = []
        self.writes: list[int] = []
        head, write = inner.head, inner.head.write_slots

        def counted(token_ids, *args, **kw):
            self.writes.append(len(token_ids))
            return write(token_ids, *args, **kw)

        head.write_slots = counted

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, seq, limit: int) -> tuple[int, ...]:
        drafts = self.inner.propose(seq, limit)
        ctx = self.inner.contexts.get(seq)
        if drafts and ctx is not None:
            ring = np.array(self.inner.ops.to_host(ctx.views.ring), copy=True)
            self.rings.append((seq.num_tokens, drafts, ring))
            if self.inner.page_slots is not None:  # every slot the ring got before the draft
                assert ctx.num_kept == ctx.num_valid  # steps is on the pages already
        return drafts


@pytest.mark.parametrize(("prefix_cache", "pad"), [(True, False), (False, False), (False, True)])
async def test_mtp_slots_wait_while_drafts_pause_and_the_ring_is_the_same(hybrids, plain,
                                                                         monkeypatch, prefix_cache,
                                                                         pad):
    """While a stream's drafts are paused (draft pacing) its MTP slots wait in the area's
    pending rows and are written in one call when the ring is next read (with a prefix cache:
    also at each page's last slot): far fewer writes than rounds, and after every proposal the
    ring and the proposal are bit for bit those of slot-by-slot writes (PENDING_ROWS 0). pad:
    the writes padded to a power of two rows (as on CUDA, where graphs replay them)."""
    from tf_async.engine.drafters import mtp

    name, max_tokens, rows = "moe-mlx4", 40, mtp.PENDING_ROWS
    runs = {}
    for pending in (rows, 0):
        monkeypatch.setattr(mtp, "PENDING_ROWS", pending)
        async with engine(hybrids[name], parallel=1, drafter="mtp", draft_tokens=3,
                          prefix_cache=prefix_cache) as eng:
            spy = RingSnapshots(eng.parts.scheduler.drafter)
            spy.inner.head.pad_writes = pad and pending > 0
            eng.parts.scheduler.drafter = spy
            got = [(await eng.complete(p, max_tokens=max_tokens)).token_ids for p in PROMPTS[:3]]
            stats = await idle_stats(eng)
        runs[pending] = (got, spy.rings, spy.writes, stats)
    (got, rings, writes, stats), (got0, rings0, writes0, _) = runs[rows], runs[0]
    assert got == got0
    assert stats["draft_paused_rounds"] > 20
    assert len(rings) == len(rings0) > 3
    for (n, drafts, ring), (n0, drafts0, ring0) in zip(rings, rings0, strict=True):
        assert (n, drafts) == (n0, drafts0)
        assert np.array_equal(ring.view(np.uint8), ring0.view(np.uint8)), n
    # every slot written once, in fewer calls; a stream's last pending ones (after its last
    # proposal, within its last page with a prefix cache) are never read, so never written
    assert 0 <= sum(writes0) - sum(writes) < 3 * (4 if prefix_cache else rows)
    assert len(writes) < len(writes0) // (2 if prefix_cache else 4)
    assert max(writes) > (3 if prefix_cache else 8)


async def test_mtp_writes_no_more_slots_than_its_ring_has_rows(hybrids):
    """--draft-ring shorter than the prompts: a prompt's slots go to the ring as its newest
    ring-full only (older ones would share ring rows within one write: on a GPU, which lands
    is not defined); outputs as without drafts."""
    ring = 8
    async with engine(hybrids["moe-mlx4"], parallel=1, drafter="mtp", draft_tokens=3,
                      draft_ring=ring) as eng:
        spy = RingSnapshots(eng.parts.scheduler.drafter)
        eng.parts.scheduler.drafter = spy
        got = [(await eng.complete(p, max_tokens=MAX_TOKENS)).token_ids for p in PROMPTS[:3]]
        await idle_stats(eng)
    async with engine(hybrids["moe-mlx4"], parallel=1) as eng:
        plain = [(await eng.complete(p, max_tokens=MAX_TOKENS)).token_ids for p in PROMPTS[:3]]
    assert got == plain
    assert spy.writes and max(spy.writes) == ring and len(spy.rings) > 0


# ---- cancels, failures, fp8 -----------------------------------------------------------------
@pytest.mark.parametrize("spec", ["mtp", "ngram"])
async def test_cancels_mid_draft_leave_others_equal_to_plain(hybrids, plain, spec):
    name = "dense-hf-bf16"
    cancel_after = [None, 1, None, 5, 2, None, 9, None]
    async with engine(hybrids[name], parallel=3, step_tokens=5, drafter=spec,
                      draft_tokens=4) as eng:
        results = await run_with_cancels(eng, PROMPTS, lambda i: sampling("seeded", i),
                                         cancel_after, cancel_task=7)
        stats = await idle_stats(eng)
    for i, got in enumerate(results):
        if cancel_after[i] is None and i != 7:
            assert got == plain[name, "seeded"][i], i
    assert stats["draft_area_bytes_in_use"] == 0 and stats["drafted_tokens"] > 0


@pytest.mark.parametrize("forced", [False, True])
async def test_failure_inside_a_hybrid_forward_never_leaves_a_wrong_stream(hybrids, plain,
                                                                           forced):
    """The forward fails after it advanced the states: lanes frozen for verification (forced
    drafts) kept their state and run alone; the others' state is lost, so they fail clearly."""
    name = "dense-mlx4"
    async with engine(hybrids[name], parallel=4, drafter="mtp" if forced else None,
                      draft_tokens=2) as eng:
        runner = eng.parts.runner
        if forced:  # every decode round verifies drafts: those lanes are saved
            ids = {tuple(eng.tokenizer.encode(p)): out
                   for p, out in zip(PROMPTS, plain[name, "greedy"], strict=True)}
            eng.parts.scheduler.drafter = ForcedDrafts(eng.parts.scheduler.drafter,
                                                       hybrids[name].config.vocab_size, ids)
        real_forward, real_lost = runner.decoder.forward, runner._lost_states
        rounds, seen = itertools.count(), []

        def forward(batch, kv, scales, **kw):
            out = real_forward(batch, kv, scales, **kw)
            if len(batch.token_ids) > 1 and next(rounds) == 12:
                raise RuntimeError("injected failure after the state advanced")
            return out

        def lost_states(plan, saved):
            lost = real_lost(plan, saved)
            seen.append((saved, lost))
            return lost

        runner.decoder.forward, runner._lost_states = forward, lost_states
        outs = await asyncio.gather(*(eng.complete(p, **sampling("greedy", i))
                                      for i, p in enumerate(PROMPTS)), return_exceptions=True)
        await idle_stats(eng)
    failed = [str(o) for o in outs if isinstance(o, Exception)]
    assert all("recurrent state was lost" in e for e in failed), failed
    for i, out in enumerate(outs):
        if not isinstance(out, Exception):
            assert out.token_ids == plain[name, "greedy"][i], i
    (saved, lost), = seen  # one failed round
    assert len(lost) == len(failed) > 0 and len(failed) < len(PROMPTS)
    assert len(saved) > 0 if forced else saved == ()  # saved lanes ran alone, equal to plain


async def test_failure_inside_a_round_of_decode_steps_fails_its_streams_clearly(hybrids, plain):
    """Decode steps (several forwards a round, the state advancing at each): a forward that
    fails after its step advanced the states loses them, so every stream of that round fails
    with a clear error; the others and a request after it equal plain, and idle is clean."""
    name = "dense-mlx4"
    async with engine(hybrids[name], parallel=4, decode_steps=4) as eng:
        runner = eng.parts.runner
        real_forward, real_steps, calls = runner.decoder.forward, runner._forward_steps, itertools.count()
        stepped: list[int] = []
        in_steps = [False]

        def forward_steps(*args):
            in_steps[0] = True
            try:
                return real_steps(*args)
            finally:
                in_steps[0] = False

        def forward(batch, kv, scales, **kw):
            out = real_forward(batch, kv, scales, **kw)
            if in_steps[0] and len(batch.token_ids) > 1 and next(calls) == 5:
                stepped.append(len(batch.token_ids))
                raise RuntimeError("injected failure inside a round of decode steps")
            return out

        runner.decoder.forward, runner._forward_steps = forward, forward_steps
        outs = await asyncio.gather(*(eng.complete(p, **sampling("greedy", i))
                                      for i, p in enumerate(PROMPTS)), return_exceptions=True)
        runner.decoder.forward = real_forward
        after = await eng.complete(PROMPTS[0], **sampling("greedy", 0))
        stats = await idle_stats(eng)
    failed = [str(o) for o in outs if isinstance(o, Exception)]
    assert stepped and len(failed) == stepped[0], (stepped, failed)
    assert all("recurrent state was lost" in e for e in failed), failed
    for i, out in enumerate(outs):
        if not isinstance(out, Exception):
            assert out.token_ids == plain[name, "greedy"][i], i
    assert after.token_ids == plain[name, "greedy"][0]
    assert stats["rounds"] > 0


async def test_a_failed_mtp_sync_stops_drafting_for_that_stream_only(hybrids, plain, caplog):
    """The MTP ring's sync fails for one request: that stream decodes on without drafts, its
    output and every other stream's equal plain, the failure is logged, idle is clean."""
    from tf_async.engine.drafters.mtp import MtpDrafter

    name = "dense-mlx4"
    real_sync = MtpDrafter._sync
    failing: set[int] = set()

    def sync(self, ctx, seq, *args):
        if not failing:
            failing.add(seq.request_id)
        if seq.request_id in failing:
            raise RuntimeError("injected sync failure")
        return real_sync(self, ctx, seq, *args)

    async with engine(hybrids[name], drafter="mtp") as eng:
        drafter = eng.parts.scheduler.drafter
        drafter._sync = sync.__get__(drafter)
        got = await run_all(eng, "greedy")
        stats = await idle_stats(eng)
    assert got == plain[name, "greedy"]
    assert "MTP sync failed for request" in caplog.text and len(failing) == 1
    assert stats["draft_area_bytes_in_use"] == 0 and stats["drafted_tokens"] > 0


async def test_fp8_kv_calibrates_and_mtp_drafts_equal_plain(hybrids):
    ckpt = hybrids["moe-mlx4"]
    results = {}
    for spec in (None, "mtp"):
        async with engine(ckpt, kv_dtype="fp8", drafter=spec) as eng:
            results[spec] = await run_all(eng, "seeded", PROMPTS[:4])
            scales = eng.parts.arena.kv_scales
            ring_scales = None if spec is None else eng.parts.scheduler.drafter.kv_scales
            await idle_stats(eng)
    assert results["mtp"] == results[None]
    assert not np.allclose(scales, 1.0) and not np.allclose(ring_scales, 1.0)


# ---- refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hf", "mlx"])
async def test_declared_mtp_without_weights_is_refused_clearly(tmp_path, kind):
    extra = {"dtype": "f32", "with_mtp": False} if kind == "hf" else {"bits": 4, "keep_mtp": False}
    path = write_variant(tmp_path / kind, False, kind, **extra)
    with pytest.raises(BadInputError, match=r"no MTP layer.*declares mtp_num_hidden_layers=1 "
                                            r"but the files hold no mtp\.\* tensors"):
        async with engine(str(path), drafter="mtp"):
            pass
    async with engine(str(path), drafter="ngram") as eng:  # the model itself serves
        assert len((await eng.complete(PROMPTS[0], max_tokens=3)).token_ids) == 3


async def test_a_hybrid_as_draft_model_is_refused(hybrids, tiny_llama):
    path = hybrids["dense-hf-bf16"].path
    with pytest.raises(BadInputError, match="recurrent state.*--drafter mtp"):
        async with engine(hybrids["dense-hf-bf16"], drafter=f"draft:{path}"):
            pass
    with pytest.raises(BadInputError, match="no MTP layer"):
        async with engine(tiny_llama, drafter="mtp"):
            pass


async def test_memory_report_counts_the_recurrent_state(hybrids):
    from tf_async.engine.area import lane_memory_lines, mib

    ckpt = hybrids["moe-mlx4"]
    lane_bytes = 4 * 3 * (3 * 128 + 4 * 16 * 16)
    lines = lane_memory_lines("tiny", ckpt.config, ckpt.config, parallel=8, ctx=1024,
                              kv_dtype="bf16", drafter_layers=1, drafter_name="mtp",
                              recurrent_bytes=lane_bytes, stash_bytes=1000)
    assert "fixed a lane: 0.3 MiB -> 0 MiB" in lines[2]  # MTP ring: 2 * 1024 rows * 2 * 32 * 2 B
    assert lines[-1] == (f"  recurrent state a lane (in the run, zeroed at open): {mib(lane_bytes)}"
                         f" + verify stash {mib(1000)}; all lanes {mib(8 * (lane_bytes + 1000))}")


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
async def test_mtp_drafts_chosen_where_the_logits_are(hybrids, monkeypatch, mode):
    """On ops that choose tokens on the 'device' (the CPU stand-in of the GPU's sampler), each
    MTP draft is chosen there and fed to the next step as it is: no host read a step, the k ids
    come back in one copy; outputs equal plain decoding on the same ops, and the greedy
    proposals equal drafts recomputed from scratch."""
    from tests.engine_helpers import engines_on_ops
    from tests.test_device_sampling import DeviceStyleOps
    from tf_async.engine.choice import TargetChooser

    made = engines_on_ops(monkeypatch, DeviceStyleOps)
    host_reads: list[int] = []
    read_on_host = TargetChooser.__call__

    def counted(self, *args):
        host_reads.append(1)
        return read_on_host(self, *args)

    monkeypatch.setattr(TargetChooser, "__call__", counted)
    ckpt = hybrids["dense-mlx4"]
    async with engine(ckpt, parallel=2, step_tokens=5) as eng:
        want = await run_all(eng, mode, PROMPTS[:3])
    async with engine(ckpt, parallel=2, step_tokens=5, drafter="mtp", draft_tokens=3) as eng:
        spy = ForcedDrafts(eng.parts.scheduler.drafter, ckpt.config.vocab_size)
        eng.parts.scheduler.drafter = spy
        got = await run_all(eng, mode, PROMPTS[:3])
        stats = await idle_stats(eng)
    assert got == want
    assert stats["drafted_tokens"] > 0 and host_reads == []
    assert ((3,), "int64") in made[-1].copies  # a proposal's k ids in one copy
    if mode == "greedy":  # the stand-in's seeded sampler is the GPU's, not sample_token
        spy.check_proposals()
