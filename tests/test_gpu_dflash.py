"""DFlash / DFlash2 drafters on a real GPU (`pytest -m gpu`, needs CuPy and a CUDA GPU).

1. The kernels of cuda_kernels/dflash.py (through backend/cuda_dflash.py, on CuPy arrays)
   against their CPU twins (tf_async/backend/cpu/dflash.py) and float64 references at the real
   sizes of the 27B DFlash2 (H 5120, groups of 16, conv kernel 2, 32 heads / 8 KV heads of 128,
   block 16 over a 2047-row sliding window; vocabulary 248320, top 16, rank 256): the grouped
   convolution, block attention, the top-k (exactly the CPU's, ties to the lower id) and the
   greedy chain (the float64 reference's path).
2. The tiny drafter's block logits on the GPU against the CPU's, and the same greedy drafts.
3. The engine: drafted == plain in every gate with `dflash:PATH` on a tiny dense target
   (DFlash and DFlash2) and a tiny hybrid (DFlash2), greedy and seeded; 0 pages / 0 lanes /
   0 drafter areas at idle; resumed streams (prefix cache) keep drafting on the GPU.

Bounds (relative Frobenius error, GPU against the CPU twin on the same float32 inputs; the two
differ by rounding only: FMA contraction, summation order of the dot products): convolution
2e-6, attention 1e-5, tiny block logits max |gpu - cpu| / max |cpu| <= 1e-4.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.cuda_sim_check import dflash_attention_ref, dflash_chain_ref, dflash_conv_ref, rel_err
from tests.tiny_dflash import dflash_config, dflash_weights, write_dflash
from tf_async.backend.cpu import dflash as cpu

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops() -> Any:
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    from tf_async.backend.cuda_ops import CudaOps

    return CudaOps()


@pytest.fixture(scope="module")
def kernels(ops) -> Any:
    from tf_async.backend.dflash_ops import make_dflash_ops

    return make_dflash_ops(ops)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


# ---- 1. kernels at real sizes ------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 16])
def test_grouped_conv_matches_cpu_twin(ops, kernels, rng, rows) -> None:
    hidden, group, k = 5120, 16, 2
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    taps = rng.standard_normal((rows, 2, k, hidden // group)).astype(np.float32)[:, 0]
    base = rng.standard_normal((k, hidden)).astype(np.float32)
    got = ops.to_host(kernels.grouped_conv(ops.asarray(x), ops.asarray(taps), ops.asarray(base), group))
    want = np.full_like(x, np.nan)
    cpu.grouped_conv(x, np.ascontiguousarray(taps), base, group, want)
    assert rel_err(got, want) < 2e-6
    if rows == 16:
        assert rel_err(got, dflash_conv_ref(x, np.ascontiguousarray(taps), base, group)) < 2e-6


@pytest.mark.parametrize("ring,causal", [(2047, False), (300, True)])
def test_block_attention_matches_cpu_twin(ops, kernels, rng, ring, causal) -> None:
    block, nh, nkv, hd, window = 16, 32, 8, 128, 2048
    q = rng.standard_normal((block, nh, hd)).astype(np.float32)
    keys = rng.standard_normal((ring + block, nkv, hd)).astype(np.float32)
    values = rng.standard_normal((ring + block, nkv, hd)).astype(np.float32)
    qpos = np.arange(5000, 5000 + block)
    diff = qpos[:, None] - np.concatenate([np.arange(5000 - ring, 5000), qpos])[None, :]
    visible = (diff < window) & (-diff < window) & ((diff >= 0) if causal else True)
    visible = visible.astype(np.uint8)
    got = ops.to_host(kernels.block_attention(*(ops.asarray(a) for a in (q, keys, values, visible)),
                                              hd ** -0.5))
    want = np.full_like(q, np.nan)
    cpu.block_attention(q, keys, values, visible, hd ** -0.5, want)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, dflash_attention_ref(q, keys, values, visible, hd ** -0.5)) < 1e-5


@pytest.mark.parametrize("split", [False, True])
def test_selector_topk_and_chain_at_real_sizes(ops, kernels, rng, split, monkeypatch) -> None:
    import cuda_kernels.dflash

    monkeypatch.setattr(cuda_kernels.dflash, "SPLIT_TOPK", split)
    rows, vocab, top_k, rank = 15, 248320, 16, 256
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    logits[0, [11, 70000, 70001, 248319]] = 40.0  # ties: lower id first
    logits[1, :1000] = -np.inf
    ids, values = kernels.top_k(ops.asarray(logits), top_k)
    want_ids, want_values = np.empty((rows, top_k), np.int64), np.empty((rows, top_k), np.float32)
    cpu.topk_rows(logits, top_k, want_ids, want_values)
    assert np.array_equal(ids, want_ids) and np.array_equal(values, want_values)
    assert list(want_ids[0, :4]) == [11, 70000, 70001, 248319]
    projected = (rng.standard_normal((rows, rank)) * 0.1).astype(np.float32)
    books = [rng.standard_normal((vocab, rank)).astype(np.float32) for _ in range(2)]
    path = kernels.select_greedy(ops.asarray(logits), ops.asarray(projected),
                                 ops.asarray(books[0]), ops.asarray(books[1]), 123, top_k)
    ref = dflash_chain_ref(want_ids, want_values, projected, books[0], books[1], 123)
    assert np.array_equal(path, ref), (path, ref)


# ---- 2. the tiny drafter's forward -------------------------------------------------------
@pytest.mark.parametrize("generation", [1, 2])
def test_tiny_block_logits_close_to_cpu_and_same_drafts(ops, tiny_llama, tmp_path, generation) -> None:
    from tf_async.backend.cpu.ops import CpuOps
    from tf_async.models.dflash import load_dflash
    from tf_async.models.dflash_model import DFlashModel

    cfg = dflash_config(generation)
    ckpt = load_dflash(write_dflash(tmp_path, cfg, dflash_weights(cfg, seed=generation)))
    features = np.random.default_rng(3).standard_normal((9, 128)).astype(np.float32)
    results = []
    for backend in (CpuOps(), ops):
        target = tiny_llama.weights
        model = DFlashModel(ckpt, backend, backend.upload_linear(target.embed),
                            backend.upload_linear(target.lm_head))
        ring = model.new_ring(16)
        model.write_context(ring, backend.asarray(features), np.arange(9))
        logits, _ = model.block_logits(ring, 9, 17)
        results.append((backend.to_host(logits), model.propose(ring, 9, 17)))
    (cpu_logits, cpu_drafts), (gpu_logits, gpu_drafts) = results
    assert np.abs(gpu_logits - cpu_logits).max() / np.abs(cpu_logits).max() <= 1e-4
    assert list(gpu_drafts) == list(cpu_drafts)


@pytest.mark.parametrize("generation", [1, 2])
def test_drafter_graphs_give_the_eager_drafts_and_ring(ops, tiny_llama, tmp_path, generation) -> None:
    """DFlashModel(graphs=True): greedy blocks and context writes replayed from CUDA graphs
    (keyed by the ring's address and the padded key count / rows): the same drafts and ring
    bits as the eager model, over rounds of 1-4 new rows whose blocks cross key buckets, in
    two rings at once; the calls really were replayed."""
    import cupy

    from tf_async.models.dflash import load_dflash
    from tf_async.models.dflash_model import DFlashModel

    cfg = dflash_config(generation)
    ckpt = load_dflash(write_dflash(tmp_path, cfg, dflash_weights(cfg, seed=generation)))
    c, target = ckpt.config, tiny_llama.weights
    width = len(c.target_layer_ids) * c.hidden_size

    def drive(graphs: bool) -> tuple[list[np.ndarray], Any]:
        model = DFlashModel(ckpt, ops, ops.upload_linear(target.embed),
                            ops.upload_linear(target.lm_head), graphs=graphs)
        local, seen = np.random.default_rng(5), []
        rings, pos = [model.new_ring(64), model.new_ring(64)], [0, 0]
        for _ in range(12):
            for r, ring in enumerate(rings):
                n = int(local.integers(1, 5))
                feats = cupy.asarray(local.standard_normal((n, width)).astype(np.float32))
                rows = model.write_context(ring, feats, np.arange(pos[r], pos[r] + n))
                pos[r] += n
                drafts = model.propose(ring, pos[r], int(local.integers(3, 60)))
                seen += [cupy.asnumpy(rows), np.asarray(drafts), cupy.asnumpy(ring)]
        return seen, model.graphs

    eager, _ = drive(False)
    graphed, graphs = drive(True)
    for i, (a, b) in enumerate(zip(eager, graphed, strict=True)):
        assert np.array_equal(a, b), f"output {i}: graphed != eager"
    assert graphs is not None and graphs.num_replays > 20 and graphs.num_captures >= 4


# ---- 3. the engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def targets(ops, tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str]]:
    from tests import tiny_qwen35 as tq
    from tf_async.models.loader import load_checkpoint

    out: dict[str, tuple[Any, str]] = {}
    for generation in (1, 2):
        cfg = dflash_config(generation)
        path = write_dflash(tmp_path_factory.mktemp(f"g{generation}"), cfg,
                            dflash_weights(cfg, seed=generation))
        out[f"dense{generation}"] = (tiny_llama, f"dflash:{path}")
    hcfg = tq.tiny_qwen35_config(moe=False)
    hybrid = load_checkpoint(tq.write_qwen35_hf(tmp_path_factory.mktemp("hybrid"), hcfg,
                                                tq.random_qwen35_weights(hcfg, seed=5), "bf16"))
    cfg = dflash_config(2, num_target_layers=4)
    cfg["dflash_config"]["target_layer_ids"] = [1, 3]
    path = write_dflash(tmp_path_factory.mktemp("gh"), cfg, dflash_weights(cfg, seed=9))
    out["hybrid2"] = (hybrid, f"dflash:{path}")
    return out


@pytest.mark.parametrize("name", ["dense2", "hybrid2"])
def test_rounds_that_capture_layers_replay_graphs_with_the_eager_bits(targets, name) -> None:
    """GraphDecoder, rounds handing out target layers' outputs (what DFlash reads): replayed
    from graphs (1- and 4-row rounds, every row a logit row) with the eager decoder's logits,
    layer rows and KV bits; a prompt-shaped round runs eagerly in both."""
    from dataclasses import replace

    import cupy

    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.models.batch_io import pack_batch
    from tf_async.models.graph_decoder import GraphDecoder
    from tf_async.models.loader import make_decoder

    ckpt, _ = targets[name]
    page = 4

    def drive(decoder: Any) -> list[np.ndarray]:
        cfg, hybrid = decoder.config, decoder.states is not None
        hybrid_of = getattr(decoder.weights, "hybrid", None)  # a hybrid's trunk: GDN layers too
        layers = (0, (cfg.num_layers if hybrid_of is None else hybrid_of.num_trunk_layers) - 2)
        kv = decoder.ops.alloc_kv(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, "f32")
        scales = decoder.ops.asarray(np.ones((cfg.num_layers, 2), np.float32))
        if hybrid:
            decoder.states.zero(0)
        local, pos, seen = np.random.default_rng(3), 0, []
        for n, logits_of in ((6, [5]), (1, None), (1, None), (4, None), (1, None), (4, None), (4, None)):
            batch = pack_batch(decoder.ops, token_ids=local.integers(3, cfg.vocab_size, n),
                               positions=np.arange(pos, pos + n), row_seq=np.zeros(n, np.int32),
                               block_table=np.arange(16, dtype=np.int32)[None], page_size=page,
                               logit_rows=np.arange(n) if logits_of is None else logits_of,
                               slots=np.arange(pos, pos + n), seq_lanes=[0] if hybrid else None)
            logits, rows = decoder.forward(replace(batch, capture_layers=layers), kv, scales,
                                           all_hidden=True)
            assert rows.shape == (n, len(layers) * cfg.hidden_size)
            seen += [cupy.asnumpy(logits), cupy.asnumpy(rows)]
            pos += n
        return [*seen, cupy.asnumpy(kv)]

    eager = drive(make_decoder(ckpt, CudaOps(), num_lanes=1))
    graphed = GraphDecoder(make_decoder(ckpt, CudaOps(), num_lanes=1))  # type: ignore[arg-type]
    replayed = drive(graphed)
    for i, (a, b) in enumerate(zip(eager, replayed, strict=True)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"output {i}: graphed != eager"
    assert graphed.num_feature_replays >= 3 and all(g is not None for g in graphed._graphs.values())


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["dense1", "dense2", "hybrid2"])
async def test_every_gate_holds_with_dflash_on_the_gpu(targets, name, monkeypatch) -> None:
    """drafted == plain in every gate; the target's rounds that hand DFlash its layers replay
    graphs."""
    from tests.engine_helpers import graph_decoders_built
    from tf_async.gate import PROMPTS, run_gates
    from tf_async.models.graph_decoder import GraphDecoder

    made = graph_decoders_built(monkeypatch)
    ckpt, spec = targets[name]
    rows, idle = await run_gates(ckpt, device="cuda", max_tokens=10, ctx=128,
                                 prompts=PROMPTS[:6], drafters=(spec,), temperature=8.0)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert sum(g.num_feature_replays for g in made if isinstance(g, GraphDecoder)) > 0
    assert idle[f"drafted-{spec}-seeded"]["drafted_tokens"] > 0, sorted(idle)
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())
    assert all(s.get("draft_areas_in_use", 0) == 0 for s in idle.values())


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["dense2", "hybrid2"])
async def test_resumed_streams_keep_drafting_on_the_gpu(targets, name) -> None:
    """A two-turn chat and streams sharing a prefix: outputs equal a cache-less engine's, and
    the resumed turns draft (their rings rebuilt from the rows kept beside the pages)."""
    from tf_async import Engine

    ckpt, spec = targets[name]
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 60, 41).tolist()
    prompts = [prefix + rng.integers(3, 60, 3 + i).tolist() for i in range(4)]
    # A hybrid resumes from a state kept every 4 pages (16 tokens: inside the shared prefix).
    opts: dict[str, Any] = dict(device="cuda", parallel=4, ctx=128, page_size=4, step_tokens=16,
                                drafter=spec, draft_tokens=3, prefix_state_pages=4)

    async def run(eng: Engine) -> list[Any]:
        first = await eng.complete(prompts[0], max_tokens=10, ignore_eos=True)
        rest = await asyncio.gather(*(eng.complete(p, max_tokens=10, ignore_eos=True, temperature=0.9,
                                                   seed=i) for i, p in enumerate(prompts)))
        return [first, *rest]

    async with Engine(ckpt, **opts) as eng:
        resumed = await run(eng)
        stats = eng.parts.scheduler.drafter_stats()
    async with Engine(ckpt, **opts, prefix_cache=False) as eng:
        fresh = await run(eng)
    assert [d.token_ids for d in resumed] == [d.token_ids for d in fresh]
    assert all(d.usage.cached_tokens > 0 for d in resumed[1:])
    assert sum(d.usage.drafted_tokens for d in resumed[1:]) > 0
    assert stats["draft_areas_in_use"] == 0
