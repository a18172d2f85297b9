"""Replica processes: start, watch, restart with backoff, stop.

Each replica is a full `tf-async serve` child on a loopback port it picks itself (`--port
0`; the port is read from its "serving" line). Its exit is watched: the replica leaves
routing at once (`on_down`), and it is started again after a backoff; it rejoins routing
(`on_up`) once its /health answers. The children die with the front (PR_SET_PDEATHSIG on
Linux) even when the front itself is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("tf_async.serving")

# What a child runs (tests prefix it with a throttle, as test_serve_shutdown does).
CHILD_CODE = ("import sys; from tf_async.serving.supervisor import die_with_front; "
              "die_with_front(); from tf_async.cli import main; sys.exit(main(sys.argv[1:]))")
SERVING_LINE = "tf-async: serving "
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # restart delays after consecutive failures
HEALTH_TIMEOUT_S = 60.0


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    """How to start replica `index`: its `tf-async serve` flags and its environment."""

    index: int
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


def replica_env(index: int, num_replicas: int, device: str, num_cores: int,
                gpus_per_replica: int = 1) -> tuple[tuple[str, str], ...]:
    """On CUDA, replica i gets GPUs i*g .. i*g+g-1 (g: its --tensor-parallel size); on the
    CPU each child gets its share of the cores."""
    env = [("NUMBA_NUM_THREADS", str(max(1, num_cores // num_replicas)))]
    if device == "cuda":
        gpus = range(index * gpus_per_replica, (index + 1) * gpus_per_replica)
        env.append(("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpus))))
    return tuple(env)


def die_with_front() -> None:
    """Called first in a replica: SIGTERM when the front goes away (Linux
    PR_SET_PDEATHSIG; set here rather than in a preexec_fn, which is not thread-safe)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class ReplicaProcess:
    """One child `tf-async serve`, restarted when it dies until `stop()`."""

    def __init__(self, spec: ReplicaSpec, on_up: Callable[[int], None],
                 on_down: Callable[[int], None]):
        self.spec = spec
        self.index = spec.index
        self.url: str | None = None  # http://127.0.0.1:PORT while it serves
        self.model_name = ""
        self.num_starts = 0
        self.num_failures = 0  # exits not asked for
        self.ever_ready = asyncio.Event()
        self.proc: asyncio.subprocess.Process | None = None
        self._on_up = on_up
        self._on_down = on_down
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_running())

    async def _keep_running(self) -> None:
        consecutive = 0
        while not self._stopping:
            ready = await self._run_once()
            if self._stopping:
                return
            self.num_failures += 1
            consecutive = 0 if ready else consecutive + 1
            delay_s = BACKOFF_S[min(consecutive, len(BACKOFF_S) - 1)]
            log.warning("replica %d exited (code %s); restarting in %g s", self.index,
                        self.proc.returncode if self.proc else None, delay_s)
            await asyncio.sleep(delay_s)

    async def _run_once(self) -> bool:
        """Run the child until it exits; True when it became ready meanwhile."""
        self.num_starts += 1
        env = {**os.environ, **dict(self.spec.env)}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD_CODE, "serve", *self.spec.flags, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        ready = False
        try:
            ready = await self._follow_output(self.proc)
        finally:
            self.url = None
            self._on_down(self.index)
        await self.proc.wait()
        return ready

    async def _follow_output(self, proc: asyncio.subprocess.Process) -> bool:
        """Echo the child's lines; on its serving line, wait for /health and go up."""
        assert proc.stdout is not None
        ready = False
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            print(f"[replica {self.index}] {line}", file=sys.stderr, flush=True)
            if not ready and line.startswith(SERVING_LINE):
                self.model_name, url = _parse_serving_line(line)
                ready = await self._wait_healthy(url)
                if ready:
                    self.url = url
                    self.ever_ready.set()
                    self._on_up(self.index)
        return ready

    async def _wait_healthy(self, url: str) -> bool:
        async with aiohttp.ClientSession() as http:
            for _ in range(int(HEALTH_TIMEOUT_S / 0.1)):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            return True
                await asyncio.sleep(0.1)
        return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM (the child drains its streams), then SIGKILL after `timeout_s`."""
        self._stopping = True
        self.signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


def _parse_serving_line(line: str) -> tuple[str, str]:
    """`tf-async: serving NAME on http://HOST:PORT (...)` -> (NAME, http://HOST:PORT)."""
    rest = line[len(SERVING_LINE):]
    name, _, after = rest.rpartition(" on http://")
    return name, "http://" + after.split()[0]
