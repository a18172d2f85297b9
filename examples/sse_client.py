"""Read the server's SSE stream by hand with aiohttp (no OpenAI SDK).

    python examples/sse_client.py "Tell me a joke" [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp


async def stream_chat(url: str, prompt: str, api_key: str | None) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 128,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:  # events are `data: {json}\n\n`, then `data: [DONE]`
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk["choices"]:
                print(chunk["choices"][0]["delta"].get("content") or "", end="", flush=True)
            else:
                print(f"\n[usage: {chunk['usage']}]")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt", nargs="?", default="Tell me a short story.")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    asyncio.run(stream_chat(args.url, args.prompt, args.api_key))


if __name__ == "__main__":
    main()
