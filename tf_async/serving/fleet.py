"""The replicas behind the front: their processes, the routing policy, and the HTTP client
that talks to them (the project's own OpenAI API, over loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp

from .policy import RoutingPolicy
from .supervisor import ReplicaProcess, ReplicaSpec

log = logging.getLogger("tf_async.serving")
POLL_INTERVAL_S = 0.5  # how often each replica's /v1/lanes stats are read
CONNECT_TIMEOUT_S = 5.0


class ReplicaSetError(Exception):
    """A replica could not start at all (bad model, bad flag): nothing to serve."""


class ReplicaSet:
    """N replica processes, their load, and upstream requests to them."""

    def __init__(self, specs: list[ReplicaSpec], policy: RoutingPolicy,
                 api_key: str | None = None):
        self.policy = policy
        self.api_key = api_key
        self.replicas = [ReplicaProcess(spec, self._on_up, self._on_down) for spec in specs]
        self.num_routed = [0] * len(specs)
        self.num_lost_streams = [0] * len(specs)  # requests ended by their replica failing
        self.num_no_replica = 0
        self._open: list[set[aiohttp.ClientResponse]] = [set() for _ in specs]
        self._start_failed = asyncio.Event()
        self._all_ready = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "start() first"
        return self._http

    def open_http(self) -> None:
        """The client session to the replicas (start() opens it; tests with fake replicas
        open it alone)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        # No pooled keep-alive: a cancelled stream's connection must close, not be reused.
        self._http = aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                           connector=aiohttp.TCPConnector(force_close=True))

    async def start(self) -> None:
        self.open_http()
        for replica in self.replicas:
            replica.start()
        self._poller = asyncio.create_task(self._poll_forever())

    async def wait_all_ready(self) -> None:
        """Return once every replica has served once; ReplicaSetError if one failed first."""
        waits = [asyncio.ensure_future(event.wait())
                 for event in (self._all_ready, self._start_failed)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if self._start_failed.is_set():
            raise ReplicaSetError("a replica exited before it was ready (see its output above)")

    def _on_up(self, index: int) -> None:
        log.info("replica %d ready at %s", index, self.replicas[index].url)
        self.policy.mark_up(index)
        if all(r.ever_ready.is_set() for r in self.replicas):
            self._all_ready.set()

    def _on_down(self, index: int) -> None:
        """Process exit: out of routing now, and its open upstream responses closed so
        their readers end with an error at once (never a hang)."""
        self.policy.mark_down(index)
        for resp in list(self._open[index]):
            resp.close()
        if not self.replicas[index].ever_ready.is_set():
            self._start_failed.set()

    def connect_failed(self, index: int) -> None:
        """A refused connection takes the replica out of routing until a poll succeeds."""
        self.policy.mark_down(index)

    # ------------------------------------------------------------ polling

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(r) for r in self.replicas))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll(self, replica: ReplicaProcess) -> None:
        url = replica.url
        if url is None:
            return
        try:
            stats = (await self.get_json(url + "/v1/lanes"))["stats"]
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError):
            if replica.url == url:
                self.connect_failed(replica.index)
            return
        if replica.url != url:  # it went down while the poll was out
            return
        busy = int(stats.get("lanes_in_use", 0))
        self.policy.update_stats(replica.index, busy, int(stats.get("lanes_total", 0)) - busy,
                                 int(stats.get("queued", 0)))
        self.policy.mark_up(replica.index)

    async def get_json(self, url: str) -> Any:
        async with self.http.get(url, headers=self.auth_headers(),
                                 timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def get_text(self, url: str) -> str:
        async with self.http.get(url, headers=self.auth_headers(),
                                 timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as resp:
            resp.raise_for_status()
            return await resp.text()

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ------------------------------------------------------------ upstream requests

    def track(self, index: int, resp: aiohttp.ClientResponse) -> None:
        self._open[index].add(resp)

    def untrack(self, index: int, resp: aiohttp.ClientResponse) -> None:
        self._open[index].discard(resp)

    def up_urls(self) -> list[tuple[int, str]]:
        return [(r.index, r.url) for r in self.replicas
                if r.url is not None and self.policy.replicas[r.index].up]

    async def stop(self, timeout_s: float) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*(r.stop(timeout_s) for r in self.replicas))
        if self._http is not None:
            await self._http.close()

    def signal_all(self, sig: int) -> None:
        for replica in self.replicas:
            replica.signal(sig)
