"""Shared pieces of the server tests: a tiny random checkpoint, a live server on a loopback
ephemeral port, SSE parsing, and waiting for a condition (bounded polling, never a fixed
sleep standing in for synchronisation)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

from tf_async.server.app import create_app, start_server

from .tiny import random_hf_weights, tiny_config

MODEL_NAME = "tiny-test"


def write_tiny_model(folder: Path) -> Path:
    """A tiny random llama checkpoint (HF safetensors + tokenizer) in `folder`."""
    from .tiny_hf import write_hf

    cfg = tiny_config("llama", max_position_embeddings=1024)
    write_hf(folder, cfg, random_hf_weights(cfg, seed=3))
    return folder


@contextlib.asynccontextmanager
async def live_server(engine: Any, **app_kwargs: Any) -> AsyncIterator[str]:
    """Serve `engine` on 127.0.0.1:<ephemeral>; yields the base URL."""
    app_kwargs.setdefault("model_name", MODEL_NAME)
    runner, port = await start_server(create_app(engine, **app_kwargs), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def live_openai_client(engine: Any) -> AsyncIterator[Any]:
    """The openai SDK's AsyncOpenAI against `engine` served on loopback (no retries)."""
    import openai

    async with live_server(engine) as url, openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0) as oa:
        yield oa


async def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0,
                   what: str = "condition") -> None:
    """Poll `condition` until true (checks every 5 ms), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def is_idle(engine: Any) -> bool:
    stats = engine.stats()
    return (stats["lanes_in_use"] == 0 and stats["pages_in_use"] == 0
            and stats["queued"] == 0 and stats["running"] == 0)


async def wait_idle(engine: Any, timeout_s: float = 60.0) -> None:
    await wait_for(lambda: is_idle(engine), timeout_s, f"idle engine (stats {engine.stats()})")


def parse_sse(body: bytes) -> list[Any]:
    """`data:` payloads of an SSE body, JSON-decoded; the final `[DONE]` stays a string."""
    assert body.endswith(b"\n\n"), body[-80:]
    events: list[Any] = []
    for block in body.decode().split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return events


def metric_value(text: str, name: str, labels: str = "") -> float:
    """One sample of Prometheus text (`labels` like 'endpoint="chat",outcome="stop"')."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@contextlib.asynccontextmanager
async def open_engine(folder: Path, **engine_kwargs: Any) -> AsyncIterator[Any]:
    """The real tf_async.Engine (CPU) on the tiny checkpoint in `folder` (written if missing)."""
    from tf_async import Engine

    if not (folder / "config.json").exists():
        write_tiny_model(folder)
    engine_kwargs.setdefault("device", "cpu")
    async with Engine(str(folder), **engine_kwargs) as engine:
        yield engine
