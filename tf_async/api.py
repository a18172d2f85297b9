"""The async Python API: `async with Engine(...) as engine:` then stream / complete / chat."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import sys
from typing import TYPE_CHECKING, Any

from .api_types import Completion, Delta, GrammarSpec, SamplingParams, Usage
from .engine.build import EngineParts, build_engine
from .engine.grammar import Grammars
from .engine.options import EngineOptions
from .engine.sched import make_sequence
from .engine.sequence import TokenEvent
from .engine.stops import StopStrings
from .errors import BadInputError, QueueFullError, RequestFailedError, ShuttingDownError
from .models.checkpoint import Checkpoint

if TYPE_CHECKING:
    from .models.tokenizer import Tokenizer  # a heavier module: loaded with a model

SWITCH_INTERVAL_S = 0.0005
# warm_up runs decode rounds of every row count up to this many (at most the lanes), so a GPU
# engine captures their CUDA graphs before it reports ready; rounds of more rows are captured
# when they first come (GraphDecoder.max_graphs bounds how many shapes are kept).
WARM_DECODE_ROWS = 16


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise BadInputError(message, param=param)


def check_context(num_prompt_tokens: int, max_tokens: int, ctx: int, *, max_tokens_sent: bool) -> None:
    """Prompt + max_tokens must fit the context: else a 400 with OpenAI's code
    `context_length_exceeded` (param `max_tokens` only when the caller chose max_tokens)."""
    total = num_prompt_tokens + max_tokens
    if total > ctx:
        raise BadInputError(
            f"This model's maximum context length is {ctx} tokens. However, you requested {total} "
            f"tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the completion). Please "
            f"reduce the length of the prompt or the completion.",
            param="max_tokens" if max_tokens_sent else None, code="context_length_exceeded")


class RequestStream:
    """Async iterator of Deltas for one request, and an async context manager.

    The request is submitted on the first `__anext__`. To stop early, leave an `async with`
    block or await `aclose()`: both cancel the request and return once the engine has
    released its lane and pages, so `engine.stats()` read right after shows them free::

        async with engine.stream(prompt) as deltas:
            async for delta in deltas:
                if done_enough(delta):
                    break  # the lane is free when the block ends

    A bare `async for ... break` (no `async with`, no `aclose()`) or a cancelled task
    reading the stream also cancels the request, but the lane is released in the
    engine's next round, after the loop has moved on.
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None):
        self._engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.cache_salt = cache_salt
        self.request_id = -1
        self._queue: asyncio.Queue[TokenEvent] | None = None
        self._done = False  # no more deltas for the caller
        self._engine_done = False  # the engine's last event was read: its lane is released
        self._cancel_sent = False
        self._detok = engine.tokenizer.stream()
        self._stops = StopStrings(params.stop)
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.eos_ids))
        self.num_generated = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        if self._queue is None:
            self.request_id, self._queue = self._engine._submit(self.prompt_ids, self.params,
                                                                self.cache_salt)
        try:
            event = await self._queue.get()
        except BaseException:
            self._cancel()  # the reader was cancelled: stop the request, do not wait here
            raise
        return self._delta(event)

    def _delta(self, event: TokenEvent) -> Delta:
        final = event.finish_reason is not None or event.error is not None
        self._engine_done = final
        if event.error is not None:
            self._done = True
            raise RequestFailedError(event.error)
        ids = list(event.token_ids)
        self.num_generated += len(ids)
        text_ids = ids[:-1] if event.finish_reason == "stop" and ids and ids[-1] in self._stop_ids else ids
        text = self._detok.push(text_ids) + (self._detok.flush() if final else "")
        text, hit = self._stops.feed(text, final=final)
        reason = "stop" if hit else event.finish_reason
        if reason is None:
            return Delta(text, ids, None, list(event.logprobs) if event.logprobs else None)
        self._done = True
        if not final:  # a stop string ended it before the engine did
            self._cancel()
        usage = Usage(len(self.prompt_ids), self.num_generated, event.drafted_tokens,
                      event.accepted_tokens, event.cached_tokens)
        return Delta(text, ids, reason, list(event.logprobs) if event.logprobs else None, usage)

    def _cancel(self) -> None:
        """Ask the engine to stop this request (acted on between rounds); returns at once."""
        if self.request_id >= 0 and not self._cancel_sent:
            self._cancel_sent = True
            self._engine._cancel(self.request_id)

    async def aclose(self) -> None:
        """Cancel the request and wait until the engine has released its lane and pages.
        A no-op on a stream that finished, was closed, or never started."""
        self._done = True
        if self._queue is None or self._engine_done:
            return
        self._cancel()
        try:
            if not self._engine.closed:
                await self._wait_for_last_event(self._queue)
        finally:
            self._engine_done = True

    async def _wait_for_last_event(self, queue: asyncio.Queue[TokenEvent]) -> None:
        # The engine publishes a request's last event after releasing its lane.
        while True:
            event = await queue.get()
            if event.finish_reason is not None or event.error is not None:
                return

    def __del__(self) -> None:
        if not self._engine_done and self._queue is not None:
            self._cancel()


class Engine:
    """tf_async's async Python API. `model=None` serves the default model."""

    def __init__(self, model: str | Checkpoint | None = None, *, device: str = "auto", parallel: int = 4,
                 ctx: int = 4096, kv_dtype: str = "f32", paging: bool = True,
                 kv_pages: int | None = None, step_tokens: int = 256, drafter: str | None = None,
                 draft_tokens: int = 4, page_size: int = 16, max_queue: int = 256,
                 cuda_graphs: bool = True, decode_steps: int = 1, prefix_cache: bool = True,
                 draft_ring: int | None = None, draft_areas: int | None = None,
                 ngram_min: int = 2, draft_backoff: int = 32, prefix_state_pages: int = 16,
                 prefix_state_slots: int | None = None, tensor_parallel: int = 1):
        """The keyword arguments are EngineOptions' (engine/options.py), checked here: a bad
        one raises BadInputError naming it. kv_pages and draft_areas default to the
        environment's TF_KV_PAGES and TF_DRAFT_AREAS when set."""
        self.options = EngineOptions(
            model=model, device=device, parallel=parallel, ctx=ctx, kv_dtype=kv_dtype, paging=paging,
            kv_pages=_env_int("TF_KV_PAGES") if kv_pages is None else kv_pages,
            step_tokens=step_tokens, drafter=drafter, draft_tokens=draft_tokens, page_size=page_size,
            cuda_graphs=cuda_graphs, decode_steps=decode_steps, prefix_cache=prefix_cache,
            draft_ring=draft_ring,
            draft_areas=_env_int("TF_DRAFT_AREAS") if draft_areas is None else draft_areas,
            ngram_min=ngram_min, draft_backoff=draft_backoff, prefix_state_pages=prefix_state_pages,
            prefix_state_slots=prefix_state_slots, tensor_parallel=tensor_parallel)
        self.max_queue = max_queue
        self.ctx = ctx
        self.parts: EngineParts | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[int, asyncio.Queue[TokenEvent]] = {}  # requests the engine holds
        self._ids = itertools.count(1)
        self._grammar_compiler: Grammars | None = None
        self.closed = False
        self._refusal: str | None = None  # set by refuse_new(): why new requests fail
        self._idle = asyncio.Event()  # set whenever the engine holds no request
        self._idle.set()

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> Engine:
        if self.parts is None:
            # The engine thread re-takes the GIL after every kernel; with the default 5 ms switch
            # interval it can wait that long behind a busy event loop, once per kernel.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._loop = asyncio.get_running_loop()
            self.parts = await asyncio.to_thread(build_engine, self.options, self._publish)
            self.parts.core.start()
        return self

    async def warm_up(self) -> None:
        """Take every path a request can reach once, so kernels compile (or load from Numba's
        disk cache) and CUDA graphs are captured now, not in the first user's request: a
        prompt longer than a step (stepped prefill) beside short ones (mixed rounds), greedy and
        seeded sampling with every filter, penalties and logprobs, a chat, a repetitive prompt
        (drafts to verify with an ngram drafter), and decode rounds of every row count up to the
        lanes' (WARM_DECODE_ROWS at most: each a CUDA graph on a GPU); on a backend whose
        kernels depend on the row count, a prompt round of each range of rows."""
        step_tokens = self.options.step_tokens
        num_long = max(2, min(step_tokens + 8, self.ctx // 2 - 8))
        pattern = self.tokenizer.encode("one two three one two three")
        long_ids = [pattern[i % len(pattern)] for i in range(num_long)]
        user = [{"role": "user", "content": "Say hello."}]
        tokens = max(1, min(6, self.ctx - num_long))
        sampled = dict(temperature=0.8, seed=1, top_k=8, top_p=0.9, min_p=0.01,
                       presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                       logprobs=2)
        await asyncio.gather(
            self.complete(long_ids, max_tokens=tokens, ignore_eos=True),
            self.chat_complete(user, max_tokens=tokens, ignore_eos=True, **sampled),
            self.complete(pattern * 4, max_tokens=tokens, ignore_eos=True, stop=["\n\n"]),
            # seeded top-k/top-p alone (no penalty, min_p or logprobs): a GPU samples these
            # where the logits are, with its own kernel
            self.complete(pattern, max_tokens=tokens, ignore_eos=True, temperature=0.8, seed=2,
                          top_k=8, top_p=0.9))
        await self._warm_decode_rows(pattern)
        if self._parts.ops.capabilities.kernels_by_rows:
            await self._warm_prompt_rows(long_ids)

    async def _warm_prompt_rows(self, ids: list[int]) -> None:
        """One prompt round alone for each row count 2**k and 2**k + 1 up to a step (a GPU
        compiles some kernels per range of rows: tile variants, few-rows paths, whose bounds
        are powers of two), each prompt salted so that no cached page shortens it."""
        limit = min(self.options.step_tokens, self.ctx - 2, len(ids))
        counts = sorted({n for k in range(limit.bit_length()) for n in (1 << k, (1 << k) + 1)
                         if 2 <= n <= limit})
        for n in counts:
            await self.complete(ids[:n], max_tokens=1, ignore_eos=True, cache_salt=f"warm-up {n}")

    async def _warm_decode_rows(self, prompt: list[int]) -> None:
        """Decode rounds of n rows for every n from min(lanes, WARM_DECODE_ROWS) down to 1:
        that many requests at once, each one token longer than the one before, so the round
        loses a row as each ends (on a GPU each shape's graph is captured here)."""
        count = min(self._parts.num_lanes, WARM_DECODE_ROWS)
        room = self.ctx - len(prompt) - 1
        if count < 2 or room < count + 1:
            return
        await asyncio.gather(*(self.complete(prompt, max_tokens=n + 2, ignore_eos=True)
                               for n in range(count)))

    async def close(self) -> None:
        if self.parts is not None and not self.closed:
            await asyncio.to_thread(self.parts.core.shutdown)
            self.closed = True

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._parts.checkpoint.tokenizer

    @property
    def model_name(self) -> str:
        return self._parts.model_name

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._parts.eos_ids

    @property
    def _parts(self) -> EngineParts:
        if self.parts is None:
            raise RuntimeError("Engine not started: use `async with Engine(...) as engine:`")
        return self.parts

    # ---- requests -----------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               cache_salt: str | None = None, **kwargs: Any) -> RequestStream:
        """Stream a completion of `prompt`: pass `params`, or the sampling keyword arguments
        (SamplingParams.of), not both. `cache_salt`: streams share cached prompt pages only
        with streams of the same salt."""
        return RequestStream(self, self.prompt_ids(prompt), self._params(params, kwargs),
                             _salt(cache_salt))

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             cache_salt: str | None = None, **kwargs: Any) -> RequestStream:
        return RequestStream(self, self.chat_ids(messages), self._params(params, kwargs),
                             _salt(cache_salt))

    def chat_ids(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids of a chat through the model's chat template; `tools` (OpenAI function
        tools) and `template_kwargs` (e.g. enable_thinking) reach the template."""
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        return list(self.tokenizer.encode_chat(messages, **extra))

    async def complete(self, prompt: str | list[int], **kwargs: Any) -> Completion:
        return await _collect(self.stream(prompt, **kwargs))

    async def chat_complete(self, messages: list[dict[str, Any]], **kwargs: Any) -> Completion:
        return await _collect(self.chat(messages, **kwargs))

    def stats(self) -> dict[str, object]:
        return dict(self._parts.core.snapshot)

    def lanes(self) -> list[dict[str, object]]:
        return list(self._parts.core.lane_snapshot)

    @property
    def num_requests(self) -> int:
        """Requests submitted to the engine whose last event has not come back yet."""
        return len(self._queues)

    def refuse_new(self, reason: str) -> None:
        """From now on, new requests fail with ShuttingDownError(reason); running ones go on."""
        self._refusal = reason

    async def wait_idle(self) -> None:
        """Return once the engine holds no request (every lane and page released)."""
        while self._queues:
            self._idle.clear()
            await self._idle.wait()

    async def cancel_all(self) -> None:
        """Cancel every request the engine holds; return once their lanes are released."""
        if self.parts is not None and not self.closed:
            for request_id in list(self._queues):
                self.parts.core.cancel(request_id)
            await self.wait_idle()

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The ids a completion of `prompt` starts from (text encoded, ids checked)."""
        if isinstance(prompt, str):
            _check(len(prompt) > 0, "prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=self.tokenizer.add_bos)
        _check(isinstance(prompt, list) and len(prompt) > 0, "prompt must be a non-empty string or list of token ids", "prompt")
        vocab = self._parts.vocab_size
        _check(all(isinstance(t, int) and 0 <= t < vocab for t in prompt),
               f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return list(prompt)

    @property
    def _grammars(self) -> Grammars:
        """The grammar compiler of this engine's tokenizer (made on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = Grammars(self.tokenizer)
        return self._grammar_compiler

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Raise BadInputError naming the problem when `spec` does not compile."""
        self._grammars.mask_for(spec)

    def _params(self, params: SamplingParams | None, kwargs: dict[str, Any]) -> SamplingParams:
        if params is None:
            return SamplingParams.of(**kwargs)
        _check(not kwargs, "pass either params or sampling keyword arguments, not both", "params")
        return params

    def _submit(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
                ) -> tuple[int, asyncio.Queue[TokenEvent]]:
        parts = self._parts
        if self._refusal is not None:
            raise ShuttingDownError(self._refusal)
        check_context(len(prompt_ids), params.max_tokens, self.ctx, max_tokens_sent=True)
        vocab = parts.vocab_size
        _check(all(t < vocab for t, _ in params.logit_bias), f"logit_bias token ids must be below {vocab}",
               "logit_bias")
        mask = self._grammars.mask_for(params.grammar) if params.grammar is not None else None
        if len(self._queues) >= parts.num_lanes + self.max_queue:
            raise QueueFullError(f"request queue is full ({self.max_queue} waiting)")
        request_id = next(self._ids)
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[request_id] = queue
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        parts.core.submit(make_sequence(request_id, prompt_ids, params, seed, parts.eos_ids,
                                        cache_salt, mask))
        return request_id, queue

    def _cancel(self, request_id: int) -> None:
        if request_id in self._queues and self.parts is not None:
            self.parts.core.cancel(request_id)

    def _publish(self, events: list[TokenEvent]) -> None:
        """Engine thread -> loop, one call per round."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, events)
            except RuntimeError:
                pass  # loop closed while shutting down

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            last = event.finish_reason is not None or event.error is not None
            queue = self._queues.pop(event.request_id, None) if last else self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
        if not self._queues:
            self._idle.set()


def _salt(cache_salt: object) -> str | None:
    _check(cache_salt is None or (isinstance(cache_salt, str) and 0 < len(cache_salt) <= 256),
           "cache_salt must be a non-empty string of at most 256 characters", "cache_salt")
    return cache_salt  # type: ignore[return-value]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


async def _collect(stream: RequestStream) -> Completion:
    texts: list[str] = []
    ids: list[int] = []
    logprobs: list[dict[int, float]] = []
    last: Delta | None = None
    async with stream:  # a cancelled caller returns once the lane is released
        async for delta in stream:
            texts.append(delta.text)
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs or [])
            last = delta
    assert last is not None and last.finish_reason is not None
    return Completion("".join(texts), ids, last.finish_reason,
                      logprobs if stream.params.logprobs is not None else None,
                      last.usage or Usage(len(stream.prompt_ids), len(ids)))
