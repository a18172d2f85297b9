"""Speculative decoding on the default model: decode tokens/s with and without each drafter.

    python benchmarks/bench_drafting.py [--repeats 5] [--max-tokens 96] [--draft-tokens 4]

One stream at a time, greedy, the chat template applied. Plain and drafted engines run side
by side in one process, interleaved per repeat (the machine is shared and noisy); each cell
is the median over repeats of decode tokens/s = (tokens - 1) / (time after the first token).
Acceptance length = tokens per verify round = tokens / (tokens - accepted). "reject-all" is a
drafter that always proposes a token the target never picks: the cost of verification alone.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tf_async import Engine
from tf_async.engine.build import load_model

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. "
             "Every night its lamp turned slowly, sending a beam of light across the dark water "
             "so that ships could find their way home through the storm.")
TYPOS = PARAGRAPH.replace("lighthouse", "lighthose").replace("across", "accross").replace(
    "through", "thru")
PROMPTS = {
    "quote": f"Repeat the following text exactly:\n\n{PARAGRAPH}",
    "edit": f"Fix the spelling mistakes in this text and write it out again:\n\n{TYPOS}",
    "free": "Write a short story about a cat who learns to fly.",
    "list": "Give me five ideas for a weekend trip, one line each.",
}
HELPS = {"quote": "yes", "edit": "yes", "free": "no", "list": "no"}


async def measure(eng: Engine, prompt: str, max_tokens: int) -> tuple[float, int, int]:
    """(decode tokens/s, tokens, accepted drafts) of one greedy chat request."""
    first = last = 0.0
    num_tokens, usage = 0, None
    async for delta in eng.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens):
        now = time.perf_counter()
        first = first or now
        last = now
        num_tokens += len(delta.token_ids)
        usage = delta.usage or usage
    accepted = usage.accepted_tokens if usage else 0
    first_tokens = 1  # the first delta carries the prompt's sampled token (maybe + drafts: 0)
    return (num_tokens - first_tokens) / max(last - first, 1e-9), num_tokens, accepted


def reject_all(eng: Engine) -> None:
    """Swap the ngram drafter's proposals for tokens the target never emits."""
    drafter = eng.parts.scheduler.drafter
    bad = eng.parts.vocab_size - 1

    def propose(seq, limit):
        return (bad,) * min(limit, drafter.draft_tokens) if drafter.is_open(seq) else ()

    drafter.propose = propose


async def run(args: argparse.Namespace) -> None:
    ckpt = await asyncio.to_thread(load_model, None)
    base = dict(device="cpu", parallel=1, ctx=1024, step_tokens=512)
    k = args.draft_tokens
    configs = {"plain": {}, f"ngram k={k}": dict(drafter="ngram", draft_tokens=k),
               "reject-all": dict(drafter="ngram", draft_tokens=k)}
    if args.self_draft:
        configs[f"draft:self k={k}"] = dict(drafter=f"draft:{ckpt.path}", draft_tokens=k)
    engines = {name: Engine(ckpt, **base, **extra) for name, extra in configs.items()}
    for eng in engines.values():
        await eng.start()
    reject_all(engines["reject-all"])
    cells: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    for _ in range(args.repeats):
        for prompt_name, prompt in PROMPTS.items():
            for name, eng in engines.items():  # side by side, interleaved
                cells.setdefault((prompt_name, name), []).append(
                    await measure(eng, prompt, args.max_tokens))
    for eng in engines.values():
        await eng.close()
    print_table(cells, list(engines))


def print_table(cells: dict, names: list[str]) -> None:
    print(f"{'prompt':<7} {'helps':<5} {'drafter':<16} {'tok/s':>7} {'x plain':>8} "
          f"{'tokens':>6} {'accept len':>10}")
    for prompt_name in PROMPTS:
        plain = statistics.median(c[0] for c in cells[prompt_name, "plain"])
        for name in names:
            runs = cells[prompt_name, name]
            rate = statistics.median(c[0] for c in runs)
            tokens = sum(c[1] for c in runs)
            accepted = sum(c[2] for c in runs)
            accept_len = tokens / max(tokens - accepted, 1)
            print(f"{prompt_name:<7} {HELPS[prompt_name]:<5} {name:<16} {rate:>7.1f} "
                  f"{rate / plain:>7.2f}x {tokens // len(runs):>6} {accept_len:>10.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--self-draft", action="store_true", help="also the target as its own drafter")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
