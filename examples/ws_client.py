"""Websocket chat: two chats at once on one socket, and a cancel.

    python examples/ws_client.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp


async def main_async(url: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ws_url = url.replace("http", "ws", 1) + "/v1/chat/ws"
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, headers=headers) as ws:
        for chat_id, question in (("poem", "Write a poem."), ("fact", "Tell me a fact.")):
            await ws.send_json({"type": "chat", "id": chat_id, "max_tokens": 64,
                                "messages": [{"role": "user", "content": question}]})
        texts = {"poem": "", "fact": ""}
        open_chats = set(texts)
        while open_chats:
            msg = await ws.receive_json()
            if msg["type"] == "delta":
                texts[msg["id"]] += msg["text"]
                if msg["id"] == "poem" and len(texts["poem"]) > 40:
                    await ws.send_json({"type": "cancel", "id": "poem"})  # enough poetry
            else:  # "done" (finish_reason stop/length/cancelled) or "error"
                print(f"--- {msg['id']}: {msg.get('finish_reason') or msg.get('error')}")
                print(texts[msg["id"]])
                open_chats.discard(msg["id"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    asyncio.run(main_async(args.url, args.api_key))


if __name__ == "__main__":
    main()
