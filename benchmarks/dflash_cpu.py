"""DFlash / DFlash2 on the CPU (issue 21): tokens a round and the round's cost against plain,
on a small random target with a random drafter, block 16 (15 drafts a round).

Random weights accept (almost) nothing, so, as benchmarks/bench_qwen35_gpu.py does for MTP,
the drafter's proposals are also replaced after its real block forward has run by what the
target will emit (forced-full: every draft accepted) and by wrong tokens (forced-zero): a real
checkpoint's speed lies between the two.

    python benchmarks/dflash_cpu.py [--repeats 3] [--max-tokens 96] [--hidden 256] [--draft-backoff 32]

One stream, greedy, token-id prompts (64 tokens), ignore_eos. Each cell: the median over
repeats; ms/round = decode seconds / rounds after the first token; tok/round = tokens / rounds.
Prints a table (copy it into docs/PERFORMANCE.md, "DFlash (issue 21)").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers: tiny checkpoints

from tests.tiny import random_hf_weights, tiny_config  # noqa: E402
from tests.tiny_dflash import dflash_config, dflash_weights, write_dflash  # noqa: E402
from tests.tiny_hf import write_hf  # noqa: E402
from tf_async import Engine  # noqa: E402
from tf_async.models.loader import load_checkpoint  # noqa: E402


class ForcedDrafts:
    """The DFlash drafter runs its block forward as usual; its drafts are then replaced by the
    target's own next tokens (full) or by wrong ones (zero acceptance)."""

    def __init__(self, inner: Any, truth: list[int], full: bool, vocab: int):
        self.inner, self.truth, self.full, self.vocab = inner, truth, full, vocab

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, seq: Any, limit: int) -> tuple[int, ...]:
        real = self.inner.propose(seq, limit)
        if not real:
            return ()
        done = len(seq.output_ids)
        right = self.truth[done:done + len(real)]
        return tuple(right if self.full else [(t + 1) % self.vocab for t in right])


def write_models(root: Path, hidden: int) -> tuple[Any, dict[int, Path]]:
    heads = hidden // 32
    cfg = tiny_config("llama", hidden_size=hidden, num_hidden_layers=4, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, intermediate_size=3 * hidden,
                      max_position_embeddings=1024)
    target = load_checkpoint(write_hf(root / "target", cfg, random_hf_weights(cfg, seed=1)))
    drafters = {}
    for generation in (1, 2):
        dcfg = dflash_config(generation, hidden_size=hidden, num_attention_heads=heads,
                             num_key_value_heads=heads // 2, head_dim=32,
                             intermediate_size=3 * hidden, num_target_layers=4)
        dcfg["dflash_config"].update(block_size=16, target_layer_ids=[1, 3])
        if generation == 2:
            dcfg["dflash_config"].update(selector_rank=32, selector_top_k=16)
            dcfg["sliding_window"] = 2048
        drafters[generation] = write_dflash(root / f"d{generation}", dcfg,
                                            dflash_weights(dcfg, seed=generation))
    return target, drafters


async def one_run(target: Any, drafter: str | None, mode: str, prompt: list[int],
                  max_tokens: int, truth: list[int] | None, backoff: int
                  ) -> tuple[float, float, list[int]]:
    """(ms a round, tokens a round, output) of one stream after its first token."""
    async with Engine(target, device="cpu", parallel=1, ctx=512, step_tokens=256,
                      drafter=drafter, draft_tokens=15, draft_backoff=backoff) as eng:
        await eng.complete(prompt[:8], max_tokens=4, ignore_eos=True)  # JIT warm-up
        if mode.startswith("forced"):
            assert truth is not None
            sched = eng.parts.scheduler
            sched.drafter = ForcedDrafts(sched.drafter, truth, mode == "forced-full",
                                         target.config.vocab_size)
        out: list[int] = []
        first_t, rounds0, last_t = 0.0, 0, 0.0
        async for delta in eng.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
            if not out:
                first_t, rounds0 = time.perf_counter(), int(eng.stats()["rounds"])
            out.extend(delta.token_ids)
            last_t = time.perf_counter()
        rounds = max(1, int(eng.stats()["rounds"]) - rounds0)
    return 1e3 * (last_t - first_t) / rounds, (len(out) - 1) / rounds, out


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target, drafters = write_models(Path(tmp), args.hidden)
        prompt = np.random.default_rng(0).integers(3, target.config.vocab_size - 1, 64).tolist()
        cases: list[tuple[str, str | None, str]] = [("plain", None, "plain")]
        for generation, path in drafters.items():
            name = "DFlash" if generation == 1 else "DFlash2"
            cases += [(f"{name} {mode}", f"dflash:{path}", mode)
                      for mode in ("random", "forced-full", "forced-zero")]
        truth: list[int] | None = None
        rows = []
        for label, drafter, mode in cases:
            runs = [await one_run(target, drafter, mode, prompt, args.max_tokens, truth,
                                  args.draft_backoff) for _ in range(args.repeats)]
            truth = runs[0][2] if mode == "plain" else truth
            same = all(r[2] == truth for r in runs)
            rows.append((label, statistics.median(r[0] for r in runs),
                         statistics.median(r[1] for r in runs), same))
    base = rows[0][1] / rows[0][2]
    print(f"\nhidden {args.hidden}, 4 target layers, 2 drafter layers, block 16, "
          f"{args.max_tokens} tokens, median of {args.repeats}, --draft-backoff {args.draft_backoff}")
    print("| case | ms/round | tok/round | ms/token | vs plain tok/s | output == plain |")
    print("|---|---|---|---|---|---|")
    for label, ms, per_round, same in rows:
        per_token = ms / per_round
        print(f"| {label} | {ms:.2f} | {per_round:.2f} | {per_token:.2f} | "
              f"{base / per_token:.2f}x | {same} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--draft-backoff", type=int, default=32,
                        help="the engine's draft pacing (0: every round drafts)")
    asyncio.run(main(parser.parse_args()))
