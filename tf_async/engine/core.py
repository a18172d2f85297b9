"""The engine thread: drains the inbox between rounds, then schedule -> execute -> update.

The event loop never touches engine state: it sends plain messages in (add, cancel,
shutdown) and receives TokenEvents out through `publish`.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .runner import Runner
from .sched import Scheduler
from .sequence import Sequence, TokenEvent
from .threads import KERNEL_LOCK

log = logging.getLogger("tf_async.engine")


@dataclass(frozen=True, slots=True)
class Add:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner,
                 publish: Callable[[list[TokenEvent]], None]):
        self.scheduler = scheduler
        self.runner = runner
        self.publish = publish
        self.inbox: queue.SimpleQueue[Add | Cancel | Shutdown] = queue.SimpleQueue()
        self.snapshot: dict[str, object] = {}
        self.lane_snapshot: list[dict[str, object]] = []
        self.num_rounds = 0
        self._thread = threading.Thread(target=self._main, name="tf-async-engine", daemon=True)
        self._take_snapshot()

    def start(self) -> None:
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        self.inbox.put(Add(seq))

    def cancel(self, request_id: int) -> None:
        self.inbox.put(Cancel(request_id))

    def shutdown(self, timeout: float | None = None) -> None:
        self.inbox.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _main(self) -> None:
        running = True
        while running:
            running = self._drain_inbox(block=self.scheduler.is_idle)
            events = self.scheduler.sweep_cancelled()
            if running and not self.scheduler.is_idle:
                events += self._round()
            self._take_snapshot()
            if events:
                self.publish(events)
        self.publish(self._stop_all())
        self._take_snapshot()

    def _drain_inbox(self, *, block: bool) -> bool:
        """Apply every waiting message (cancel is acted on here, between rounds)."""
        msg = self.inbox.get() if block else None
        while True:
            if msg is not None:
                if isinstance(msg, Shutdown):
                    return False
                if isinstance(msg, Add):
                    self.scheduler.add(msg.seq)
                else:
                    self.scheduler.cancel(msg.request_id)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _round(self) -> list[TokenEvent]:
        try:
            with KERNEL_LOCK:
                plan = self.scheduler.schedule()
                if not plan.rows:
                    return []
                result = self.runner.execute(plan)
                self.num_rounds += 1
                return self.scheduler.update(plan, result)
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the engine thread
            log.error("engine round failed:\n%s", traceback.format_exc())
            return self._stop_all(error=f"internal error: {type(exc).__name__}: {exc}")

    def _stop_all(self, error: str | None = None) -> list[TokenEvent]:
        sched = self.scheduler
        seqs = [*sched.running, *sched.waiting]
        return [sched.finish(s, None if error else "cancelled", error=error) for s in seqs]

    def _take_snapshot(self) -> None:
        sched, lanes = self.scheduler, self.scheduler.lanes
        self.snapshot = {
            "lanes_in_use": lanes.num_in_use,
            "lanes_total": lanes.num_lanes,
            "pages_in_use": lanes.runs.num_pages_in_use,
            "pages_total": lanes.runs.num_pages_total,
            "queued": len(sched.waiting),
            "running": len(sched.running),
            "rounds": self.num_rounds,
            "preemptions": sched.num_preemptions,  # streams that gave their lane back (recompute)
            "draft_paused_rounds": sched.num_draft_pauses,  # decode rows that skipped drafting
            **self.runner.memory_stats(),
            **sched.drafter_stats(),
            **sched.prefix_cache_stats(),
        }
        by_lane = {s.lane: s for s in sched.running if s.lane is not None}
        self.lane_snapshot = [self._lane_info(lane, by_lane.get(lane)) for lane in range(lanes.num_lanes)]

    def _lane_info(self, lane: int, seq: Sequence | None) -> dict[str, object]:
        if seq is None:
            return {"lane": lane, "state": "free", "pages": 0, "tokens": 0}
        state = "prefill" if seq.is_prefilling else "decode"
        return {"lane": lane, "state": state, "pages": len(self.scheduler.runs.pages(lane)),
                "tokens": seq.num_computed, "request_id": seq.request_id}
