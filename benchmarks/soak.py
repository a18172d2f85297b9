"""Soak and fuzz run against a tf-async server on loopback.

    python benchmarks/soak.py [--model PATH] [--requests 300] [--concurrency 8]
                              [--abandon 0.3] [--kv-pages 48] [--seed 1]

Starts `tf-async serve` twice (plain, then `--drafter ngram`) with a KV pool small enough to
force preemption, and against each: N requests at concurrency C over SSE, plain HTTP and the
websocket, greedy or seeded, a fraction abandoned at random points (a cut-off body, before
the first byte, mid-prompt, mid-stream / mid-draft, websocket cancel or close). Every finished
result is compared with the same request run alone; afterwards the server must be idle
(0 lanes, 0 pages, 0 queue). Then a fuzz list of hostile requests, each expecting a 4xx
OpenAI error JSON (or a websocket `error`) and a live server after. Prints a Markdown report.

tests/test_soak.py runs a small version in-process on a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gzip
import json
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TRANSPORTS = ("sse", "http", "ws")
ABANDONS = ("cut_body", "before_first_byte", "mid_prompt", "mid_stream", "ws_cancel", "ws_close")
WORDS = ("lighthouse", "river", "engine", "orbit", "harbor", "lantern", "copper", "meadow")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One soak request: how it is sent, what it asks, and where (if at all) it is dropped."""

    index: int
    transport: str  # sse | http | ws
    endpoint: str  # chat | completions
    prompt: str
    max_tokens: int
    seed: int | None  # None: greedy; else temperature 0.8 with this seed
    abandon: str | None  # one of ABANDONS, or None (read to the end)
    abandon_after: int  # events read (or ms waited) before abandoning

    def body(self, stream: bool) -> dict[str, Any]:
        sampling: dict[str, Any] = {"temperature": 0.0} if self.seed is None else {
            "temperature": 0.8, "seed": self.seed}
        base = {"max_tokens": self.max_tokens, **sampling}
        if stream:
            base["stream"] = True
        if self.endpoint == "chat":
            return {"messages": [{"role": "user", "content": self.prompt}], **base}
        return {"prompt": self.prompt, **base}


@dataclass(slots=True)
class Outcome:
    spec: RequestSpec
    status: int = 0  # HTTP status (101 for a websocket), 0 when never seen
    text: str = ""
    finish_reason: str | None = None
    abandoned: bool = False
    ends: int = 0  # websocket: `done`/`error` messages for this chat id
    error: str | None = None


@dataclass(slots=True)
class SoakReport:
    requests: int = 0
    finished: int = 0
    abandoned: int = 0
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)  # 5xx or in-band server errors
    protocol_errors: list[str] = field(default_factory=list)  # lost or doubled ws ends
    idle: dict[str, Any] = field(default_factory=dict)
    fuzz_failures: list[str] = field(default_factory=list)
    fuzz_cases: int = 0

    @property
    def ok(self) -> bool:
        stats = self.idle
        idle = all(stats.get(k) == 0 for k in ("lanes_in_use", "pages_in_use", "queued", "running"))
        return idle and not (self.mismatches or self.server_errors or self.protocol_errors
                             or self.fuzz_failures)


# ---------------------------------------------------------------- plan


def make_plan(num_requests: int, rng: random.Random, *, abandon_fraction: float,
              max_tokens: int, long_prompt_words: int) -> list[RequestSpec]:
    plan = []
    for index in range(num_requests):
        transport = rng.choice(TRANSPORTS)
        abandon = _pick_abandon(rng, transport) if rng.random() < abandon_fraction else None
        words = long_prompt_words if abandon == "mid_prompt" or rng.random() < 0.2 else 6
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        plan.append(RequestSpec(
            index, transport, "chat" if transport == "ws" or rng.random() < 0.5 else "completions",
            f"Request {index}: {prompt}", rng.randint(4, max_tokens),
            None if rng.random() < 0.5 else rng.randrange(1 << 30), abandon, rng.randint(0, 6)))
    return plan


def _pick_abandon(rng: random.Random, transport: str) -> str:
    if transport == "ws":
        return rng.choice(("ws_cancel", "ws_close"))
    if transport == "http":  # nothing streams: it can only go before the reply
        return rng.choice(("cut_body", "before_first_byte", "mid_prompt"))
    return rng.choice(("cut_body", "before_first_byte", "mid_prompt", "mid_stream"))


# ---------------------------------------------------------------- clients


def _path(spec: RequestSpec) -> str:
    return "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"


def _delta_text(spec: RequestSpec, chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or [{}]
    if spec.endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def run_one(http: aiohttp.ClientSession, base_url: str, spec: RequestSpec) -> Outcome:
    out = Outcome(spec)
    try:
        if spec.abandon in ("cut_body", "before_first_byte", "mid_prompt"):
            await _raw_abandon(base_url, spec, out)
        elif spec.transport == "ws":
            await _ws_chat(http, base_url, spec, out)
        elif spec.transport == "sse":
            await _sse(http, base_url, spec, out)
        else:
            await _plain(http, base_url, spec, out)
    except (aiohttp.ClientError, ConnectionError, asyncio.IncompleteReadError) as exc:
        if not out.abandoned:
            out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _plain(http: aiohttp.ClientSession, base_url: str, spec: RequestSpec,
                 out: Outcome) -> None:
    async with http.post(base_url + _path(spec), json=spec.body(stream=False)) as resp:
        out.status = resp.status
        body = await resp.json()
    if resp.status != 200:
        out.error = json.dumps(body)[:300]
        return
    choice = body["choices"][0]
    out.text = choice["message"]["content"] if spec.endpoint == "chat" else choice["text"]
    out.finish_reason = choice["finish_reason"]


async def _sse(http: aiohttp.ClientSession, base_url: str, spec: RequestSpec,
               out: Outcome) -> None:
    async with http.post(base_url + _path(spec), json=spec.body(stream=True)) as resp:
        out.status = resp.status
        if resp.status != 200:
            out.error = (await resp.text())[:300]
            return
        events = 0
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = json.dumps(chunk)[:300]
                return
            out.text += _delta_text(spec, chunk)
            choices = chunk.get("choices") or [{}]
            out.finish_reason = choices[0].get("finish_reason") or out.finish_reason
            events += 1
            if spec.abandon == "mid_stream" and events > spec.abandon_after:
                out.abandoned = True
                resp.close()  # drops the connection mid-stream
                return


async def _raw_abandon(base_url: str, spec: RequestSpec, out: Outcome) -> None:
    """A client that goes away before reading anything: mid-body, right after the request,
    or after a few ms (while a long prompt is prefilled)."""
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps(spec.body(stream=spec.transport == "sse")).encode()
    head = (f"POST {_path(spec)} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    _, writer = await asyncio.open_connection(host, int(port))
    out.abandoned = True
    try:
        if spec.abandon == "cut_body":
            writer.write(head + body[: len(body) // 2])
        else:
            writer.write(head + body)
        await writer.drain()
        if spec.abandon == "mid_prompt":
            await asyncio.sleep(spec.abandon_after / 1000)
    finally:
        writer.close()


async def _ws_chat(http: aiohttp.ClientSession, base_url: str, spec: RequestSpec,
                   out: Outcome) -> None:
    async with http.ws_connect(base_url + "/v1/chat/ws") as ws:
        out.status = 101
        await ws.send_json({"type": "chat", "id": spec.index, **spec.body(stream=False)})
        deltas = 0
        if spec.abandon == "ws_cancel" and spec.abandon_after == 0:
            await ws.send_json({"type": "cancel", "id": spec.index})  # before it starts
            out.abandoned = True
        while out.ends == 0:
            msg = await ws.receive_json(timeout=600)
            if msg.get("id") != spec.index:
                continue
            if msg["type"] == "delta":
                out.text += msg["text"]
                deltas += 1
            else:
                _ws_end(out, msg)
                break
            if spec.abandon == "ws_close" and deltas >= spec.abandon_after:
                out.abandoned = True
                return
            if spec.abandon == "ws_cancel" and not out.abandoned and deltas >= spec.abandon_after:
                await ws.send_json({"type": "cancel", "id": spec.index})
                out.abandoned = True
        await _ws_no_second_end(ws, spec, out)


def _ws_end(out: Outcome, msg: dict[str, Any]) -> None:
    out.ends += 1
    if msg["type"] == "done":
        out.finish_reason = msg["finish_reason"]
        if out.finish_reason != "cancelled":
            out.abandoned = False  # it finished before the cancel arrived: compare it
    else:
        out.error = json.dumps(msg)[:300]


async def _ws_no_second_end(ws: aiohttp.ClientWebSocketResponse, spec: RequestSpec,
                            out: Outcome) -> None:
    """A cancel after the end must be answered `unknown_id` (and nothing else for this id)."""
    await ws.send_json({"type": "cancel", "id": spec.index})
    msg = await ws.receive_json(timeout=600)
    if msg.get("type") != "error" or msg["error"].get("code") != "unknown_id":
        out.ends += 1  # a second end (or a missing answer) for this id


# ---------------------------------------------------------------- soak


async def run_soak(base_url: str, plan: list[RequestSpec], concurrency: int) -> SoakReport:
    report = SoakReport(requests=len(plan))
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:

        async def one(spec: RequestSpec) -> Outcome:
            async with limit:
                return await run_one(http, base_url, spec)

        outcomes = await asyncio.gather(*(one(spec) for spec in plan))
        report.idle = await wait_idle(http, base_url)
        solo = {o.spec.index: await run_one(http, base_url, _solo_spec(o.spec))
                for o in outcomes if not o.abandoned and o.error is None}
        report.idle = await wait_idle(http, base_url)
    _judge(report, outcomes, solo)
    return report


def _solo_spec(spec: RequestSpec) -> RequestSpec:
    """The same request, alone, over plain HTTP (outputs do not depend on the transport)."""
    return RequestSpec(spec.index, "http", spec.endpoint, spec.prompt, spec.max_tokens,
                       spec.seed, None, 0)


def _judge(report: SoakReport, outcomes: list[Outcome], solo: dict[int, Outcome]) -> None:
    for out in outcomes:
        spec = out.spec
        if out.status >= 500 or (out.error and "server_error" in out.error):
            report.server_errors.append(f"#{spec.index} {spec.transport}: {out.error}")
        elif out.error is not None:
            report.server_errors.append(f"#{spec.index} {spec.transport} failed: {out.error}")
        if spec.transport == "ws" and spec.abandon != "ws_close" and out.ends != 1:
            report.protocol_errors.append(f"#{spec.index}: {out.ends} done/error messages")
        if out.abandoned:
            report.abandoned += 1
            continue
        report.finished += 1
        alone = solo.get(spec.index)
        if alone is None or out.error is not None:
            continue
        report.compared += 1
        if (out.text, out.finish_reason) != (alone.text, alone.finish_reason):
            report.mismatches.append(f"#{spec.index} {spec.transport}: {out.text!r} != "
                                     f"{alone.text!r} (solo)")


async def wait_idle(http: aiohttp.ClientSession, base_url: str, timeout_s: float = 120.0,
                    ) -> dict[str, Any]:
    """Poll /v1/lanes until nothing runs, waits or holds pages; returns the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(base_url + "/v1/lanes") as resp:
            stats = (await resp.json())["stats"]
        busy = any(stats[k] for k in ("lanes_in_use", "pages_in_use", "queued", "running"))
        if not busy or time.monotonic() > deadline:
            return dict(stats)
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- fuzz

POST_COMP = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
GOOD = {"prompt": "hello", "max_tokens": 4}


def _raw(head: str, body: bytes = b"") -> bytes:
    return head.encode() + body


def _json_cases(max_body: int) -> list[tuple[str, str, Any]]:
    """(name, route, JSON body) of requests that must be refused with a 4xx."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = dict(GOOD)
    cases: list[tuple[str, str, Any]] = []
    for key, values in {
        "temperature": ["hot", -1, 1e308, 101, None, [1], {"a": 1}, True],
        "top_p": [0, -0.5, 2, "x"], "top_k": [-2, 1.5, "x"], "min_p": [-1, 2],
        "max_tokens": [0, -1, 10**12, 1.5, "10", True], "seed": ["x", 2**70, 1.5],
        "presence_penalty": [3, -3, "x"], "frequency_penalty": [9], "repetition_penalty": [0, 11],
        "stop": [5, [""], ["a"] * 40, [1, 2]], "logprobs": [99, -1, "x"], "n": [17, 0, "2"],
        "stream": ["yes", 1], "model": ["gpt-4", "/etc/passwd", 5], "echo": [True],
    }.items():
        for value in values:
            cases.append((f"completions {key}={value!r}", "/v1/completions", {**comp, key: value}))
    for name, messages in {
        "messages missing": None, "messages empty": [], "messages a string": "hi",
        "message not an object": ["hi"], "bad role": [{"role": "wizard", "content": "x"}],
        "content int": [{"role": "user", "content": 5}],
        "image part": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        "unknown field": [{"role": "user", "content": "x", "mood": 1}],
    }.items():
        body = {k: v for k, v in chat.items() if k != "messages"}
        if messages is not None:
            body["messages"] = messages
        cases.append((f"chat {name}", "/v1/chat/completions", body))
    cases += [
        ("top-level array", "/v1/completions", [1, 2]),
        ("top-level string", "/v1/completions", "hello"),
        ("prompt empty", "/v1/completions", {**comp, "prompt": ""}),
        ("prompt ids out of vocab", "/v1/completions", {**comp, "prompt": [1, 10**9]}),
        ("prompt ids negative", "/v1/completions", {**comp, "prompt": [-1]}),
        ("prompt longer than context", "/v1/completions", {**comp, "prompt": "word " * 50_000}),
        ("many messages", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}] * 100_000, "max_tokens": 4}),
        ("tools", "/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}),
        ("tokenize nothing", "/tokenize", {}),
        ("detokenize negative", "/detokenize", {"tokens": [-1]}),
        ("detokenize huge id", "/detokenize", {"tokens": [10**12]}),
        ("body over the limit", "/v1/completions", {**comp, "prompt": "a" * (max_body + 10)}),
    ]
    return cases


def _raw_cases() -> list[tuple[str, bytes]]:
    """(name, raw bytes) of malformed HTTP that must be answered with a 4xx JSON."""
    body = json.dumps(GOOD).encode()
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        ("malformed JSON", _raw(POST_COMP + "Content-Length: 12\r\n\r\n", b'{"prompt": [')),
        ("not UTF-8", _raw(POST_COMP + "Content-Length: 14\r\n\r\n", b'{"prompt": "\xff"}')),
        ("UTF-16 body", _raw(POST_COMP + f"Content-Length: {len(body) * 2 + 2}\r\n\r\n",
                             json.dumps(GOOD).encode("utf-16"))),
        ("deeply nested JSON", _raw(POST_COMP + f"Content-Length: {len(nested)}\r\n\r\n", nested)),
        ("gzip body that is not gzip", _raw(POST_COMP + "Content-Encoding: gzip\r\n"
                                            f"Content-Length: {len(body)}\r\n\r\n", body)),
        ("gzip bomb-ish body of zeros", _raw(
            POST_COMP + "Content-Encoding: gzip\r\n"
            f"Content-Length: {len(_zeros_gz())}\r\n\r\n", _zeros_gz())),
        ("deflate body that is not deflate", _raw(POST_COMP + "Content-Encoding: deflate\r\n"
                                                  f"Content-Length: {len(body)}\r\n\r\n", body)),
        ("br encoding", _raw(POST_COMP + f"Content-Encoding: br\r\nContent-Length: {len(body)}"
                             "\r\n\r\n", body)),
        ("unknown encoding", _raw(POST_COMP + "Content-Encoding: zstd-x\r\n"
                                  f"Content-Length: {len(body)}\r\n\r\n", body)),
        ("bad Content-Length", _raw(POST_COMP + "Content-Length: abc\r\n\r\n", body)),
        ("negative Content-Length", _raw(POST_COMP + "Content-Length: -5\r\n\r\n", body)),
        ("two Content-Lengths", _raw(POST_COMP + "Content-Length: 3\r\nContent-Length: 4\r\n\r\n",
                                     body)),
        ("bad chunk size", _raw(POST_COMP + "Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n")),
        ("over-long URL", _raw("GET /" + "a" * 10_000 + " HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("over-long header", _raw("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + "a" * 10_000
                                  + "\r\n\r\n")),
        ("too many headers", _raw("GET /health HTTP/1.1\r\nHost: x\r\n"
                                  + "".join(f"X-{i}: {i}\r\n" for i in range(300)) + "\r\n")),
        ("bad method", _raw("G(T /health HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("bad version", _raw("GET /health HTTP/9.9\r\nHost: x\r\n\r\n")),
        ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n"),
        ("wrong content type", _raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    f"Content-Type: text/plain\r\nContent-Length: {len(body)}"
                                    "\r\n\r\n", body)),
        ("unknown route", _raw("GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("wrong method", _raw("DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")),
    ]


@functools.cache
def _zeros_gz() -> bytes:
    return gzip.compress(b"\x00" * (16 << 20))


WS_FRAMES: list[tuple[str, str | bytes]] = [
    ("not JSON", "{not json"), ("binary frame", b"\x00\x01\x02"), ("JSON array", "[1, 2]"),
    ("unknown type", '{"type": "dance", "id": 1}'), ("chat without id", '{"type": "chat"}'),
    ("chat id a float", '{"type": "chat", "id": 1.5, "messages": []}'),
    ("chat no messages", '{"type": "chat", "id": 1, "messages": []}'),
    ("chat bad temperature", '{"type": "chat", "id": 1, "messages": [{"role": "user", '
     '"content": "x"}], "temperature": -1}'),
    ("chat over context", '{"type": "chat", "id": 1, "messages": [{"role": "user", '
     '"content": "x"}], "max_tokens": 100000000}'),
    ("cancel unknown id", '{"type": "cancel", "id": "nope"}'),
    ("cancel without id", '{"type": "cancel"}'),
]


async def run_fuzz(base_url: str, max_body: int) -> tuple[int, list[str]]:
    """Every hostile request gets a 4xx JSON (websocket: an `error`); the server lives on."""
    failures: list[str] = []
    cases = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for name, route, body in _json_cases(max_body):
            cases += 1
            async with http.post(base_url + route, json=body) as resp:
                failures += _check_error(name, resp.status, resp.content_type, await resp.read())
        for name, raw in _raw_cases():
            cases += 1
            status, content_type, payload = await raw_exchange(base_url, raw)
            failures += _check_error(name, status, content_type, payload)
        cases += len(WS_FRAMES) + 2
        failures += await _fuzz_websocket(http, base_url, max_body)
        async with http.get(base_url + "/health") as resp:
            if resp.status != 200:
                failures.append(f"server not live after the fuzz run: /health {resp.status}")
    return cases, failures


def _check_error(name: str, status: int, content_type: str, payload: bytes) -> list[str]:
    if not 400 <= status < 500:
        return [f"{name}: HTTP {status} {payload[:200]!r}"]
    try:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return [f"{name}: HTTP {status} without the OpenAI error JSON: {payload[:200]!r}"]
    if not content_type.startswith("application/json"):
        return [f"{name}: content type {content_type}"]
    return []


async def raw_exchange(base_url: str, data: bytes) -> tuple[int, str, bytes]:
    """Send raw bytes on a new connection; (status, content type, body) of the reply."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))),
                                      120)
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
        return 0, "", f"no reply: {type(exc).__name__}".encode()
    finally:
        writer.close()
    return int(lines[0].split()[1]), headers.get("content-type", ""), body


async def _fuzz_websocket(http: aiohttp.ClientSession, base_url: str, max_body: int) -> list[str]:
    failures: list[str] = []
    async with http.ws_connect(base_url + "/v1/chat/ws") as ws:
        for name, frame in WS_FRAMES:
            await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            msg = await ws.receive_json(timeout=120)
            if msg.get("type") != "error" or not msg.get("error", {}).get("message"):
                failures.append(f"ws {name}: {msg}")
        await ws.send_json({"type": "chat", "id": "dup", "messages": [
            {"role": "user", "content": "x"}], "max_tokens": 64, "ignore_eos": True})
        await ws.send_json({"type": "chat", "id": "dup", "messages": [
            {"role": "user", "content": "y"}], "max_tokens": 4})
        ends = [m for m in await _ws_until_end(ws, "dup", 2) if m["type"] != "delta"]
        if [m.get("error", {}).get("code") for m in ends if m["type"] == "error"] != ["duplicate_id"]:
            failures.append(f"ws duplicate id: {ends}")
    async with http.ws_connect(base_url + "/v1/chat/ws") as ws:
        await ws.send_str("x" * (max_body + 1))
        msg = await ws.receive(timeout=120)
        closing = await ws.receive(timeout=120)
        if msg.type != aiohttp.WSMsgType.TEXT or closing.data != 1009:
            failures.append(f"ws oversized frame: {msg.type} {msg.data!r:.100}, then "
                            f"{closing.type} {closing.data}")
    return failures


async def _ws_until_end(ws: aiohttp.ClientWebSocketResponse, chat_id: str,
                        num_ends: int) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    while sum(m["type"] != "delta" for m in seen) < num_ends:
        msg = await ws.receive_json(timeout=600)
        if msg.get("id") == chat_id:
            seen.append(msg)
    return seen


# ---------------------------------------------------------------- report


def outcome_counts(metrics_text: str) -> dict[str, float]:
    """tf_requests_total summed by outcome, from /metrics text."""
    counts: dict[str, float] = {}
    for match in re.finditer(r'^tf_requests_total\{endpoint="[^"]*",outcome="([^"]*)"\} (\S+)$',
                             metrics_text, re.MULTILINE):
        counts[match.group(1)] = counts.get(match.group(1), 0.0) + float(match.group(2))
    return counts


def report_rows(label: str, report: SoakReport, outcomes: dict[str, float], preemptions: float,
                rss_mb: tuple[float, float]) -> str:
    idle = report.idle
    return (f"| {label} | {report.requests} | {report.finished} | {report.abandoned} | "
            f"{int(outcomes.get('cancelled', 0))} | {report.compared} | {len(report.mismatches)} | "
            f"{len(report.server_errors)} | {len(report.protocol_errors)} | {int(preemptions)} | "
            f"{idle.get('lanes_in_use')}/{idle.get('pages_in_use')}/{idle.get('queued')} | "
            f"{report.fuzz_cases - len(report.fuzz_failures)}/{report.fuzz_cases} | "
            f"{rss_mb[0]:.0f} -> {rss_mb[1]:.0f} |")


HEADER = ("| run | requests | finished | abandoned | cancelled (metrics) | compared with solo | "
          "mismatches | 5xx / failed | ws end errors | preemptions | idle lanes/pages/queue | "
          "fuzz 4xx JSON | server RSS MB before -> after |\n|" + "---|" * 13)


# ---------------------------------------------------------------- main (server subprocess)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _soak_server(args: argparse.Namespace, drafter: str | None) -> str:
    port = _free_port()
    cmd = [sys.executable, "-m", "tf_async.cli", "serve", "--port", str(port), "--device", "cpu",
           "--parallel", str(args.parallel), "--ctx", str(args.ctx), "--kv-pages",
           str(args.kv_pages), "--step-tokens", str(args.step_tokens),
           "--max-body-bytes", str(args.max_body), "--log-level", "warning"]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--drafter", drafter] if drafter else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        while "serving" not in proc.stdout.readline():  # "tf-async: serving ..." once ready
            if proc.poll() is not None:
                raise SystemExit("the server did not start")
        url = f"http://127.0.0.1:{port}"
        rss_before = _rss_mb(proc.pid)
        plan = make_plan(args.requests, random.Random(args.seed), abandon_fraction=args.abandon,
                         max_tokens=args.max_tokens, long_prompt_words=args.long_prompt_words)
        started = time.perf_counter()
        report = await run_soak(url, plan, args.concurrency)
        soak_s = time.perf_counter() - started
        report.fuzz_cases, report.fuzz_failures = await run_fuzz(url, args.max_body)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            metrics = await resp.text()
        report.idle = await _idle_after(url)
        preempt = re.search(r"^tf_preemptions_total (\S+)$", metrics, re.MULTILINE)
        label = f"{drafter or 'plain'} ({soak_s:.0f} s)"
        row = report_rows(label, report, outcome_counts(metrics),
                          float(preempt.group(1)) if preempt else 0.0,
                          (rss_before, _rss_mb(proc.pid)))
        for problem in report.mismatches + report.server_errors + report.protocol_errors \
                + report.fuzz_failures:
            print("  !", problem, file=sys.stderr)
        return row
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def _idle_after(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        return await wait_idle(http, url)


async def _main(args: argparse.Namespace) -> None:
    rows = [await _soak_server(args, drafter) for drafter in (None, "ngram")]
    print(HEADER)
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--abandon", type=float, default=0.3, help="fraction abandoned")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--long-prompt-words", type=int, default=250)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--kv-pages", type=int, default=32, help="small: forces preemption")
    parser.add_argument("--step-tokens", type=int, default=64)
    parser.add_argument("--max-body", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
