"""The drafter kinds, in one table: `--drafter` is parsed against it and `attach_drafter`
builds from it. A new kind is one `DrafterKind` row here plus its module in this package."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import BadInputError
from ..drafting import Drafter, DrafterSpec
from .dflash import make_dflash_drafter
from .model import make_model_drafter
from .mtp import make_mtp_drafter
from .ngram import make_ngram_drafter

if TYPE_CHECKING:
    from ...models.checkpoint import Checkpoint
    from ..lanes import Lanes
    from ..options import EngineOptions
    from ..runner import Runner
    from ..sched import Scheduler

# (spec, options, target checkpoint, runner, scheduler) -> the drafter
MakeDrafter = Callable[[DrafterSpec, "EngineOptions", "Checkpoint", "Runner", "Scheduler"],
                       Drafter]


@dataclass(frozen=True, slots=True)
class DrafterKind:
    name: str
    make: MakeDrafter
    takes_path: bool = False  # written `name:PATH`

    @property
    def usage(self) -> str:
        return f"{self.name}:PATH" if self.takes_path else self.name


KINDS: dict[str, DrafterKind] = {kind.name: kind for kind in (
    DrafterKind("ngram", make_ngram_drafter),
    DrafterKind("mtp", make_mtp_drafter),
    DrafterKind("draft", make_model_drafter, takes_path=True),
    DrafterKind("dflash", make_dflash_drafter, takes_path=True),
)}


def parse_drafter(spec: str) -> DrafterSpec:
    """`ngram` | `mtp` | `draft:PATH` | `dflash:PATH` (the forms of KINDS) -> DrafterSpec."""
    name, colon, path = spec.partition(":")
    kind = KINDS.get(name)
    if kind is not None and (bool(path) if kind.takes_path else not colon):
        return DrafterSpec(name, path or None)
    expected = ", ".join(k.usage for k in KINDS.values())
    raise BadInputError(f"unknown drafter {spec!r}: expected one of {expected}", param="drafter")


def attach_drafter(options: EngineOptions, ckpt: Checkpoint, scheduler: Scheduler,
                   runner: Runner, lanes: Lanes) -> Drafter:
    """Build the drafter of options.drafter (ring drafters take their arena region) and
    hook its release into the lane's one release path."""
    assert options.drafter is not None
    spec = parse_drafter(options.drafter)
    drafter = KINDS[spec.kind].make(spec, options, ckpt, runner, scheduler)
    scheduler.drafter = drafter
    lanes.add_release_hook(drafter.release)
    return drafter
