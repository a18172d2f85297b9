"""`tf-async serve` and `tf-async chat`: argument parsers and runners.

The top-level CLI (tf_async/cli.py) adds these to its subcommands:
`add_serve_args(parser)` + `run_serve(args)`, `add_chat_args(parser)` + `run_chat(args)`.
The chat client itself lives in chat_client.py.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable
from typing import Any

import aiohttp
from aiohttp import web

from ..errors import BadInputError
from .app import DEFAULT_MAX_BODY_BYTES, SERVER_KEY, create_app, start_server
from .chat_client import ChatError, ChatSession, InProcessChatClient, WsChatClient, chat_loop
from .metrics import ServerMetrics

log = logging.getLogger("tf_async.server")
CANCEL_GRACE_S = 5.0  # after cancelling at shutdown, how long handlers may take to answer


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the model and how it runs (shared by serve, chat, gate and bench)."""
    parser.add_argument("--model", default=None,
                        help="HF folder, MLX folder or .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs (auto: the GPU when there is one)")
    parser.add_argument("--kv-dtype", default="f32", choices=("f32", "bf16", "fp8"),
                        help="dtype of the KV cache (bf16/fp8 fit more tokens in memory)")
    parser.add_argument("--drafter", default=None, help="speculative drafter: ngram, mtp, draft:PATH or dflash:PATH "
                        "(a DFlash / DFlash2 checkpoint)")
    parser.add_argument("--draft-tokens", type=int, default=4,
                        help="tokens the drafter proposes per round")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CUDA device, replay decode rounds of dense models from captured "
                             "CUDA graphs (same bits as eager; --no-cuda-graphs runs every round eagerly)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the weights and KV heads of a dense model over N ranks: N GPUs "
                             "over NCCL on CUDA, N simulated ranks on the CPU "
                             "(docs/TENSOR_PARALLEL.md)")


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
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV pages of prompts seen before (resumed chats, shared "
                             "system prompts; same outputs); paging only")
    parser.add_argument("--prefix-state-pages", type=int, default=16,
                        help="hybrid models with the prefix cache: keep a recurrent state every N "
                             "pages of a prompt (and at its end) for streams that resume there")
    parser.add_argument("--prefix-state-slots", type=int, default=None,
                        help="hybrid models with the prefix cache: recurrent states kept "
                             "(default: one a lane; each costs one lane's state)")
    parser.add_argument("--step-tokens", type=int, default=256,
                        help="prompt tokens per round (stepped prefill)")
    add_decode_steps_arg(parser)
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests that may wait for a lane; more get HTTP 429")
    parser.add_argument("--draft-ring", type=int, default=None,
                        help="ring rows of a drafter's context (default: --ctx); draft:PATH and mtp "
                        "draft while a stream fits in it, dflash keeps its windows there")
    parser.add_argument("--draft-areas", type=int, default=None,
                        help="drafter areas in the arena (default: one a lane; env TF_DRAFT_AREAS)")
    parser.add_argument("--ngram-min", type=int, default=2,
                        help="shortest suffix the ngram drafter matches (1 to 3)")
    parser.add_argument("--draft-backoff", type=int, default=32,
                        help="after n rounds in a row with every draft rejected, a stream skips "
                        "drafting for 2^(n-1) - 1 rounds, at most this many, then probes with one "
                        "draft (0: draft every round)")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `tf-async serve`."""
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000,
                        help="TCP port to listen on (0: any free port)")
    parser.add_argument("--api-key", default=os.environ.get("TF_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(env TF_API_KEY)")
    parser.add_argument("--cors-origin", default=None,
                        help="allow this browser origin (CORS); none by default")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (bigger: HTTP 413)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="before reporting ready, run a few tiny requests so every kernel a "
                             "request can reach is compiled (the first request is not slower)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"), help="server log level")
    parser.add_argument("--shutdown-timeout", type=float, default=20.0, metavar="SECONDS",
                        help="on SIGINT/SIGTERM, let running streams finish for up to this long, "
                             "then cancel the rest (a second Ctrl-C stops at once)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="data-parallel replicas: N engine processes (GPU i each with "
                             "--device cuda; a share of the cores each on the CPU) behind one "
                             "endpoint that routes by load and keeps conversations on their "
                             "replica (docs/SCALE_OUT.md)")
    parser.add_argument("--affinity-margin", type=int, default=2, metavar="REQUESTS",
                        help="with --replicas: a conversation stays on its replica unless that "
                             "one has more than this many requests more than the least loaded")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) the API answers to (aliases, e.g. gpt-4o-mini); the "
                             "first is listed first; default: the model's own name")


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `tf-async serve`'s flags alone (replicas read their flags with it)."""
    parser = argparse.ArgumentParser(prog="tf-async serve", add_help=False)
    add_serve_args(parser)
    return parser


def engine_from_args(args: argparse.Namespace) -> Any:
    from ..api import Engine

    return Engine(args.model, device=args.device, parallel=args.parallel, ctx=args.ctx,
                  kv_dtype=args.kv_dtype, paging=args.paging, kv_pages=args.kv_pages,
                  step_tokens=args.step_tokens, drafter=args.drafter,
                  draft_tokens=args.draft_tokens, max_queue=args.max_queue,
                  cuda_graphs=args.cuda_graphs, decode_steps=args.decode_steps,
                  prefix_cache=args.prefix_cache, draft_ring=args.draft_ring,
                  draft_areas=args.draft_areas, ngram_min=args.ngram_min,
                  draft_backoff=args.draft_backoff,
                  prefix_state_pages=args.prefix_state_pages,
                  prefix_state_slots=args.prefix_state_slots, tensor_parallel=args.tensor_parallel)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM, then drain (see `_shutdown`)."""
    check_port_free(args.host, args.port)  # before the model loads, which can take minutes
    if args.replicas != 1:  # tf_async/cli.py sends --replicas N > 1 to serving/cli.py
        raise BadInputError(f"--replicas must be at least 1, not {args.replicas}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:  # Ctrl-C while the model was still loading
        print("tf-async: interrupted before the server started", file=sys.stderr)
        return 130
    return 0


def check_port_free(host: str, port: int) -> None:
    """BadInputError (one line, exit code 2) when host:port cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BadInputError(f"cannot resolve --host {host}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                sock.bind(address)
            except OSError as exc:
                raise BadInputError(_bind_error(host, port, exc)) from None


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use (another server running?); "
                f"stop it or pick another port with --port")
    return f"cannot listen on {host}:{port}: {exc.strerror}"


class StopSignals:
    """SIGINT/SIGTERM: the first asks for a graceful stop, the second for an immediate one."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.second if self.first.is_set() else self.first).set()


async def _serve(args: argparse.Namespace) -> None:
    print(f"tf-async: loading {args.model or 'the default model'} (device {args.device})",
          flush=True)
    async with engine_from_args(args) as engine:
        if args.warmup:
            await engine.warm_up()
        app = create_app(engine, api_key=args.api_key, cors_origin=args.cors_origin,
                         model_name=args.served_model_name, max_body_bytes=args.max_body_bytes)
        runner, port = await start_server(app, args.host, args.port)
        signals = StopSignals(asyncio.get_running_loop())
        print(f"tf-async: serving {engine.model_name} on http://{args.host}:{port} "
              f"(web chat at /, OpenAI API at /v1; Ctrl-C to stop)", flush=True)
        await signals.first.wait()
        await _shutdown(runner, engine, args.shutdown_timeout, signals.second)


async def _shutdown(runner: web.AppRunner, engine: Any, timeout_s: float,
                    now: asyncio.Event) -> None:
    """Stop listening and refuse new requests, let running streams finish for up to
    `timeout_s` (or until `now` is set: a second Ctrl-C), cancel the rest, close."""
    metrics = runner.app[SERVER_KEY].metrics
    held = metrics.num_in_flight
    print(f"tf-async: shutting down: no new requests; draining {held} request(s) for up to "
          f"{timeout_s:g} s (Ctrl-C again to stop now)", flush=True)
    engine.refuse_new("the server is shutting down; retry on another server or later")
    for site in list(runner.sites):  # no new connections; open ones (websockets too) stay
        await site.stop()             # readable, so a client can still cancel its stream
    drained = await _first_of(_drained(engine, metrics), now.wait(), timeout_s)
    cancelled = 0
    if not drained:
        cancelled = metrics.num_in_flight
        why = "second signal" if now.is_set() else f"{timeout_s:g} s timeout"
        print(f"tf-async: {why}: cancelling {cancelled} request(s)", flush=True)
        await engine.cancel_all()
        # Handlers end within a few loop turns of their stream's last event.
        await _first_of(metrics.wait_none_in_flight(), asyncio.Event().wait(), CANCEL_GRACE_S)
    await runner.cleanup()
    stats = engine.stats()
    print(f"tf-async: stopped ({held - cancelled} request(s) finished, {cancelled} cancelled; "
          f"{stats['lanes_in_use']} lanes, {stats['pages_in_use']} pages in use)", flush=True)


async def _drained(engine: Any, metrics: ServerMetrics) -> None:
    await engine.wait_idle()
    await metrics.wait_none_in_flight()


async def _first_of(done: Awaitable[None], abort: Awaitable[object], timeout_s: float) -> bool:
    """True when `done` completes before `abort` and the timeout."""
    done_task = asyncio.ensure_future(done)
    abort_task = asyncio.ensure_future(abort)
    try:
        await asyncio.wait({done_task, abort_task}, timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        return done_task.done()
    finally:
        for task in (done_task, abort_task):
            task.cancel()


# ---------------------------------------------------------------- terminal chat


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `tf-async chat`."""
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server to talk to over its websocket")
    parser.add_argument("--in-process", action="store_true",
                        help="run an engine in this process instead of connecting")
    parser.add_argument("--api-key", default=os.environ.get("TF_API_KEY"),
                        help="the server's API key (env TF_API_KEY)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (same seed, same reply)")
    add_engine_args(parser)


__all__ = ["ChatError", "ChatSession", "InProcessChatClient", "WsChatClient", "add_chat_args",
           "add_serve_args", "run_chat", "run_serve"]


def run_chat(args: argparse.Namespace) -> int:
    """Terminal chat; Ctrl-C stops the current reply, Ctrl-C at the prompt (or EOF) quits."""
    try:
        asyncio.run(_chat(args))
    except KeyboardInterrupt:
        pass
    except aiohttp.ClientError as exc:
        print(f"tf-async chat: error: cannot reach {args.url} ({exc}); is `tf-async serve` "
              f"running there? (--url picks the server; --in-process runs the model here)",
              file=sys.stderr)
        return 2
    return 0


async def _chat(args: argparse.Namespace) -> None:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.in_process:
        async with engine_from_args(args) as engine:
            session = ChatSession(InProcessChatClient(engine), system=args.system, **params)
            await chat_loop(session, "this process")
    else:
        async with WsChatClient(args.url, args.api_key) as client:
            await chat_loop(ChatSession(client, system=args.system, **params), args.url)
