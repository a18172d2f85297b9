"""The terminal chat behind `tf-async chat`: a websocket client (or an in-process engine),
a multi-turn session, and the prompt loop.

The websocket client reads its socket all the time (a background task), so the server's
heartbeat pings are answered while the person sits at the prompt, and it reconnects when the
server dropped the socket. While a reply streams, keys typed on a terminal are not echoed
into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TextIO

import aiohttp

from ..errors import BadInputError, QueueFullError

QUIT_WORDS = ("/quit", "/exit")


class ChatError(RuntimeError):
    """The server refused or failed a chat, or the connection was lost (the message says)."""


class _LostBeforeStart(Exception):
    """The socket closed before the chat's first piece: safe to send the chat again."""


class WsChatClient:
    """Chats over /v1/chat/ws; one reply at a time, cancel by id."""

    def __init__(self, url: str, api_key: str | None = None):
        self.base_url = url.rstrip("/")
        self.url = self.base_url.replace("http", "ws", 1) + "/v1/chat/ws"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.num_connects = 0
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._replies: dict[int, asyncio.Queue[dict[str, Any] | None]] = {}
        self._next_id = 0

    async def __aenter__(self) -> WsChatClient:
        self._session = aiohttp.ClientSession(headers=self.headers)
        try:
            await self._connect()
        except BaseException:
            await self._session.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def model_name(self) -> str:
        """The served model's name (GET /v1/models)."""
        assert self._session is not None
        async with self._session.get(self.base_url + "/v1/models") as resp:
            return str((await resp.json())["data"][0]["id"])

    async def _connect(self) -> None:
        assert self._session is not None
        self._ws = await self._session.ws_connect(self.url)
        self.num_connects += 1
        self._reader = asyncio.create_task(self._read(self._ws))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Route each message to its chat. Reading is also what answers the server's pings."""
        try:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    data = json.loads(msg.data)
                    queue = self._replies.get(data.get("id"))
                    if queue is not None:
                        queue.put_nowait(data)
        finally:
            for queue in self._replies.values():
                queue.put_nowait(None)  # the connection is gone

    async def reply(self, messages: list[dict[str, str]], **params: Any) -> AsyncIterator[str]:
        """Yield the reply's text pieces; cancelling the consumer sends a cancel message.
        A socket the server dropped (restart, idle proxy) is opened again, and a chat lost
        before its first piece is sent again once."""
        for attempt in range(2):
            self._next_id += 1
            chat_id = self._next_id
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            self._replies[chat_id] = queue
            try:
                await self._send_chat(chat_id, messages, params)
                pieces = self._pieces(chat_id, queue, resend_ok=attempt == 0)
                async with contextlib.aclosing(pieces):  # a consumer that stops cancels
                    async for piece in pieces:
                        yield piece
                return
            except _LostBeforeStart:
                continue
            finally:
                self._replies.pop(chat_id, None)

    async def _send_chat(self, chat_id: int, messages: list[dict[str, str]],
                         params: dict[str, Any]) -> None:
        if self._ws is None or self._ws.closed:
            await self._connect()
        assert self._ws is not None
        try:
            await self._ws.send_json({"type": "chat", "id": chat_id, "messages": messages,
                                      **params})
        except ConnectionError:
            self._replies[chat_id].put_nowait(None)  # the socket was closing: lost

    async def _pieces(self, chat_id: int, queue: asyncio.Queue[dict[str, Any] | None],
                      resend_ok: bool) -> AsyncGenerator[str, None]:
        started = False
        try:
            while (msg := await queue.get()) is not None:
                if msg["type"] == "delta":
                    started = True
                    yield msg["text"]
                elif msg["type"] == "error":
                    raise ChatError(msg["error"]["message"])
                else:
                    return
            if resend_ok and not started:
                raise _LostBeforeStart
            raise ChatError("the connection to the server was lost; ask again to reconnect")
        except (asyncio.CancelledError, GeneratorExit):
            await self._cancel(chat_id, queue)
            raise

    async def _cancel(self, chat_id: int, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        """Tell the server to stop, then wait for its `done` so the socket stays in step."""
        if self._ws is None or self._ws.closed:
            return
        with contextlib.suppress(ConnectionError):
            await self._ws.send_json({"type": "cancel", "id": chat_id})
            while (msg := await queue.get()) is not None:
                if msg["type"] in ("done", "error"):
                    return


class InProcessChatClient:
    """The same `reply` on an Engine in this process."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def model_name(self) -> str:
        return str(self.engine.model_name)

    async def reply(self, messages: list[dict[str, str]], **params: Any) -> AsyncIterator[str]:
        async with self.engine.chat(messages, **params) as deltas:
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


async def chat_loop(session: ChatSession, where: str, stdin: TextIO = sys.stdin,
                    stdout: TextIO = sys.stdout) -> None:
    """Prompt, ask, print, until /quit, EOF or Ctrl-C at the prompt (Ctrl-C in a reply stops it)."""
    model = await session.client.model_name()
    stdout.write(f"tf-async chat: {model} at {where}\n"
                 f"Enter sends; Ctrl-C stops a reply; /quit, Ctrl-D or Ctrl-C at the prompt quits.\n")
    loop = asyncio.get_running_loop()
    current: dict[str, asyncio.Future[Any]] = {}
    loop.add_signal_handler(signal.SIGINT, lambda: [t.cancel() for t in current.values()])
    lines = await StdinLines.open(stdin)
    try:
        while (line := await _prompt(lines, stdout, current)) is not None:
            if line.strip() in QUIT_WORDS:
                return
            if line.strip():
                await _reply(session, line.strip(), stdin, stdout, current)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        lines.close()


async def _prompt(lines: StdinLines, stdout: TextIO,
                  current: dict[str, asyncio.Future[Any]]) -> str | None:
    """The next line, or None on EOF / Ctrl-C. A line finished while a reply streamed was not
    echoed by the terminal: it is shown after the prompt."""
    stdout.write("> ")
    stdout.flush()
    typed_ahead = lines.ready()
    current["read"] = asyncio.ensure_future(lines.next())
    try:
        line = await current["read"]
    except asyncio.CancelledError:
        return None
    finally:
        del current["read"]
    if typed_ahead and line:
        stdout.write(line if line.endswith("\n") else line + "\n")
    return line or None


async def _reply(session: ChatSession, text: str, stdin: TextIO, stdout: TextIO,
                 current: dict[str, asyncio.Future[Any]]) -> None:
    current["reply"] = asyncio.ensure_future(session.ask(text, stdout))
    with QuietTyping(stdin):
        try:
            await current["reply"]
        except asyncio.CancelledError:
            pass  # Ctrl-C stops this reply only
        except (ChatError, BadInputError, QueueFullError) as exc:
            print(f"error: {exc}", file=sys.stderr)
        finally:
            del current["reply"]


class QuietTyping:
    """While a reply streams, a terminal does not echo keys into it; an unfinished line typed
    meanwhile is dropped when the reply ends (a finished one is the next question)."""

    def __init__(self, stream: TextIO):
        self.fd: int | None = None
        self.saved: list[Any] = []
        with contextlib.suppress(io.UnsupportedOperation, ValueError, OSError):
            if stream.isatty():
                self.fd = stream.fileno()

    def __enter__(self) -> QuietTyping:
        if self.fd is not None:
            import termios

            self.saved = termios.tcgetattr(self.fd)
            quiet = list(self.saved)
            quiet[3] &= ~termios.ECHO  # lflag
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSAFLUSH, self.saved)  # echo back, drop input


class StdinLines:
    """Lines of stdin read in the background (a pipe or tty through the loop, else a thread)."""

    def __init__(self, read_line: Callable[[], Awaitable[str]], transport: Any = None):
        self._read_line = read_line
        self._transport = transport
        self._lines: asyncio.Queue[str] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump())

    @classmethod
    async def open(cls, stdin: TextIO) -> StdinLines:
        loop = asyncio.get_running_loop()
        stream = asyncio.StreamReader()
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(stream), stdin)
        except (ValueError, OSError, io.UnsupportedOperation):
            return cls(lambda: asyncio.to_thread(stdin.readline))

        async def read_line() -> str:
            return (await stream.readline()).decode(errors="replace")

        return cls(read_line, transport)

    async def _pump(self) -> None:
        while True:
            line = await self._read_line()
            self._lines.put_nowait(line)
            if not line:
                return  # EOF

    def ready(self) -> bool:
        """A line is already waiting (typed ahead)."""
        return not self._lines.empty()

    async def next(self) -> str:
        return await self._lines.get()

    def close(self) -> None:
        self._task.cancel()
        if self._transport is not None:
            self._transport.close()
