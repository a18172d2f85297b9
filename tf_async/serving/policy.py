"""Routing by load with prefix affinity: a pure policy holding integers only.

Per replica it keeps the requests the front has in flight there (live) and what the
replica's own stats said at the last poll (queue length, free lanes; up to 0.5 s old).
Replicas are ordered by

    (in_flight, queued, -lanes_free, index)

the live count first (a poll lags: a replica whose streams just ended still looks busy),
then the polled figures, which break ties (lanes still held by streams being cancelled,
replicas of different --parallel, traffic sent to a replica directly), then the lowest
index. `choose` picks the first replica that is up in that order.

Prefix affinity: a conversation's key (affinity.py) remembered from an earlier turn routes
to the same replica, which holds that prefix in its prefix cache, unless that replica is
down or its load exceeds the least loaded's by more than `affinity_margin`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

DEFAULT_AFFINITY_MARGIN = 2  # requests; a remembered replica may be this much busier
DEFAULT_MAX_KEYS = 65536  # remembered conversation keys (least recently used forgotten)


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """What the policy knows of one replica."""

    up: bool = False
    in_flight: int = 0  # requests the front has sent there and not yet seen end
    lanes_busy: int = 0  # from the replica's last stats poll
    lanes_free: int = 0
    queued: int = 0

    @property
    def load(self) -> int:
        """Requests in flight from the front: what the affinity margin is counted in."""
        return self.in_flight

    def order(self, index: int) -> tuple[int, int, int, int]:
        return (self.in_flight, self.queued, -self.lanes_free, index)


class RoutingPolicy:
    """Least loaded replica, with prefix affinity. Integers only; no I/O, no clock."""

    def __init__(self, num_replicas: int, affinity_margin: int = DEFAULT_AFFINITY_MARGIN,
                 max_keys: int = DEFAULT_MAX_KEYS):
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.affinity_margin = affinity_margin
        self.max_keys = max_keys
        self._homes: OrderedDict[int, int] = OrderedDict()  # conversation key -> replica
        self.num_affinity_hits = 0
        self.num_affinity_overrides = 0  # remembered replica too busy or down

    # ------------------------------------------------------------ replica state

    def mark_up(self, replica: int) -> None:
        self.replicas[replica] = replace(self.replicas[replica], up=True)

    def mark_down(self, replica: int) -> None:
        """Out of routing at once; its polled stats are forgotten (a restart starts empty)."""
        self.replicas[replica] = replace(self.replicas[replica], up=False, lanes_busy=0,
                                         lanes_free=0, queued=0)

    def update_stats(self, replica: int, lanes_busy: int, lanes_free: int, queued: int) -> None:
        self.replicas[replica] = replace(self.replicas[replica], lanes_busy=lanes_busy,
                                         lanes_free=lanes_free, queued=queued)

    def begin(self, replica: int) -> None:
        state = self.replicas[replica]
        self.replicas[replica] = replace(state, in_flight=state.in_flight + 1)

    def end(self, replica: int) -> None:
        state = self.replicas[replica]
        self.replicas[replica] = replace(state, in_flight=max(0, state.in_flight - 1))

    @property
    def num_up(self) -> int:
        return sum(1 for r in self.replicas if r.up)

    # ------------------------------------------------------------ choosing

    def least_loaded(self) -> int | None:
        """The up replica with the least load (ties: lowest index); None when none is up."""
        up = [(state.order(replica), replica) for replica, state in enumerate(self.replicas)
              if state.up]
        return min(up)[1] if up else None

    def choose(self, keys: list[int] | tuple[int, ...] = ()) -> int | None:
        """The replica for a request whose conversation keys are `keys` (longest prefix
        first): the first remembered one's replica when it is up and not more than
        `affinity_margin` busier than the least loaded; else the least loaded."""
        best = self.least_loaded()
        if best is None:
            return None
        for key in keys:
            home = self._homes.get(key)
            if home is None:
                continue
            state = self.replicas[home]
            if state.up and state.load <= self.replicas[best].load + self.affinity_margin:
                self.num_affinity_hits += 1
                return home
            self.num_affinity_overrides += 1
            return best
        return best

    def remember(self, key: int, replica: int) -> None:
        """The replica now holding the prefix of conversation `key`."""
        self._homes[key] = replica
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_keys:
            self._homes.popitem(last=False)

    def home_of(self, key: int) -> int | None:
        return self._homes.get(key)
