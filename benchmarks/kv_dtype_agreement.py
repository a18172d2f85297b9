"""fp8 / bf16 / f32 KV on the default model: greedy agreement and log-prob drift (prints a table).

Greedy agreement: fraction of generated tokens equal to the f32-KV greedy stream, up to the first
difference (per prompt), averaged. Log-probs: the bf16-KV greedy continuation is teacher-forced
through each KV dtype; we report the mean and max |logprob(fp8) - logprob(bf16)| of the chosen tokens.
Usage: python benchmarks/kv_dtype_agreement.py [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from tf_async import Engine
from tf_async.gate import PROMPTS
from tf_async.models.checkpoint import Checkpoint


async def greedy(ckpt: Checkpoint, kv_dtype: str, tokens: int) -> list[tuple[list[int], list[int]]]:
    async with Engine(ckpt, device="cpu", parallel=4, ctx=512, kv_dtype=kv_dtype) as eng:
        outs = await asyncio.gather(*(eng.complete(p, max_tokens=tokens, ignore_eos=True, logprobs=0)
                                      for p in PROMPTS))
        prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    return [(p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]


async def forced_logprobs(ckpt: Checkpoint, kv_dtype: str, seqs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """Log-prob of each forced continuation token under `kv_dtype` (prompt + continuation prefix)."""
    out = []
    async with Engine(ckpt, device="cpu", parallel=4, ctx=512, kv_dtype=kv_dtype) as eng:
        for prompt, cont in seqs:
            lps = []
            for i, tok in enumerate(cont):
                done = await eng.complete(prompt + cont[:i], max_tokens=1, logprobs=20,
                                          stop_token_ids=[], ignore_eos=True)
                lp = done.logprobs[0]
                lps.append(lp.get(tok, np.nan) if tok in lp else np.nan)
            out.append(np.asarray(lps))
    return out


def prefix_agreement(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(1, len(a))


async def main(tokens: int) -> None:
    from tf_async.engine.build import load_model

    ckpt = await asyncio.to_thread(load_model, None)
    runs = {d: await greedy(ckpt, d, tokens) for d in ("f32", "bf16", "fp8")}
    print(f"{'kv dtype':<8} {'greedy prefix agreement vs f32':>32} {'exact streams':>14}")
    for d, seqs in runs.items():
        agree = [prefix_agreement(s[1], f[1]) for s, f in zip(seqs, runs["f32"], strict=True)]
        exact = sum(s[1] == f[1] for s, f in zip(seqs, runs["f32"], strict=True))
        print(f"{d:<8} {np.mean(agree):>32.3f} {exact:>11}/{len(seqs)}")
    print()
    print("teacher-forced chosen-token log-prob drift vs bf16 KV (first 16 tokens of each bf16 stream)")
    short = [(p, c[:16]) for p, c in runs["bf16"]]
    ref = np.concatenate(await forced_logprobs(ckpt, "bf16", short))
    for d in ("f32", "fp8"):
        got = np.concatenate(await forced_logprobs(ckpt, d, short))
        diff = np.abs(got - ref)
        print(f"{d:<8} mean |dlogprob| {np.nanmean(diff):.4f}   max {np.nanmax(diff):.4f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    asyncio.run(main(ap.parse_args().tokens))
