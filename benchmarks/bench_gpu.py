"""H200 benchmark: a random-weight model of Qwen3-8B's shapes, generated on the device.

Drives `Decoder` + `Arena` directly with token ids (no scheduler, no tokenizer): one prefill
round of all prompts, then greedy decode rounds of all streams (argmax on the device, token
ids to the host each round). Weights: affine 4-bit (group 64) codes/scales drawn with CuPy,
and the same weights dequantized to bf16 (DenseWeight of uint16 bits); transformers runs the
bf16 copy (PyTorch, static cache) for batch-1 decode. Prints a table; records nothing.

Every forward runs as the engine's runner runs it: indices checked once on the host, no
per-op device checks (before session 3's change of this script, each op also synced). Per
decode round it reports: eager round time (one Python launch per kernel, as the engine runs
without --cuda-graphs), graph round time (GraphDecoder: inputs copied into a captured CUDA graph, one
replay), the graph's GPU time alone (replays timed with events), and the roofline: the
bytes the round must read (every weight once + each stream's KV) over the device-to-device
copy bandwidth measured here (bytes read + written per second).

    python benchmarks/bench_gpu.py [--layers 36] [--parallel 1,8,32] [--no-torch]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

QWEN3_8B = dict(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)
PAGE_SIZE = 16
GROUP_SIZE = 64


@dataclass
class Row:
    model: str
    parallel: int
    prefill_tps: float
    eager_ms: float
    graph_ms: float
    gpu_ms: float
    gb_per_round: float
    roofline_ms: float

    @property
    def decode_tps(self) -> float:
        return self.parallel / (self.graph_ms / 1e3)


def copy_bandwidth(cp, num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = cp.random.random(num_bytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    for _ in range(3):
        dst[...] = src
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(10):
        start.record()
        dst[...] = src
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * src.nbytes / float(np.median(times))


def affine_weight(cp, out_f: int, in_f: int):
    """Random 4-bit affine weight on the device, entries ~ uniform with std ~ 1/sqrt(in_f)."""
    from tf_async.backend.weights import AffineWeight

    words, groups = in_f // 8, in_f // GROUP_SIZE
    codes = (cp.random.random((out_f, words), dtype=cp.float64) * 2.0**32).astype(cp.uint32)
    scales = ((cp.random.random((out_f, groups), dtype=cp.float32) + 0.5)
              / np.float32(4.6 * math.sqrt(in_f))).astype(cp.float32)
    return AffineWeight(codes, scales, (-7.5 * scales).astype(cp.float32), 4, GROUP_SIZE)


def to_bf16(cp, w):
    """The affine weight dequantized and rounded to bf16 bits (DenseWeight of uint16)."""
    from tf_async.backend.weights import DenseWeight

    out_f, words = w.codes.shape
    shifts = cp.arange(8, dtype=cp.uint32) * 4
    res = cp.empty((out_f, words * 8), cp.uint16)
    for r0 in range(0, out_f, 8192):
        r1 = min(out_f, r0 + 8192)
        q = ((w.codes[r0:r1, :, None] >> shifts) & 15).astype(cp.float32)
        q = q.reshape(r1 - r0, -1, GROUP_SIZE)
        vals = (q * w.scales[r0:r1, :, None] + w.biases[r0:r1, :, None]).reshape(r1 - r0, -1)
        u = vals.view(cp.uint32)
        res[r0:r1] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
    return DenseWeight(res)


def random_model(cp, num_layers: int):
    """(ModelConfig, 4-bit ModelWeights) with every matrix drawn on the device."""
    from tf_async.models.checkpoint import LayerWeights, ModelWeights
    from tf_async.models.config import ModelConfig

    shapes = {**QWEN3_8B, "num_layers": num_layers}
    cfg = ModelConfig(arch="qwen3", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                      qk_norm=True, name="random-qwen3-8b", **shapes)
    H, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    rng = np.random.default_rng(0)

    def norm(dim: int) -> np.ndarray:  # tiny: drawn on the host
        return (1.0 + 0.05 * rng.standard_normal(dim)).astype(np.float32)

    layers = [LayerWeights(
        input_norm=norm(H), post_norm=norm(H), q=affine_weight(cp, cfg.num_heads * hd, H),
        k=affine_weight(cp, cfg.num_kv_heads * hd, H), v=affine_weight(cp, cfg.num_kv_heads * hd, H),
        o=affine_weight(cp, H, cfg.num_heads * hd), q_norm=norm(hd), k_norm=norm(hd),
        gate=affine_weight(cp, inter, H), up=affine_weight(cp, inter, H), down=affine_weight(cp, H, inter))
        for _ in range(num_layers)]
    weights = ModelWeights(embed=affine_weight(cp, cfg.vocab_size, H),
                           lm_head=affine_weight(cp, cfg.vocab_size, H), final_norm=norm(H), layers=layers)
    return cfg, weights


def bf16_model(cp, weights):
    from dataclasses import replace

    from tf_async.models.checkpoint import ModelWeights

    mats = ("q", "k", "v", "o", "gate", "up", "down")
    layers = [replace(layer, **{m: to_bf16(cp, getattr(layer, m)) for m in mats}) for layer in weights.layers]
    return ModelWeights(embed=to_bf16(cp, weights.embed), lm_head=to_bf16(cp, weights.lm_head),
                        final_norm=weights.final_norm, layers=layers)


def linear_bytes(w) -> int:
    parts = (w.codes, w.scales, w.biases) if hasattr(w, "codes") else (w.w,)
    return sum(int(p.nbytes) for p in parts)


def round_bytes(weights, cfg, kv_itemsize: int, contexts: list[int]) -> int:
    """Bytes a decode round must read: every weight once, one embedding row per stream, and
    each stream's K and V of every layer."""
    total = linear_bytes(weights.lm_head) + 4 * cfg.hidden_size
    total += len(contexts) * linear_bytes(weights.embed) // cfg.vocab_size
    for layer in weights.layers:
        total += sum(linear_bytes(getattr(layer, m)) for m in ("q", "k", "v", "o", "gate", "up", "down"))
        total += 4 * (2 * cfg.hidden_size + 2 * cfg.head_dim)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    return total + per_token * sum(contexts)


def make_batch(ops, streams, pages_per_lane: int, all_logits: bool):
    """ForwardBatch of (lane, start_pos, token ids); lane i owns pages [i*P, (i+1)*P).
    Packed and uploaded in one copy (as the engine's runner does)."""
    from tf_async.models.batch_io import pack_batch

    lanes = [lane for lane, _, _ in streams]
    table = np.array([[lane * pages_per_lane + p for p in range(pages_per_lane)] for lane in lanes], np.int32)
    tokens, pos, seq, logit_rows = [], [], [], []
    for i, (_, start, ids) in enumerate(streams):
        base = len(tokens)
        tokens += ids
        pos += range(start, start + len(ids))
        seq += [i] * len(ids)
        logit_rows += range(base, base + len(ids)) if all_logits else [base + len(ids) - 1]
    return pack_batch(ops, token_ids=tokens, positions=pos, row_seq=seq, block_table=table,
                      logit_rows=logit_rows, page_size=PAGE_SIZE)


def forward(decoder, arena, ops, batch):
    """decoder.forward as the engine's runner calls it: the round's indices checked once on
    the packed host copy, the ops without their per-op device checks (each a host sync)."""
    from tf_async.models.batch_io import check_indices, packed_of

    packed = packed_of(batch)
    check_indices(packed.layout, packed.host, vocab=decoder.weights.embed.out_features,
                  num_slots=int(arena.kv.shape[2]), page_size=batch.page_size)
    with ops.unchecked():
        return decoder.forward(batch, arena.kv, arena.kv_scales)


def decode_round(decoder, arena, ops, tokens: list[int], pos: int, pages_per_lane: int) -> list[int]:  # noqa: E501
    batch = make_batch(ops, [(i, pos, [t]) for i, t in enumerate(tokens)], pages_per_lane, True)
    logits, _ = forward(decoder, arena, ops, batch)
    in_graph = getattr(decoder, "argmax_of", None)  # as the runner: the graph's own argmax
    greedy = in_graph(logits) if in_graph is not None else None
    return ops.to_host(ops.argmax(logits) if greedy is None else greedy).tolist()


def bench_parallel(name, cfg, decoder, graph, ops, args, parallel: int, bandwidth: float) -> Row:  # noqa: E501
    from tf_async.engine.runner import Arena

    cp = ops.xp
    ctx = args.prompt + 2 * args.decode + args.profile_host + STEP_ROUNDS * sum(args.decode_steps) + 8
    pages_per_lane = -(-ctx // PAGE_SIZE)
    arena = Arena(ops, decoder, num_pages=parallel * pages_per_lane, page_size=PAGE_SIZE, kv_dtype=args.kv)
    rng = np.random.default_rng(parallel)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt).tolist() for _ in range(parallel)]
    batch = make_batch(ops, [(i, 0, p) for i, p in enumerate(prompts)], pages_per_lane, False)
    forward(decoder, arena, ops, batch)  # warm-up (compiles the many-rows kernels)
    ops.synchronize()
    prefills = []
    for _ in range(3):  # the same prompt rows again (same KV written): median of three
        t0 = time.perf_counter()
        logits, _ = forward(decoder, arena, ops, batch)
        tokens = ops.to_host(ops.argmax(logits)).tolist()
        prefills.append(time.perf_counter() - t0)
    prefill_s = float(np.median(prefills))
    pos = args.prompt
    eager = []
    for _ in range(args.decode):  # eager rounds: one Python launch per kernel
        t0 = time.perf_counter()
        tokens = decode_round(decoder, arena, ops, tokens, pos, pages_per_lane)
        eager.append(time.perf_counter() - t0)
        pos += 1
    graphed = []
    for _ in range(args.decode):  # first round captures, the rest replay
        t0 = time.perf_counter()
        tokens = decode_round(graph, arena, ops, tokens, pos, pages_per_lane)
        graphed.append(time.perf_counter() - t0)
        pos += 1
    gpu_s = replay_seconds(cp, graph)
    if args.profile_host:
        one_round = partial(decode_round, graph, arena, ops, pages_per_lane=pages_per_lane)
        tokens, pos = profile_host(args.profile_host, one_round, tokens, pos)
    for steps in args.decode_steps:
        tokens, pos, ms = runner_rounds(graph, arena, tokens, pos, pages_per_lane, steps)
        print(f"  {name} P={parallel}: engine runner, {steps} decode step(s) a round: "
              f"{ms:.3f} ms a token (median of {STEP_ROUNDS} rounds)", flush=True)
    contexts = [pos - args.decode // 2] * parallel
    kv_itemsize = int(arena.kv.dtype.itemsize)
    nbytes = round_bytes(decoder.weights, cfg, kv_itemsize, contexts)
    del arena
    return Row(name, parallel, parallel * args.prompt / prefill_s, 1e3 * float(np.median(eager[2:])),
               1e3 * float(np.median(graphed[2:])), 1e3 * gpu_s, nbytes / 1e9, 1e3 * nbytes / bandwidth)


def profile_host(count: int, round_fn: Callable[[list[int], int], list[int]], tokens: list[int],
                 pos: int) -> tuple[list[int], int]:
    """`count` graph rounds under cProfile: the functions that hold the host's share of a round."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(count):
        tokens = round_fn(tokens, pos)
        pos += 1
    profile.disable()
    print(f"host profile of {count} graph rounds (tottime: own time; us a round = tottime / {count}):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return tokens, pos


STEP_ROUNDS = 6


def runner_rounds(graph, arena, tokens: list[int], pos: int, pages_per_lane: int,
                  steps: int) -> tuple[list[int], int, float]:
    """Greedy decode rounds through the engine's Runner (RoundPlan.steps = `steps`: the tokens
    fed on the device between steps): one warm-up round, then STEP_ROUNDS timed; -> (last
    tokens, next position, median ms a token)."""
    from tf_async.engine.runner import Runner
    from tf_async.engine.sequence import RoundPlan, SeqRows, TokenChoice

    runner = Runner(graph, arena)
    lanes = range(len(tokens))
    tables = {lane: tuple(range(lane * pages_per_lane, (lane + 1) * pages_per_lane)) for lane in lanes}
    times = []
    for _ in range(STEP_ROUNDS + 1):
        rows = tuple(SeqRows(lane, lane, pos, (tokens[lane],), 1, (), (TokenChoice(0.0, 0, 1.0, 0, pos + 1),))
                     for lane in lanes)
        t0 = time.perf_counter()
        result = runner.execute(RoundPlan(rows, tables, (), steps=steps))
        times.append(time.perf_counter() - t0)
        if result.failed:
            raise RuntimeError(f"runner round failed: {result.failed}")
        tokens = [result.tokens[lane][-1] if lane in result.tokens else int(np.argmax(result.logits[lane][-1]))
                  for lane in lanes]  # (the CPU chooses one-step tokens on the host)
        pos += steps
    return tokens, pos, 1e3 * float(np.median(times[1:])) / steps


def replay_seconds(cp, graph, count: int = 20) -> float:
    """GPU time of one replay of the latest captured graph (replays back to back, events)."""
    cap = list(graph._graphs.values())[-1]
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    with cap.stream:
        cap.graph.launch(cap.stream)
        start.record(cap.stream)
        for _ in range(count):
            cap.graph.launch(cap.stream)
        stop.record(cap.stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / count


def bench_model(name, cfg, weights, ops, args, bandwidth: float) -> list[Row]:
    from tf_async.models.checkpoint import Checkpoint
    from tf_async.models.decoder import Decoder
    from tf_async.models.graph_decoder import GraphDecoder

    decoder = Decoder(Checkpoint(cfg, weights, None, name), ops)  # type: ignore[arg-type]
    rows = []
    for parallel in args.parallel:
        graph = GraphDecoder(decoder, programmatic=not args.plain_graphs)
        rows.append(bench_parallel(name, cfg, decoder, graph, ops, args, parallel, bandwidth))
        r = rows[-1]
        print(f"  {name} P={parallel}: eager {r.eager_ms:.2f} ms, graph {r.graph_ms:.2f} ms, "
              f"gpu {r.gpu_ms:.2f} ms a round, {r.decode_tps:.1f} tok/s", flush=True)
    return rows


def torch_decode_tps(cp, cfg, weights, args) -> tuple[float, str]:
    """transformers Qwen3 (bf16, the same bf16 weights) batch-1 greedy decode tokens/s."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_cfg = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
                         max_position_embeddings=cfg.max_position_embeddings)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    cp.cuda.Device().synchronize()
    load_torch_weights(torch, model, weights)
    model.generation_config.eos_token_id = None
    model.generation_config.disable_compile = True  # eager PyTorch: no minutes of torch.compile
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device="cuda")
    for cache in ("static", "dynamic"):
        try:
            run = partial(timed_generate, torch, model, ids, cache=cache)
            run(4)
            steps = args.decode
            return steps / (run(steps + 1) - run(1)), cache
        except Exception as exc:  # noqa: BLE001 - report and try the dynamic cache
            print(f"  transformers with {cache} cache failed: {type(exc).__name__}: {exc}")
    return float("nan"), "failed"


def timed_generate(torch, model, ids, new_tokens: int, cache: str) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       cache_implementation=cache if cache == "static" else None, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def load_torch_weights(torch, model, weights) -> None:
    def t(array):
        if isinstance(array, np.ndarray):
            return torch.from_numpy(array).to("cuda", torch.bfloat16)
        return torch.from_dlpack(array).view(torch.bfloat16)

    sd = model.state_dict()
    sd["model.embed_tokens.weight"].copy_(t(weights.embed.w))
    sd["lm_head.weight"].copy_(t(weights.lm_head.w))
    sd["model.norm.weight"].copy_(t(weights.final_norm))
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        for name, w in (("self_attn.q_proj", layer.q), ("self_attn.k_proj", layer.k),
                        ("self_attn.v_proj", layer.v), ("self_attn.o_proj", layer.o),
                        ("mlp.gate_proj", layer.gate), ("mlp.up_proj", layer.up), ("mlp.down_proj", layer.down)):
            sd[p + name + ".weight"].copy_(t(w.w))
        for name, v in (("input_layernorm", layer.input_norm), ("post_attention_layernorm", layer.post_norm),
                        ("self_attn.q_norm", layer.q_norm), ("self_attn.k_norm", layer.k_norm)):
            sd[p + name + ".weight"].copy_(t(v))
    torch.cuda.synchronize()


def print_table(rows: list[Row], bandwidth: float, torch_tps: float, torch_cache: str) -> None:
    print(f"\ncopy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    head = (f"{'model':<6} {'P':>3} {'prefill tok/s':>13} {'eager ms':>9} {'graph ms':>9} {'gpu ms':>8} "
            f"{'launch %':>8} {'decode tok/s':>12} {'GB/round':>9} {'roof ms':>8} {'% roof':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        launch = 100 * (r.eager_ms - r.gpu_ms) / r.eager_ms
        print(f"{r.model:<6} {r.parallel:>3} {r.prefill_tps:>13.0f} {r.eager_ms:>9.2f} {r.graph_ms:>9.2f} "
              f"{r.gpu_ms:>8.2f} {launch:>8.0f} {r.decode_tps:>12.1f} {r.gb_per_round:>9.2f} "
              f"{r.roofline_ms:>8.2f} {100 * r.roofline_ms / r.graph_ms:>7.1f}")
    print(f"transformers bf16 batch-1 decode ({torch_cache} cache): {torch_tps:.1f} tok/s")
    q4 = [r for r in rows if r.model == "q4" and r.parallel == 1]
    if q4:
        r = q4[0]
        print(f"bar: q4 batch-1 at {100 * r.roofline_ms / r.graph_ms:.1f}% of roofline (>= 50%), "
              f"{r.decode_tps / torch_tps:.2f}x transformers (>= 3x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--parallel", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=24)
    parser.add_argument("--kv", default="bf16", choices=["f32", "bf16", "fp8"])
    parser.add_argument("--models", default="q4,bf16")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--plain-graphs", action="store_true",
                        help="no programmatic edges between the graph's kernels (cuda_kernels/graphs.py)")
    parser.add_argument("--profile-host", type=int, default=0, metavar="N",
                        help="also run N graph rounds under cProfile and print where the host time goes")
    parser.add_argument("--decode-steps", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="also time rounds of 1,4,... decode steps through the engine's Runner")
    args = parser.parse_args()
    from tf_async.backend.cuda_ops import CudaOps

    ops = CudaOps()
    cp = ops.xp
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    bandwidth = copy_bandwidth(cp)
    cfg, q4 = random_model(cp, args.layers)
    models = {"q4": q4, "bf16": bf16_model(cp, q4) if "bf16" in args.models or not args.no_torch else None}
    rows: list[Row] = []
    for name in args.models.split(","):
        rows += bench_model(name, cfg, models[name], ops, args, bandwidth)
    torch_tps, cache = (float("nan"), "skipped")
    if not args.no_torch:
        torch_tps, cache = torch_decode_tps(cp, cfg, models["bf16"], args)
    print_table(rows, bandwidth, torch_tps, cache)


if __name__ == "__main__":
    main()
