"""Prefill and decode tokens/s of the default model on this CPU: tf_async vs llama.cpp
(llama-cpp-python, same GGUF, same thread count) vs transformers (where installed), side by side.

Usage: python benchmarks/bench_cpu_vs_llamacpp.py [--threads 2] [--repeats 5] [--decode 64] [--prefill 256]
       [--decode-after-prompt] [--no-transformers] [--kv-dtype f32|bf16|fp8]
Decode runs after a 16-token prompt, or after the whole prompt with --decode-after-prompt.
Each figure is the median of `repeats` runs; the engines alternate inside every repeat, and each
run is a fresh process so that one library's thread pool never competes with another's.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import os
import statistics
import time
from typing import Any

TEXT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall "
        "of Constantinople. Historians divide it into periods marked by wars, reforms and emperors. ") * 200


def _ctx(ids: list[int], decode: int) -> int:
    """A context that holds the prompt and the decode run (2048 at least)."""
    return max(2048, len(ids) + decode + 64)


def bench_tf_async(path: str, ids: list[int], decode: int, context: int, kv_dtype: str) -> tuple[float, float]:
    from tf_async import Engine

    async def run() -> tuple[float, float]:
        async with Engine(path, device="cpu", parallel=1, ctx=_ctx(ids, decode), step_tokens=512,
                          kv_dtype=kv_dtype) as eng:
            await eng.complete(ids[:8], max_tokens=2)  # warm-up / compile
            t0 = time.perf_counter()
            await eng.complete(ids, max_tokens=1)
            prefill = len(ids) / (time.perf_counter() - t0)
            first = None
            n = 0
            async for d in eng.stream(ids[:context], max_tokens=decode, ignore_eos=True):
                n += len(d.token_ids)
                if first is None:
                    first = time.perf_counter()
            return prefill, (n - 1) / (time.perf_counter() - first)

    return asyncio.run(run())


def bench_llama_cpp(path: str, ids: list[int], decode: int, threads: int, context: int) -> tuple[float, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=_ctx(ids, decode),
                n_batch=512, verbose=False)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = len(ids) / (time.perf_counter() - t0)
    llm.reset()
    llm.eval(ids[:context])
    t0 = time.perf_counter()
    for _ in range(decode - 1):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return prefill, (decode - 1) / (time.perf_counter() - t0)


def bench_transformers(path: str, ids: list[int], decode: int, threads: int) -> tuple[float, float] | None:
    """transformers' Llama in f32 with the GGUF's weights dequantized (same values)."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    torch.set_num_threads(threads)
    model = _hf_llama(path, torch, LlamaConfig, LlamaForCausalLM)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(torch.tensor([ids]))
        prefill = len(ids) / (time.perf_counter() - t0)
        out = model(torch.tensor([ids[:16]]), use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode - 1):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return prefill, (decode - 1) / (time.perf_counter() - t0)


def _hf_llama(path, torch, LlamaConfig, LlamaForCausalLM):  # noqa: N803
    from tf_async.models.checkpoint import dense_hf_state
    from tf_async.models.loader import load_checkpoint

    ck = load_checkpoint(path)
    c, w = ck.config, ck.weights
    cfg = LlamaConfig(hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                      intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                      rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=True,
                      max_position_embeddings=c.max_position_embeddings)
    model = LlamaForCausalLM(cfg).eval()
    sd = dense_hf_state(w)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=False)
    return model


def _in_fresh_process(fn: Any, *args: Any) -> Any:
    """fn(*args) in a spawned process of its own; a process that dies (llama-cpp-python
    0.3.36 segfaults on its first eval on an AVX-512 host; 0.3.16 works) is an error here,
    where a multiprocessing.Pool would wait for it forever."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        try:
            return pool.submit(fn, *args).result()
        except concurrent.futures.process.BrokenProcessPool:
            raise SystemExit(f"{fn.__name__}: its process died (a crash in the library?)") from None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode-after-prompt", action="store_true", help="decode after the whole prompt")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--kv-dtype", default="f32", help="tf_async's KV (llama.cpp keeps its f16 KV)")
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    from tf_async.models.default import default_model_path
    from tf_async.models.loader import load_checkpoint

    path = default_model_path()
    ids = load_checkpoint(path).tokenizer.encode(TEXT)[: args.prefill]
    results: dict[str, list[tuple[float, float]]] = {"tf_async": [], "llama.cpp": [], "transformers": []}
    context = len(ids) if args.decode_after_prompt else 16
    for _ in range(args.repeats):
        results["tf_async"].append(_in_fresh_process(bench_tf_async, path, ids, args.decode, context,
                                                     args.kv_dtype))
        results["llama.cpp"].append(_in_fresh_process(bench_llama_cpp, path, ids, args.decode,
                                                      args.threads, context))
        if args.no_transformers:
            continue
        hf = _in_fresh_process(bench_transformers, path, ids, args.decode, args.threads)
        if hf:
            results["transformers"].append(hf)
    base = statistics.median(d for _, d in results["llama.cpp"])
    base_prefill = statistics.median(p for p, _ in results["llama.cpp"])
    print(f"default model, {args.threads} threads, prefill {len(ids)} tokens, decode {args.decode} tokens "
          f"after {context}, tf_async KV {args.kv_dtype}, median of {args.repeats}")
    print(f"{'engine':<14} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill vs llama.cpp':>21} "
          f"{'decode vs llama.cpp':>20}")
    for name, runs in results.items():
        if runs:
            pre = statistics.median(p for p, _ in runs)
            dec = statistics.median(d for _, d in runs)
            print(f"{name:<14} {pre:>14.1f} {dec:>13.1f} {pre / base_prefill:>20.2f}x {dec / base:>19.2f}x")


if __name__ == "__main__":
    main()
