"""Qwen3.5 hybrids on the GPU (issue 7 item 6): random weights of the real 27B and 35B-A3B
shapes drawn on the device, MLX 4-bit (group 64; router and shared-expert gates 8-bit).

1. Per-lane memory (computed, no GPU needed): --parallel 8 at --ctx 16384 and 32768 with bf16
   and fp8 KV: KV in the run, the MTP drafter area (fixed a lane -> 0 MiB: borrowed from the
   run), each lane's recurrent state (conv + delta rule) and its rollback copy.
2. Decode through the real engine (Engine API, token-id prompts, ignore_eos): tokens/s at 1
   and 8 streams, plain and with `--drafter mtp`, and the round's cost when the MTP's drafts
   are replaced by what the target will emit (forced full acceptance) and by wrong tokens
   (zero acceptance); the MTP layer still runs its k steps a round in both. Random weights
   accept nothing on their own, so a real checkpoint's speed-up lies between the two.
3. The same with a DFlash2 drafter (issue 21; modes dflash, dflash-full, dflash-zero): a random
   MLX 4-bit drafter of the public DFlash2 shapes (docs/DFLASH.md: 5 sliding layers, window
   2048, 8 KV heads of 128, block 16, selector rank 256) at the target's hidden size, written
   to a temporary folder (`--dflash-dir` keeps it), 15 drafts a round.

    python benchmarks/bench_qwen35_gpu.py --memory-only          # CPU: the memory table
    python benchmarks/bench_qwen35_gpu.py [--models 27b,35b-a3b] [--streams 1,8]

Needs CuPy and numba-cuda (the GDN kernels of cuda_kernels/gdn.py JIT-compile on first use).
Prints tables; records nothing (copy them into docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers: drafter writer

from tf_async.engine.area import lane_memory_lines, mib
from tf_async.engine.options import EngineOptions
from tf_async.models.hf_qwen35 import hybrid_config_from_hf
from tf_async.models.qwen35 import HybridConfig, StateLayout

GROUP_SIZE = 64
_COMMON = dict(model_type="qwen3_5", vocab_size=248320, rms_norm_eps=1e-6, head_dim=256,
               full_attention_interval=4, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, mtp_num_hidden_layers=1,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25},
               max_position_embeddings=262144, tie_word_embeddings=False, eos_token_id=248044)
SHAPES = {  # text_config of the released checkpoints (27B GDN value heads: verify, 48)
    "27b": {**_COMMON, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
            "num_key_value_heads": 4, "intermediate_size": 17408, "linear_num_value_heads": 48},
    "35b-a3b": {**_COMMON, "model_type": "qwen3_5_moe", "hidden_size": 2048,
                "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
}
REAL = ("27b", "35b-a3b")
_TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, eos_token_id=2)
SHAPES["tiny"] = {**SHAPES["27b"], **_TINY, "intermediate_size": 256}  # --device cpu check
SHAPES["tiny-moe"] = {**SHAPES["35b-a3b"], **_TINY, "num_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}


def hybrid_config(name: str) -> HybridConfig:
    return hybrid_config_from_hf(SHAPES[name], source=f"{name} shape")


def write_dflash_drafter(folder: Path, name: str, bits: int = 4) -> Path:
    """A random DFlash2 drafter for target `name` (public DFlash2 shapes at its hidden size,
    5 target layers spread over its depth), MLX `bits`-bit (0: bf16)."""
    from tests.tiny_dflash import dflash_config, dflash_weights, mlx_quantize_dflash, write_dflash

    t = SHAPES[name]
    hidden, layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    small = hidden < 1024  # the --device cpu check's tiny shapes
    heads, kv_heads, head_dim = (4, 2, 32) if small else (32, 8, 128)
    cfg = dflash_config(2, hidden_size=hidden, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim,
                        intermediate_size=t.get("intermediate_size", 3 * hidden),
                        num_hidden_layers=2 if small else 5, vocab_size=vocab,
                        num_target_layers=layers, sliding_window=2048,
                        layer_types=["sliding_attention"] * (2 if small else 5))
    cfg["dflash_config"].update(
        block_size=16, mask_token_id=vocab - 1, conv_group_size=16,
        target_layer_ids=sorted({round(i * (layers - 2) / 4) + 1 for i in range(5)}),
        selector_rank=32 if small else 256, selector_top_k=16, output_multiplier=0.196)
    weights = dflash_weights(cfg, seed=11)
    if bits:
        cfg["quantization"] = {"group_size": GROUP_SIZE, "bits": bits}
        weights = mlx_quantize_dflash(weights, bits, GROUP_SIZE)
    return write_dflash(folder, cfg, weights)


def state_layout(hybrid: HybridConfig, num_lanes: int) -> StateLayout:
    kernel = hybrid.linear_conv_kernel_dim
    return StateLayout(len(hybrid.gdn_layers), num_lanes, (kernel - 1, hybrid.conv_channels),
                       (hybrid.linear_num_value_heads, hybrid.linear_key_head_dim,
                        hybrid.linear_value_head_dim))


# ---- 1. memory ----------------------------------------------------------------------------
def memory_report(parallel: int, contexts: list[int]) -> None:
    for name in REAL:
        hybrid = hybrid_config(name)
        layout = state_layout(hybrid, parallel)
        stash = layout.stash_bytes_per_row * (EngineOptions().draft_tokens + 1)  # k + 1 rows
        for ctx, kv_dtype in itertools.product(contexts, ("bf16", "fp8")):
            print("\n".join(lane_memory_lines(
                f"Qwen3.5-{name.upper()} shape ({len(hybrid.attention_layers)} KV layers, "
                f"{len(hybrid.gdn_layers)} GDN layers)", hybrid.kv_config, hybrid.kv_config,
                parallel=parallel, ctx=ctx, kv_dtype=kv_dtype, drafter_layers=1,
                drafter_name="mtp", recurrent_bytes=layout.bytes_per_lane, stash_bytes=stash)))
            print()


# ---- 2. random MLX 4-bit weights on the device ----------------------------------------------
def affine(xp, out_f: int, in_f: int, bits: int = 4, experts: int = 0):
    """Random affine weight drawn with xp (CuPy: on the device), entries ~ zero mean with
    std ~ 1/sqrt(in_f); stacked [experts, out_f, ...] when `experts`."""
    from tf_async.backend.weights import AffineWeight

    lead = (experts,) if experts else ()
    words, groups = in_f * bits // 32, in_f // GROUP_SIZE
    codes = (xp.random.random((*lead, out_f, words)) * 2.0**32).astype(xp.uint32)
    levels = (1 << bits) - 1
    scales = ((xp.random.random((*lead, out_f, groups)) + 0.5)
              * (math.sqrt(12.0) / (levels * math.sqrt(in_f)))).astype(xp.float32)
    return AffineWeight(codes, scales, (-0.5 * levels * scales).astype(xp.float32), bits,
                        GROUP_SIZE)


class Draw:
    """Weights of one hybrid shape: matrices on the device, vectors on the host."""

    def __init__(self, cp, hybrid: HybridConfig):
        self.cp, self.hybrid, self.cfg = cp, hybrid, hybrid.kv_config
        self.rng = np.random.default_rng(0)

    def norm(self, dim: int) -> np.ndarray:  # N1 form (1 + w folded)
        return (1.0 + 0.05 * self.rng.standard_normal(dim)).astype(np.float32)

    def attention(self):
        from tf_async.models.qwen35 import GatedAttentionWeights

        cp, c = self.cp, self.cfg
        q_out, kv_out, H = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        return GatedAttentionWeights(affine(cp, 2 * q_out, H), affine(cp, kv_out, H),
                                     affine(cp, kv_out, H), affine(cp, H, q_out),
                                     self.norm(c.head_dim), self.norm(c.head_dim))

    def deltanet(self):
        from tf_async.models.qwen35 import DeltaNetWeights

        cp, hyb, H = self.cp, self.hybrid, self.cfg.hidden_size
        hv, vdim = hyb.linear_num_value_heads, hyb.linear_num_value_heads * hyb.linear_value_head_dim
        conv = (self.rng.standard_normal((hyb.conv_channels, hyb.linear_conv_kernel_dim)) * 0.3)
        return DeltaNetWeights(
            affine(cp, hyb.conv_channels, H), affine(cp, vdim, H), affine(cp, hv, H),
            affine(cp, hv, H), conv.astype(np.float32),
            np.log(self.rng.uniform(1, 16, hv)).astype(np.float32),
            np.zeros(hv, np.float32), self.norm(hyb.linear_value_head_dim), affine(cp, H, vdim))

    def ffn(self):
        from tf_async.models.qwen35 import DenseFfnWeights, MoeFfnWeights

        cp, c, H = self.cp, self.cfg, self.cfg.hidden_size
        if not self.hybrid.is_moe:
            inter = c.intermediate_size
            return DenseFfnWeights(affine(cp, inter, H), affine(cp, inter, H), affine(cp, H, inter))
        experts, im, shared = c.num_experts, c.moe_intermediate_size, \
            self.hybrid.shared_expert_intermediate_size
        return MoeFfnWeights(
            affine(cp, experts, H, bits=8), affine(cp, im, H, experts=experts),
            affine(cp, im, H, experts=experts), affine(cp, H, im, experts=experts),
            affine(cp, shared, H), affine(cp, shared, H), affine(cp, H, shared),
            affine(cp, 1, H, bits=8))

    def layer(self, kind: str):
        from tf_async.models.qwen35 import FULL_ATTENTION, HybridLayerWeights

        mixer = self.attention() if kind == FULL_ATTENTION else self.deltanet()
        H = self.cfg.hidden_size
        return HybridLayerWeights(kind, self.norm(H), self.norm(H), mixer, self.ffn())


def random_checkpoint(xp, name: str):
    """A Checkpoint of the shape, MLX 4-bit, with an MTP layer, drawn on the device."""
    from tf_async.models.checkpoint import Checkpoint
    from tf_async.models.qwen35 import FULL_ATTENTION, HybridWeights, MtpWeights

    hybrid = hybrid_config(name)
    cp = xp
    draw, H, V = Draw(cp, hybrid), hybrid.kv_config.hidden_size, hybrid.kv_config.vocab_size
    layers = [draw.layer(kind) for kind in hybrid.layer_types]
    mtp = MtpWeights(affine(cp, H, 2 * H), draw.norm(H), draw.norm(H), draw.norm(H),
                     draw.layer(FULL_ATTENTION))
    weights = HybridWeights(hybrid, affine(cp, V, H), affine(cp, V, H), draw.norm(H), layers,
                            mtp, mtp_status="present")
    return Checkpoint(hybrid.kv_config, weights, ByteTokenizer(V, hybrid.kv_config.eos_token_ids),
                      f"random-qwen3.5-{name}-mlx4", {"mtp": "present"})


class ByteTokenizer:
    """Enough tokenizer for fp8 calibration and eos ids (prompts are token ids)."""

    add_bos = False

    def __init__(self, vocab_size: int, eos: tuple[int, ...]):
        self.vocab_size, self.eos_token_ids = vocab_size, eos

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def stream(self, **_: Any) -> ByteTokenizer:  # the streams' detokenizer: no text
        return self

    def push(self, ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def weight_bytes(tree: Any) -> int:
    """Bytes of every array in a weights tree (device or host)."""
    if hasattr(tree, "codes"):
        return sum(int(a.nbytes) for a in (tree.codes, tree.scales, tree.biases))
    if hasattr(tree, "nbytes"):
        return int(tree.nbytes)
    if isinstance(tree, list):
        return sum(weight_bytes(x) for x in tree)
    if hasattr(tree, "__dataclass_fields__"):
        return sum(weight_bytes(getattr(tree, f)) for f in tree.__dataclass_fields__)
    return 0


# ---- 3. decode ------------------------------------------------------------------------------
class ForcedDrafts:
    """The engine's MTP drafter runs as usual (its k steps cost the same); its drafts are then
    replaced by the target's own next tokens (`full`) or by wrong ones (zero acceptance)."""

    def __init__(self, inner, truth: dict[tuple[int, ...], list[int]], full: bool, vocab: int):
        self.inner, self.truth, self.full, self.vocab = inner, truth, full, vocab

    def __getattr__(self, name: str):  # the rest of the Drafter interface
        return getattr(self.inner, name)

    def propose(self, seq, limit: int) -> tuple[int, ...]:
        drafts = self.inner.propose(seq, limit)  # the MTP's k steps run (its ring in sync)
        count = min(limit, self.inner.draft_tokens)
        if count <= 0:
            return ()
        done = len(seq.output_ids)
        right = self.truth.get(tuple(seq.prompt_ids), [])[done:done + count]
        if not right:  # no plain run of this prompt: the MTP's own drafts
            return drafts
        return tuple(right if self.full else [(t + 1) % self.vocab for t in right])


@dataclass
class Run:
    model: str
    streams: int
    mode: str
    tokens_per_s: float
    round_ms: float
    tokens_per_round: float  # per stream
    outputs: list[list[int]]
    memory: dict[str, Any]
    truth: dict[tuple[int, ...], list[int]]  # every prompt's output, warm-up's included
    graphs: dict[str, int]  # graph replays and captures in the timed window


async def timed_generate(eng, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int, list]:  # noqa: E501
    """(decode seconds, tokens in the window, rounds in the window, outputs): the window starts
    when every stream has its first token (prefill done)."""
    stamps: list[list[float]] = [[] for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        async for delta in eng.stream(prompts[i], max_tokens=max_tokens, ignore_eos=True):
            outs[i].extend(delta.token_ids)
            stamps[i].extend([time.perf_counter()] * len(delta.token_ids))

    start_rounds: list[int] = []

    async def mark() -> None:  # rounds counter when the last stream got its first token
        while any(not s for s in stamps):
            await asyncio.sleep(0.0005)
        start_rounds.append(int(eng.stats()["rounds"]))

    await asyncio.gather(*(one(i) for i in range(len(prompts))), mark())
    t0 = max(s[0] for s in stamps)
    t1 = max(s[-1] for s in stamps)
    window = sum(sum(t > t0 for t in s) for s in stamps)
    return t1 - t0, window, int(eng.stats()["rounds"]) - start_rounds[0], outs


async def decode_run(ckpt, name: str, streams: int, mode: str, args,
                     truth: dict[tuple[int, ...], list[int]]) -> Run:
    """One engine, `streams` random prompts at once; mode plain | mtp | forced-full |
    forced-zero (forced modes need `truth`: the plain outputs of the warm-up's and the timed
    run's prompts)."""
    from tf_async import Engine

    rng = np.random.default_rng(streams)
    prompts = [rng.integers(0, ckpt.config.vocab_size, args.prompt_tokens).tolist()
               for _ in range(streams)]
    dflash = mode.startswith("dflash")
    drafter = None if mode == "plain" else f"dflash:{args.dflash_path}" if dflash else "mtp"
    async with Engine(ckpt, device=args.device, parallel=streams, ctx=args.ctx, kv_dtype=args.kv,
                      step_tokens=max(512, streams * args.prompt_tokens), page_size=16,
                      drafter=drafter, draft_tokens=15 if dflash else args.draft_tokens,
                      decode_steps=args.decode_steps if mode == "plain" else 1,
                      draft_backoff=args.draft_backoff) as eng:
        if mode.endswith(("-full", "-zero")):
            sched = eng.parts.scheduler
            sched.drafter = ForcedDrafts(sched.drafter, truth, mode.endswith("-full"),
                                         ckpt.config.vocab_size)
        # JIT, warm-up and every CUDA graph of the timed run's round shapes: the same run on
        # other prompts (not cached), every stream at once, as long as the timed one.
        warm = [[(t + 1) % ckpt.config.vocab_size for t in p] for p in prompts]
        *_, warm_outs = await timed_generate(eng, warm, args.max_tokens)
        graphs_before = graph_counts(eng)
        seconds, tokens, rounds, outs = await timed_generate(eng, prompts, args.max_tokens)
        graphs = {k: v - graphs_before.get(k, 0) for k, v in graph_counts(eng).items()}
        memory = {k: v for k, v in eng.stats().items() if "bytes" in k}
    per_round = tokens / max(rounds, 1) / streams
    return Run(name, streams, mode, tokens / seconds, 1e3 * seconds / max(rounds, 1), per_round,
               outs, memory, {**dict(zip(map(tuple, prompts), outs, strict=True)),
                              **dict(zip(map(tuple, warm), warm_outs, strict=True))}, graphs)


def graph_counts(eng) -> dict[str, int]:
    """Replays and captures of the target's graphs and the MTP head's (timed window: the
    difference of two readings)."""
    decoder = eng.parts.runner.decoder
    counts = {"replays": getattr(decoder, "num_replays", 0),
              "verify_replays": getattr(decoder, "num_verify_replays", 0),
              "shapes": len(getattr(decoder, "_graphs", {}))}
    drafter = getattr(eng.parts.scheduler, "drafter", None)
    head_graphs = getattr(getattr(getattr(drafter, "inner", drafter), "head", None), "graphs", None)
    if head_graphs is not None:
        counts["mtp_replays"] = head_graphs.num_replays
        counts["mtp_captures"] = head_graphs.num_captures
    return counts


async def bench_model(cp, name: str, args) -> list[Run]:
    t = time.perf_counter()
    ckpt = random_checkpoint(cp, name)
    print(f"{name}: weights {weight_bytes(ckpt.weights) / 2**30:.1f} GiB drawn in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    runs: list[Run] = []
    if any(m.startswith("dflash") for m in args.modes):
        t = time.perf_counter()
        args.dflash_path = write_dflash_drafter(Path(args.dflash_dir) / name, name, args.dflash_bits)
        print(f"{name}: DFlash2 drafter written in {time.perf_counter() - t:.1f} s", flush=True)
    for streams in args.streams:
        truth: dict[tuple[int, ...], list[int]] = {}
        for mode in args.modes:
            try:
                run = await decode_run(ckpt, name, streams, mode, args, truth)
            except Exception:  # noqa: BLE001 - report and go on with the next case
                print(f"{name} x{streams} {mode}: FAILED\n{traceback.format_exc()}", flush=True)
                continue
            truth = run.truth if mode == "plain" else truth
            if mode != "plain" and truth:
                same = all(truth[k] == v for k, v in run.truth.items())
                print(f"  {name} x{streams} {mode}: drafted == plain: {same}", flush=True)
            print(f"  {name} x{streams} {mode}: {run.tokens_per_s:.1f} tok/s, "
                  f"{run.round_ms:.2f} ms/round, {run.tokens_per_round:.2f} tok/round/stream; "
                  f"graphs in the window {run.graphs}", flush=True)
            runs.append(run)
    return runs


def print_table(runs: list[Run], ctx: int) -> None:
    print(f"\n{'model':<9} {'streams':>7} {'mode':<12} {'tok/s':>9} {'ms/round':>9} "
          f"{'tok/round':>9} {'vs plain':>8}")
    plain = {(r.model, r.streams): r.tokens_per_s for r in runs if r.mode == "plain"}
    for r in runs:
        base = plain.get((r.model, r.streams), float("nan"))
        print(f"{r.model:<9} {r.streams:>7} {r.mode:<12} {r.tokens_per_s:>9.1f} "
              f"{r.round_ms:>9.2f} {r.tokens_per_round:>9.2f} {r.tokens_per_s / base:>7.2f}x")
    for r in runs:
        if r.mode == "mtp":
            mem = ", ".join(f"{k} {mib(v)}" for k, v in r.memory.items() if v)
            print(f"  measured ({r.model} x{r.streams}, ctx {ctx}): {mem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--parallel", type=int, default=8, help="lanes of the memory table")
    parser.add_argument("--contexts", default="16384,32768")
    parser.add_argument("--models", default="27b,35b-a3b")
    parser.add_argument("--modes", type=lambda s: s.split(","),
                        default=["plain", "mtp", "forced-full", "forced-zero"],
                        help="plain,mtp,forced-full,forced-zero,dflash,dflash-full,dflash-zero "
                        "(forced ones need plain first)")
    parser.add_argument("--dflash-dir", default=None, help="where the DFlash2 drafters go "
                        "(default: a temporary folder)")
    parser.add_argument("--dflash-bits", type=int, default=4, choices=[0, 4, 8])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="decode steps a round of the plain runs (the engine's --decode-steps)")
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--draft-backoff", type=int, default=32,
                        help="the engine's draft pacing (0: every round drafts, as before)")
    parser.add_argument("--ctx", type=int, default=4096, help="context of the decode runs")
    parser.add_argument("--kv", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a check of this script on the tiny shapes (--models tiny)")
    parser.add_argument("--eager-verify", action="store_true",
                        help="verify and MTP rounds eagerly (graph_decoder's CAPTURE_VERIFY_ROUNDS "
                        "off), as before session 13")
    parser.add_argument("--qmma-wide-rows", type=int, default=None, metavar="N",
                        help="launches of N-16 rows with wide outputs on the tensor cores "
                        "(cuda_kernels/qmma.py WIDE_ROWS_MIN; default off)")
    parser.add_argument("--qmma-few-rows", default=None, metavar="LO:HI",
                        help="q4 launches of LO..HI rows on the few-rows tensor-core kernel "
                        "(cuda_kernels/qmma_few.py MIN_ROWS, TAKE_MAX; default 5:16; 99:99 = off)")
    parser.add_argument("--qmma-few-variant", default=None, metavar="F:R:REGS:STAGES[:XRING]",
                        help="the few-rows kernel's variant (cuda_kernels/qmma_few.py VARIANT; "
                        "default plan(): 2:1:128:3:1)")
    parser.add_argument("--mtp-pending-rows", type=int, default=None,
                        help="MTP slots a stream keeps unwritten until its ring is read "
                        "(tf_async/engine/drafters/mtp.py PENDING_ROWS; 0: every round writes)")
    args = parser.parse_args()
    if args.mtp_pending_rows is not None:
        from tf_async.engine.drafters import mtp

        mtp.PENDING_ROWS = args.mtp_pending_rows
    if args.qmma_few_rows is not None:
        from cuda_kernels import qmma_few

        qmma_few.MIN_ROWS, qmma_few.TAKE_MAX = map(int, args.qmma_few_rows.split(":"))
    if args.qmma_few_variant is not None:
        from cuda_kernels import qmma_few

        qmma_few.VARIANT = qmma_few.FewVariant(*map(int, args.qmma_few_variant.split(":")))
    if args.qmma_wide_rows is not None:
        from cuda_kernels import qmma

        qmma.WIDE_ROWS_MIN = args.qmma_wide_rows
    if args.eager_verify:
        from tf_async.models import graph_decoder

        graph_decoder.CAPTURE_VERIFY_ROUNDS = False
    memory_report(args.parallel, [int(c) for c in args.contexts.split(",")])
    if args.memory_only:
        return
    xp = np
    if args.device == "cuda":
        import cupy as xp

        print(f"device: {xp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        args.dflash_dir = args.dflash_dir or tmp
        for name in args.models.split(","):
            runs += asyncio.run(bench_model(xp, name, args))
            if args.device == "cuda":
                xp.get_default_memory_pool().free_all_blocks()
    print_table(runs, args.ctx)


if __name__ == "__main__":
    main()
