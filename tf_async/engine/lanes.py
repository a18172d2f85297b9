"""Lane lifecycle: open (run zeroed) -> steps -> release (drain -> free). One release path.

    lane:  | free | --try_open--> | open: run = pages (+ recurrent state, + drafter area) |
           --release--> | free |

The run's new pages and, for hybrid models, the lane's recurrent state are zeroed by the
runner on the engine stream before the lane's first step (RoundPlan.pages_to_zero and
lanes_to_zero); the drafter area is zeroed when the drafter borrows it.
"""

from __future__ import annotations

from collections.abc import Callable

from .pages import Runs


class Lanes:
    def __init__(self, num_lanes: int, runs: Runs, drain: Callable[[], None]):
        self.num_lanes = num_lanes
        self.runs = runs
        self._drain = drain  # waits for the engine stream's outstanding work
        self._free = list(range(num_lanes))
        self._owner: dict[int, int] = {}  # lane -> request id
        self._release_hooks: list[Callable[[int], None]] = []
        self.num_releases = 0  # releases that freed something (tests count them)

    @property
    def num_in_use(self) -> int:
        return len(self._owner)

    def owner(self, lane: int) -> int | None:
        return self._owner.get(lane)

    def add_release_hook(self, hook: Callable[[int], None]) -> None:
        """Called with the lane id inside release, after the drain and before the run goes back."""
        self._release_hooks.append(hook)

    def try_open(self, request_id: int) -> tuple[int, list[int]] | None:
        """Open the lowest free lane; return (lane, pages to zero) or None when all are busy."""
        if not self._free:
            return None
        lane = self._free.pop(0)
        self._owner[lane] = request_id
        return lane, self.runs.open(lane)

    def release(self, lane: int) -> None:
        """The one release point. Drains the stream, then returns the run. Twice is a no-op."""
        if lane not in self._owner:
            return
        self._drain()
        for hook in self._release_hooks:
            hook(lane)
        self.runs.close(lane)
        del self._owner[lane]
        self._free.append(lane)
        self._free.sort()
        self.num_releases += 1
