"""Data-parallel replicas: aggregate tokens/s of N concurrent streams against one replica
and against two replicas behind one endpoint (`tf-async serve --replicas 2`).

    python benchmarks/bench_replicas.py [--model PATH] [--streams 16] [--max-tokens 64]
        [--rounds 3]

Both servers run at once (an idle server sleeps); the runs alternate (one replica, two
replicas, ...) and each figure is the median of `--rounds`. Same total lanes: one replica
gets --parallel STREAMS, each of two gets STREAMS / 2. Prints a Markdown table, the ratio,
the machine's cores and its load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import aiohttp


def start_server(replicas: int, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    parallel = args.streams // replicas
    cmd = [sys.executable, "-m", "tf_async.cli", "serve", "--port", "0", "--device", "cpu",
           "--parallel", str(parallel), "--ctx", "1024", "--replicas", str(replicas),
           "--log-level", "warning"] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    for raw in proc.stdout:  # the front's (or the server's) serving line
        line = raw.decode()
        if line.startswith("tf-async: serving "):
            return proc, line.split(" on ")[1].split()[0]
    raise RuntimeError(f"server with {replicas} replica(s) exited before serving")


async def one_stream(http: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": f"Story {i}: a lighthouse keeper."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        async for raw in resp.content:
            if raw.startswith(b"data: {") and b'"usage":{' in raw:
                tokens = int(raw.split(b'"completion_tokens":')[1].split(b",")[0])
    return tokens


async def measure(url: str, streams: int, max_tokens: int) -> float:
    """Aggregate generated tokens/s of `streams` concurrent streams."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(http, url, i, max_tokens)
                                        for i in range(streams)))
        wall_s = time.perf_counter() - start
    assert sum(counts) == streams * max_tokens, counts
    return sum(counts) / wall_s


async def bench(urls: dict[int, str], args: argparse.Namespace) -> dict[int, list[float]]:
    for url in urls.values():  # one short untimed round each
        await measure(url, args.streams, 4)
    figures: dict[int, list[float]] = {replicas: [] for replicas in urls}
    for _ in range(args.rounds):
        for replicas, url in urls.items():
            figures[replicas].append(await measure(url, args.streams, args.max_tokens))
            print(f"  {replicas} replica(s): {figures[replicas][-1]:.1f} tok/s", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    servers = {replicas: start_server(replicas, args) for replicas in (1, 2)}
    try:
        load_before = os.getloadavg()
        figures = asyncio.run(bench({r: url for r, (_, url) in servers.items()}, args))
        load_after = os.getloadavg()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    one, two = (statistics.median(figures[r]) for r in (1, 2))
    print(f"\n{args.streams} concurrent streams x {args.max_tokens} tokens, median of "
          f"{args.rounds}; {os.cpu_count()} cores; load average before "
          f"{load_before[0]:.2f}, after {load_after[0]:.2f}\n")
    print("| replicas | lanes each | aggregate tok/s (median) | runs |")
    print("|---|---|---|---|")
    for replicas, median in ((1, one), (2, two)):
        runs = ", ".join(f"{f:.1f}" for f in figures[replicas])
        print(f"| {replicas} | {args.streams // replicas} | {median:.1f} | {runs} |")
    print(f"\nratio 2 replicas / 1 replica: {two / one:.2f}x")


if __name__ == "__main__":
    main()
