"""Cold start of `tf-async serve`: time until it reports ready, then the time to first token
of the first three chat requests (SSE, one at a time, each a new prompt), with and without
the start-up warm-up, with no Numba cache on disk (cold: a fresh NUMBA_CACHE_DIR) and with
the cache the cold run left (warm).

    python benchmarks/cold_start.py [--model PATH] [--threads 2] [--device cuda] [--warmup on]

Prints a Markdown table (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp


def question(number: int) -> list[dict[str, str]]:
    """The n-th request's chat: each asks something else (same length in tokens), so a later
    request cannot reuse an earlier one's prompt from the prefix cache and seem warmer."""
    return [{"role": "user", "content": f"Question {number}: what is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def ttft_s(url: str, number: int) -> float:
    body = {"messages": question(number), "max_tokens": 8, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as http:
        started = time.perf_counter()
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.content:
                if b'"content":"' in line and b'"content":""' not in line:
                    first = time.perf_counter() - started
                    break
            else:
                raise RuntimeError("no token came")
            await resp.read()
    return first


def run_server(args: argparse.Namespace, cache_dir: str, warmup: bool) -> tuple[float, list[float]]:
    """(seconds until ready, TTFT of three requests in a row)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tf_async.cli", "serve", "--device", args.device, "--port", str(port),
           "--log-level", "warning", "--warmup" if warmup else "--no-warmup"]
    cmd += ["--model", args.model] if args.model else []
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    if args.threads:
        env["NUMBA_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        while "serving" not in proc.stdout.readline():  # "tf-async: serving ..." once ready
            if proc.poll() is not None:
                raise SystemExit("the server did not start")
        ready_s = time.perf_counter() - started
        ttfts = [asyncio.run(ttft_s(f"http://127.0.0.1:{port}", n)) for n in range(1, 4)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return ready_s, ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None, help="NUMBA_NUM_THREADS")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--warmup", choices=("off", "on", "both"), default="both",
                        help="the runs without the start-up warm-up, with it, or both")
    args = parser.parse_args()
    warmups = {"off": (False,), "on": (True,), "both": (False, True)}[args.warmup]
    print("| warm-up | Numba cache | ready after (s) | TTFT 1st (ms) | TTFT 2nd (ms) | "
          "TTFT 3rd (ms) | 1st / warm |\n|---|---|---|---|---|---|---|")
    for warmup in warmups:
        with tempfile.TemporaryDirectory() as cache_dir:
            for state in ("cold", "warm"):
                ready_s, ttfts = run_server(args, cache_dir, warmup)
                print(f"| {'on' if warmup else 'off'} | {state} | {ready_s:.1f} | "
                      + " | ".join(f"{1e3 * t:.0f}" for t in ttfts)
                      + f" | {ttfts[0] / min(ttfts[1:]):.1f}x |", flush=True)


if __name__ == "__main__":
    main()
