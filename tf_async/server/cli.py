"""`tf-async serve` and `tf-async chat`: argument parsers and runners.

The top-level CLI (tf_async/cli.py) adds these to its subcommands:
`add_serve_args(parser)` + `run_serve(args)`, `add_chat_args(parser)` + `run_chat(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any, TextIO

import aiohttp

from ..errors import BadInputError, QueueFullError
from .app import DEFAULT_MAX_BODY_BYTES, create_app, start_server

log = logging.getLogger("tf_async.server")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the model and how it runs (shared by serve, chat, gate and bench)."""
    parser.add_argument("--model", default=None,
                        help="HF folder, MLX folder or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--kv-dtype", default="f32", choices=("f32", "bf16", "fp8"))
    parser.add_argument("--drafter", default=None, help="speculative drafter: ngram, mtp or draft:PATH")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CUDA device, replay decode rounds of dense models from captured "
                             "CUDA graphs (same bits as eager; --no-cuda-graphs runs every round eagerly)")


def add_decode_steps_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="decode rounds of greedy/seeded streams run up to N forwards in a row, "
                             "each token fed on the device (less host time a token; tokens arrive "
                             "N at a time)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that build an Engine (shared by serve and in-process chat)."""
    add_model_args(parser)
    parser.add_argument("--parallel", type=int, default=4, help="lanes (concurrent streams)")
    parser.add_argument("--ctx", type=int, default=4096, help="context rows per stream")
    parser.add_argument("--kv-pages", type=int, default=_env_int("TF_KV_PAGES"),
                        help="KV page pool size with paging (env TF_KV_PAGES)")
    parser.add_argument("--paging", action=argparse.BooleanOptionalAction, default=True,
                        help="take KV pages on demand from a shared pool")
    parser.add_argument("--step-tokens", type=int, default=256,
                        help="prompt tokens per round (stepped prefill)")
    add_decode_steps_arg(parser)
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests that may wait for a lane; more get HTTP 429")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `tf-async serve`."""
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("TF_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(env TF_API_KEY)")
    parser.add_argument("--cors-origin", default=None,
                        help="allow this browser origin (CORS); none by default")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) the API answers to (aliases, e.g. gpt-4o-mini); the "
                             "first is listed first; default: the model's own name")
    parser.add_argument("--log-level", default="info")


def engine_from_args(args: argparse.Namespace) -> Any:
    from ..api import Engine

    return Engine(args.model, device=args.device, parallel=args.parallel, ctx=args.ctx,
                  kv_dtype=args.kv_dtype, paging=args.paging, kv_pages=args.kv_pages,
                  step_tokens=args.step_tokens, drafter=args.drafter,
                  draft_tokens=args.draft_tokens, max_queue=args.max_queue,
                  cuda_graphs=args.cuda_graphs,
                  decode_steps=args.decode_steps)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_serve(args))
    return 0


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with engine_from_args(args) as engine:
        app = create_app(engine, api_key=args.api_key, cors_origin=args.cors_origin,
                         model_name=args.served_model_name, max_body_bytes=args.max_body_bytes)
        runner, port = await start_server(app, args.host, args.port)
        print(f"tf-async: serving {engine.model_name} on http://{args.host}:{port} "
              f"(web chat at /, OpenAI API at /v1)", flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()


# ---------------------------------------------------------------- terminal chat


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `tf-async chat`."""
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server to talk to over its websocket")
    parser.add_argument("--in-process", action="store_true",
                        help="run an engine in this process instead of connecting")
    parser.add_argument("--api-key", default=os.environ.get("TF_API_KEY"))
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_args(parser)


class ChatError(RuntimeError):
    """The server refused or failed a chat (the message says why)."""


class WsChatClient:
    """Chats over /v1/chat/ws; one reply at a time, cancel by id."""

    def __init__(self, url: str, api_key: str | None = None):
        self.url = url.rstrip("/").replace("http", "ws", 1) + "/v1/chat/ws"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._next_id = 0

    async def __aenter__(self) -> WsChatClient:
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(self.url, headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def reply(self, messages: list[dict[str, str]], **params: Any) -> AsyncIterator[str]:
        """Yield the reply's text pieces; cancelling the consumer sends a cancel message."""
        assert self._ws is not None
        self._next_id += 1
        chat_id = self._next_id
        await self._ws.send_json({"type": "chat", "id": chat_id, "messages": messages, **params})
        try:
            while True:
                msg = await self._ws.receive_json()
                if msg.get("id") != chat_id:
                    continue
                if msg["type"] == "delta":
                    yield msg["text"]
                elif msg["type"] == "error":
                    raise ChatError(msg["error"]["message"])
                else:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self._cancel(chat_id)
            raise

    async def _cancel(self, chat_id: int) -> None:
        """Tell the server to stop, then drain until its `done` so the socket stays in step."""
        assert self._ws is not None
        await self._ws.send_json({"type": "cancel", "id": chat_id})
        while True:
            msg = await self._ws.receive_json()
            if msg.get("id") == chat_id and msg["type"] in ("done", "error"):
                return


class InProcessChatClient:
    """The same `reply` on an Engine in this process."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def reply(self, messages: list[dict[str, str]], **params: Any) -> AsyncIterator[str]:
        async with contextlib.aclosing(self.engine.chat(messages, **params)) as deltas:
            async for delta in deltas:
                if delta.text:
                    yield delta.text


class ChatSession:
    """Multi-turn history; `ask` streams one reply to `out` (a stopped reply is kept)."""

    def __init__(self, client: Any, *, system: str | None = None, **params: Any):
        self.client = client
        self.params = params
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    async def ask(self, text: str, out: TextIO) -> str:
        self.history.append({"role": "user", "content": text})
        pieces: list[str] = []
        try:
            async for piece in self.client.reply(list(self.history), **self.params):
                pieces.append(piece)
                out.write(piece)
                out.flush()
        except (ChatError, BadInputError, QueueFullError):
            self.history.pop()  # the turn got no reply: forget it
            raise
        finally:
            if self.history and self.history[-1]["role"] == "user":  # finished or stopped
                self.history.append({"role": "assistant", "content": "".join(pieces)})
            out.write("\n")
        return "".join(pieces)


def run_chat(args: argparse.Namespace) -> int:
    """Terminal chat; Ctrl-C stops the current reply, Ctrl-C at the prompt (or EOF) quits."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_chat(args))
    return 0


async def _chat(args: argparse.Namespace) -> None:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.in_process:
        async with engine_from_args(args) as engine:
            await _chat_loop(ChatSession(InProcessChatClient(engine), system=args.system, **params))
    else:
        async with WsChatClient(args.url, args.api_key) as client:
            await _chat_loop(ChatSession(client, system=args.system, **params))


async def _chat_loop(session: ChatSession, stdin: TextIO = sys.stdin,
                     stdout: TextIO = sys.stdout) -> None:
    loop = asyncio.get_running_loop()
    current: dict[str, asyncio.Task[Any]] = {}
    loop.add_signal_handler(signal.SIGINT, lambda: [t.cancel() for t in current.values()])
    reader = await _stdin_reader(stdin)
    try:
        while True:
            stdout.write("> ")
            stdout.flush()
            current["read"] = asyncio.create_task(reader())
            try:
                line = await current["read"]
            except asyncio.CancelledError:
                return  # Ctrl-C at the prompt quits
            del current["read"]
            if not line:
                return  # EOF
            if line.strip():
                current["reply"] = asyncio.create_task(session.ask(line.strip(), stdout))
                try:
                    await current["reply"]
                except asyncio.CancelledError:
                    pass  # Ctrl-C stops this reply only
                except (ChatError, BadInputError, QueueFullError) as exc:
                    print(f"error: {exc}", file=sys.stderr)
                current.pop("reply", None)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _stdin_reader(stdin: TextIO) -> Any:
    """An async readline for stdin (a pipe/tty through the loop; else a thread)."""
    loop = asyncio.get_running_loop()
    try:
        stream = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), stdin)
    except (ValueError, OSError):
        return lambda: asyncio.to_thread(stdin.readline)

    async def readline() -> str:
        return (await stream.readline()).decode(errors="replace")

    return readline
