"""A small stand-in for tf_async.Engine with the same interface, for server tests that need
control the real engine does not give: a pace per round (slow-reader tests) and an
injected failure. Text is deterministic: a function of the prompt ids and the position.

Lanes, a bounded queue and page counts are modelled so /metrics and /v1/lanes have real
numbers; one asyncio task runs rounds, pushing deltas into per-request queues.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tf_async.api_types import Completion, Delta, SamplingParams, Usage
from tf_async.errors import BadInputError, QueueFullError, RequestFailedError

PAGE_SIZE = 16
WORDS = ("alpha ", "beta ", "gamma ", "delta ", "eps ", "zeta ", "eta ", "theta ")
EOS_ID = 300


class FakeTokenizer:
    """Bytes are tokens 0-255; ids 256+8k+w are the words above; 300 is EOS."""

    eos_token_ids = (EOS_ID,)
    vocab_size = 320
    add_bos = False
    chat_template: str | None = None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for tok in ids:
            if tok < 256:
                out.append(tok)
            elif tok < 256 + len(WORDS):
                out += WORDS[tok - 256].encode()
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...]
    queue: asyncio.Queue[Delta | Exception] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    lane: int = -1
    ignore_eos: bool = False


def next_token(prompt_ids: list[int], seed: int, pos: int) -> int:
    word = zlib.crc32(bytes(prompt_ids[-16:]) + seed.to_bytes(8, "little", signed=True)
                      + pos.to_bytes(4, "little")) % (len(WORDS) + 1)
    return EOS_ID if word == len(WORDS) and pos >= 3 else 256 + word % len(WORDS)


class FakeStream:
    def __init__(self, engine: FakeEngine, prompt_ids: list[int], params: SamplingParams):
        self._engine, self._prompt_ids, self._params = engine, prompt_ids, params
        self._request: _Request | None = None
        self._done = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        if self._request is None:
            self._request = self._engine._submit(self._prompt_ids, self._params)
        try:
            item = await self._request.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, Exception):
            self._done = True
            raise item
        self._done = item.finish_reason is not None
        return item

    async def aclose(self) -> None:
        if not self._done and self._request is not None:
            self._request.cancelled = True
        self._done = True


class FakeEngine:
    """Same public interface as tf_async.Engine; `round_delay_s` paces the rounds."""

    def __init__(self, model: str | None = None, *, parallel: int = 4, ctx: int = 512,
                 max_queue: int = 16, round_delay_s: float = 0.0, **_: Any):
        self.model_name = "fake-model"
        self.ctx = ctx
        self.tokenizer = FakeTokenizer()
        self.parallel, self.max_queue, self.round_delay_s = parallel, max_queue, round_delay_s
        self.fail_prompts: set[str] = set()  # prompts whose request fails in a step
        self._lanes: list[_Request | None] = [None] * parallel
        self._waiting: deque[_Request] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> FakeEngine:
        self._task = asyncio.create_task(self._run())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> FakeEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               **kwargs: Any) -> FakeStream:
        return FakeStream(self, self.prompt_ids(prompt), params or SamplingParams.of(**kwargs))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             **kwargs: Any) -> FakeStream:
        return self.stream(self.chat_ids(messages), params, **kwargs)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def chat_ids(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        """Tools and template variables are ignored: the fake template knows none."""
        if not messages:
            raise BadInputError("messages must not be empty", param="messages")
        return self.tokenizer.encode_chat(messages)

    async def complete(self, prompt: str | list[int], **kwargs: Any) -> Completion:
        return await _collect(self.stream(prompt, **kwargs))

    async def chat_complete(self, messages: list[dict[str, Any]], **kwargs: Any) -> Completion:
        return await _collect(self.chat(messages, **kwargs))

    def stats(self) -> dict[str, int]:
        running = [r for r in self._lanes if r is not None]
        pages = sum(-(-(len(r.prompt_ids) + len(r.generated)) // PAGE_SIZE) for r in running)
        return {"lanes_in_use": len(running), "lanes_total": self.parallel, "pages_in_use": pages,
                "pages_total": self.parallel * self.ctx // PAGE_SIZE,
                "queued": len(self._waiting), "running": len(running)}

    def lanes(self) -> list[dict[str, Any]]:
        return [{"lane": i, "state": "free" if r is None else "decode",
                 "pages": 0 if r is None else -(-(len(r.prompt_ids) + len(r.generated)) // PAGE_SIZE),
                 "tokens": 0 if r is None else len(r.prompt_ids) + len(r.generated)}
                for i, r in enumerate(self._lanes)]

    def _submit(self, prompt_ids: list[int], params: SamplingParams) -> _Request:
        max_tokens = params.max_tokens
        if not prompt_ids:
            raise BadInputError("prompt must not be empty", param="prompt")
        if len(prompt_ids) + max_tokens > self.ctx:
            raise BadInputError("prompt + max_tokens exceeds the context", param="max_tokens")
        if len(self._waiting) >= self.max_queue:
            raise QueueFullError("queue full")
        request = _Request(prompt_ids, max_tokens, params.seed or 0, params.stop_token_ids,
                           ignore_eos=params.ignore_eos)
        self._waiting.append(request)
        self._wake.set()
        return request

    async def _run(self) -> None:
        while True:
            self._admit()
            if not any(self._lanes):
                self._wake.clear()
                await self._wake.wait()
                continue
            self._step()
            await asyncio.sleep(self.round_delay_s)

    def _admit(self) -> None:
        for lane, held in enumerate(self._lanes):
            while held is None and self._waiting:
                request = self._waiting.popleft()
                if not request.cancelled:
                    request.lane, self._lanes[lane], held = lane, request, request

    def _step(self) -> None:
        for lane, request in enumerate(self._lanes):
            if request is None:
                continue
            if request.cancelled:
                self._lanes[lane] = None
            elif self.tokenizer.decode(request.prompt_ids) in self.fail_prompts:
                request.queue.put_nowait(RequestFailedError("injected failure"))
                self._lanes[lane] = None
            else:
                self._emit(lane, request)

    def _emit(self, lane: int, request: _Request) -> None:
        tok = next_token(request.prompt_ids, request.seed, len(request.generated))
        request.generated.append(tok)
        finish = None
        if (tok == EOS_ID and not request.ignore_eos) or tok in request.stop_token_ids:
            finish = "stop"
        elif len(request.generated) >= request.max_tokens:
            finish = "length"
        text = "" if finish == "stop" else self.tokenizer.decode([tok])
        usage = Usage(len(request.prompt_ids), len(request.generated)) if finish else None
        request.queue.put_nowait(Delta(text, [tok], finish, None, usage))
        if finish:
            self._lanes[lane] = None


async def _collect(stream: FakeStream) -> Completion:
    texts: list[str] = []
    ids: list[int] = []
    last: Delta | None = None
    async for delta in stream:
        texts.append(delta.text)
        ids.extend(delta.token_ids)
        last = delta
    assert last is not None and last.finish_reason is not None
    return Completion("".join(texts), ids, last.finish_reason, None, last.usage or Usage())
