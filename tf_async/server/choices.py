"""The choices of one request (n per prompt, one or more prompts) as engine streams.

Each choice is its own engine stream (its own lane and seed; see SamplingParams.for_choice),
so a choice's tokens never depend on its siblings. `ChoiceStreams` pulls the first delta of
every choice before anything is sent (bad input and a full queue still become a 400 / 429),
then merges the rest in arrival order; closing it cancels every choice still running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from ..api_types import Completion, Delta, Usage

ChoiceDelta = tuple[int, Delta]  # (choice index, delta)


class DeltaStream(Protocol):
    """What Engine.stream / Engine.chat return: deltas, and aclose() to cancel."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...
    async def __anext__(self) -> Delta: ...
    async def aclose(self) -> None: ...


class ChoiceStreams:
    """The engine streams of a request's choices, index i = prompt * n + choice."""

    def __init__(self, streams: list[DeltaStream], num_per_prompt: int):
        self.streams = streams
        self.num_per_prompt = num_per_prompt
        self._tasks: list[asyncio.Task[None]] = []

    async def firsts(self) -> list[Delta]:
        """The first delta of each choice, in index order (errors raised, all closed). All
        choices are submitted at once, so their prompts share rounds."""
        tasks = [asyncio.ensure_future(anext(stream)) for stream in self.streams]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one reader per stream: stop these before aclose() reads
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.aclose()
            raise

    async def rest(self, firsts: list[Delta]) -> AsyncIterator[ChoiceDelta]:
        """The deltas after `firsts`, as they arrive; a choice's own deltas stay in order."""
        open_ids = [i for i, delta in enumerate(firsts) if delta.finish_reason is None]
        if len(open_ids) == 1:  # no merging needed
            async for delta in self.streams[open_ids[0]]:
                yield open_ids[0], delta
            return
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, queue)) for i in open_ids]
        remaining = len(open_ids)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def _pump(self, index: int,
                    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]]) -> None:
        try:
            async for delta in self.streams[index]:
                queue.put_nowait((index, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self.streams:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def collect(self) -> list[Completion]:
        """Every choice to its end (non-streaming requests), in index order."""
        try:
            firsts = await self.firsts()
            parts: list[list[Delta]] = [[delta] for delta in firsts]
            async for index, delta in self.rest(firsts):
                parts[index].append(delta)
        finally:
            await self.aclose()
        return [_completion(deltas) for deltas in parts]

    def total_usage(self, last_usages: list[Usage | None]) -> Usage:
        """One usage for the request: each prompt counted once, every choice's tokens."""
        total = Usage()
        for index, usage in enumerate(last_usages):
            if usage is None:
                continue
            if index % self.num_per_prompt == 0:
                total.prompt_tokens += usage.prompt_tokens
                total.cached_tokens += usage.cached_tokens
            total.completion_tokens += usage.completion_tokens
            total.drafted_tokens += usage.drafted_tokens
            total.accepted_tokens += usage.accepted_tokens
        return total


def _completion(deltas: list[Delta]) -> Completion:
    last = deltas[-1]
    logprobs = [entry for delta in deltas for entry in delta.logprobs or ()]
    return Completion("".join(delta.text for delta in deltas),
                      [tok for delta in deltas for tok in delta.token_ids],
                      last.finish_reason or "stop",
                      logprobs if any(delta.logprobs is not None for delta in deltas) else None,
                      last.usage or Usage(completion_tokens=sum(len(d.token_ids) for d in deltas)))
