"""Server benchmark: TTFT, inter-token latency and aggregate tokens/s over SSE at 1/8/32
concurrent clients, against the in-process async API on the same engine settings.

    python benchmarks/bench_server.py [--model PATH] [--clients 1 8 32] [--max-tokens 64]

The in-process runs go first (engine in this process), then the same load goes to
`tf-async serve` in a child process over loopback SSE; the table reports the server's
overhead per token (1 - SSE tok/s / in-process tok/s). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp


@dataclass
class StreamTiming:
    ttft_s: float
    gaps_s: list[float]
    num_tokens: int


@dataclass
class RunResult:
    clients: int
    wall_s: float
    timings: list[StreamTiming]

    def row(self, label: str) -> str:
        ttfts = [t.ttft_s for t in self.timings]
        gaps = [g for t in self.timings for g in t.gaps_s] or [0.0]
        tokens = sum(t.num_tokens for t in self.timings)
        return (f"| {label} | {self.clients} | {1e3 * statistics.median(ttfts):.1f} | "
                f"{1e3 * _p(ttfts, 0.9):.1f} | {1e3 * statistics.median(gaps):.2f} | "
                f"{1e3 * _p(gaps, 0.9):.2f} | {tokens / self.wall_s:.1f} |")

    @property
    def tokens_per_s(self) -> float:
        return sum(t.num_tokens for t in self.timings) / self.wall_s


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompts(num: int) -> list[str]:
    return [f"Request {i}: write a long story about a lighthouse keeper." for i in range(num)]


async def inprocess_stream(engine, prompt: str, max_tokens: int) -> StreamTiming:
    start = last = time.perf_counter()
    ttft, gaps, num_tokens = 0.0, [], 0
    async for delta in engine.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
        now = time.perf_counter()
        if delta.token_ids:
            if num_tokens == 0:
                ttft = now - start
            else:
                gaps.append((now - last) / len(delta.token_ids))
            num_tokens += len(delta.token_ids)
            last = now
    return StreamTiming(ttft, gaps, num_tokens)


async def sse_stream(http: aiohttp.ClientSession, url: str, prompt: str,
                     max_tokens: int) -> StreamTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    ttft, gaps, num_chunks, num_tokens = 0.0, [], 0, 0
    async with http.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                num_tokens = chunk["usage"]["completion_tokens"]
                continue
            now = time.perf_counter()
            if num_chunks == 0:
                ttft = now - start
            else:
                gaps.append(now - last)
            num_chunks += 1
            last = now
    return StreamTiming(ttft, gaps, num_tokens)


async def run_inprocess(args: argparse.Namespace) -> list[RunResult]:
    from tf_async import Engine

    results = []
    async with Engine(args.model, device=args.device, parallel=args.parallel,
                      ctx=args.ctx) as engine:
        await engine.complete("warm up", max_tokens=4)
        for clients in args.clients:
            start = time.perf_counter()
            timings = await asyncio.gather(*(inprocess_stream(engine, p, args.max_tokens)
                                             for p in prompts(clients)))
            results.append(RunResult(clients, time.perf_counter() - start, list(timings)))
    return results


async def run_sse(args: argparse.Namespace, url: str) -> list[RunResult]:
    results = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await sse_stream(http, url, "warm up", 4)
        for clients in args.clients:
            start = time.perf_counter()
            timings = await asyncio.gather(*(sse_stream(http, url, p, args.max_tokens)
                                             for p in prompts(clients)))
            results.append(RunResult(clients, time.perf_counter() - start, list(timings)))
    return results


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import argparse,sys; from tf_async.server.cli import add_serve_args, run_serve; "
            "p = argparse.ArgumentParser(); add_serve_args(p); "
            "sys.exit(run_serve(p.parse_args(sys.argv[1:])))")
    cmd = [sys.executable, "-c", code, "--port", str(port), "--parallel", str(args.parallel),
           "--ctx", str(args.ctx), "--device", args.device, "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "tf-async: loading ...", then "serving ..." once listening
    while line and "serving" not in line:
        line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{port}"


def _median_run(results: list[RunResult]) -> RunResult:
    return sorted(results, key=lambda r: r.tokens_per_s)[len(results) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    proc, url = start_server(args)
    runs: list[tuple[list[RunResult], list[RunResult]]] = []
    try:  # in-process and SSE alternate in every repeat; the tables use the median repeat
        for _ in range(args.repeats):
            runs.append((asyncio.run(run_inprocess(args)), asyncio.run(run_sse(args, url))))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    inproc = [_median_run([r[0][i] for r in runs]) for i in range(len(args.clients))]
    sse = [_median_run([r[1][i] for r in runs]) for i in range(len(args.clients))]
    print("| path | clients | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for a, b in zip(inproc, sse, strict=True):
        print(a.row("in-process"))
        print(b.row("SSE"))
    for a, b in zip(inproc, sse, strict=True):
        overhead = a.tokens_per_s / b.tokens_per_s - 1.0  # extra time per token over SSE
        print(f"server overhead at {a.clients} clients: {100 * overhead:+.1f}% per token "
              f"(median of {args.repeats} alternating repeats)")


if __name__ == "__main__":
    main()
