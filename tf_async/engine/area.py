"""Drafter areas: a byte region of the arena that lanes' runs borrow for their drafter.

One region is allocated with the arena at engine start; a lane's run takes one contiguous
area from it when its drafter opens and gives it back on release. `AreaPool` holds integers
only (byte offsets, like pages.py); `area_views` turns an offset into array views.

    area:  | ring: capacity rows of K and V, every drafter layer | pad to 256 B | pending f32
           [pending_rows, H] | state f32 [H] |
           ^ offset                                     ^ pending_offset  ^ state_offset   area end ^
    ring row of position p: p % capacity

`pending` (MTP only, else no rows): hidden rows of slots whose K/V are not yet in the ring
(written in one call when the ring is next read, engine/drafters/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models.config import ModelConfig
from ..models.tp_decoder import ShardedKV, ShardedRegion

ALIGN_BYTES = 256
KV_ITEMSIZE = {"f32": 4, "bf16": 2, "fp8": 1}
KV_NP_DTYPE = {"f32": np.float32, "bf16": np.uint16, "fp8": np.uint8}


def align_up(num_bytes: int, align: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // align) * align


@dataclass(frozen=True, slots=True)
class AreaLayout:
    """Byte layout of one drafter area (ring of K/V rows, then the newest row's hidden)."""

    num_layers: int  # drafter attention layers with a ring
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    capacity: int  # ring rows
    kv_dtype: str
    pending_rows: int = 0  # hidden rows of slots not yet written to the ring (MTP)

    @classmethod
    def for_model(cls, cfg: ModelConfig, capacity: int, kv_dtype: str,
                  num_layers: int | None = None, pending_rows: int = 0) -> AreaLayout:
        layers = cfg.num_layers if num_layers is None else num_layers
        return cls(layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, capacity, kv_dtype,
                   pending_rows)

    @property
    def ring_shape(self) -> tuple[int, int, int, int, int]:
        """Same axes as the arena's kv: [layers, 2, capacity, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.capacity, self.num_kv_heads, self.head_dim)

    @property
    def ring_bytes(self) -> int:
        return int(np.prod(self.ring_shape)) * KV_ITEMSIZE[self.kv_dtype]

    @property
    def pending_offset(self) -> int:
        return align_up(self.ring_bytes)

    @property
    def pending_bytes(self) -> int:
        return 4 * self.hidden_size * self.pending_rows

    @property
    def state_offset(self) -> int:
        return self.pending_offset + self.pending_bytes

    @property
    def state_bytes(self) -> int:
        return 4 * self.hidden_size

    @property
    def num_bytes(self) -> int:
        """The state ends exactly at the area's end."""
        return self.state_offset + self.state_bytes


@dataclass(frozen=True, slots=True)
class AreaViews:
    ring: Any  # [layers, 2, capacity, kv_heads, head_dim] of the KV dtype
    state: Any  # [H] float32: the newest row's hidden state
    borrowed: bool  # True: views into the arena's region (never pooled)
    pending: Any = None  # [pending_rows, H] float32 (None without pending rows)


class AreaPool:
    """First-fit allocator of contiguous byte ranges in [0, num_bytes); 256-byte aligned starts.

    Integers only. Free extents are kept sorted and merged on free.
    """

    def __init__(self, num_bytes: int):
        self.num_bytes = num_bytes
        self._free: list[tuple[int, int]] = [(0, num_bytes)] if num_bytes > 0 else []
        self._taken: dict[int, int] = {}  # offset -> size (aligned)

    @property
    def num_in_use(self) -> int:
        return len(self._taken)

    @property
    def bytes_in_use(self) -> int:
        return sum(self._taken.values())

    def allocate(self, num_bytes: int) -> int | None:
        """Offset of a new area of `num_bytes`, or None (nothing taken) when none fits."""
        size = align_up(max(1, num_bytes))
        for i, (start, length) in enumerate(self._free):
            if length >= size:
                self._free[i:i + 1] = [(start + size, length - size)] if length > size else []
                self._taken[start] = size
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._taken.pop(offset)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged


def alloc_region(xp: Any, num_bytes: int) -> Any:
    """A zeroed uint8 region of `num_bytes` whose first byte is 256-byte aligned (at start)."""
    raw = xp.zeros(num_bytes + ALIGN_BYTES, dtype=np.uint8)
    pad = -address(raw) % ALIGN_BYTES
    return raw[pad: pad + num_bytes]


def address(array: Any) -> int:
    """Device or host address of an array's first element."""
    if hasattr(array, "__cuda_array_interface__"):
        return int(array.__cuda_array_interface__["data"][0])
    return int(array.__array_interface__["data"][0])


def area_views(region: Any, offset: int, layout: AreaLayout) -> AreaViews:
    """Borrowed ring and state views of the area at `offset` of the region (tensor parallel:
    of every rank's region, the ring a ShardedKV of each rank's heads, the state rank 0's)."""
    if isinstance(region, ShardedRegion):
        views = [area_views(part, offset, layout) for part in region.ranks]
        return AreaViews(ShardedKV(tuple(v.ring for v in views), region.comm), views[0].state,
                         borrowed=True, pending=views[0].pending)
    ring_bytes = region[offset: offset + layout.ring_bytes]
    ring = ring_bytes.view(KV_NP_DTYPE[layout.kv_dtype]).reshape(layout.ring_shape)
    start = offset + layout.state_offset
    state = region[start: start + layout.state_bytes].view(np.float32)
    pending = None
    if layout.pending_rows:
        start = offset + layout.pending_offset
        pending = region[start: start + layout.pending_bytes].view(np.float32).reshape(
            layout.pending_rows, layout.hidden_size)
    return AreaViews(ring, state, borrowed=True, pending=pending)


def owned_views(xp: Any, layout: AreaLayout) -> AreaViews:
    """Fallback: buffers of the same layout that the context owns (outside the arena)."""
    ring = xp.zeros(layout.ring_shape, dtype=KV_NP_DTYPE[layout.kv_dtype])
    pending = (xp.zeros((layout.pending_rows, layout.hidden_size), dtype=np.float32)
               if layout.pending_rows else None)
    return AreaViews(ring, xp.zeros(layout.hidden_size, dtype=np.float32), borrowed=False,
                     pending=pending)


# ---- per-lane memory report ---------------------------------------------------------------
def mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB" if num_bytes % (1 << 20) else f"{num_bytes >> 20} MiB"


def lane_memory_lines(name: str, target: ModelConfig, drafter: ModelConfig, *, parallel: int,
                      ctx: int, kv_dtype: str, drafter_layers: int, drafter_name: str,
                      recurrent_bytes: int = 0, stash_bytes: int = 0) -> list[str]:
    """Per-lane drafter memory: fixed (a buffer per lane before) vs in the run (now); hybrids
    add each lane's recurrent state (`recurrent_bytes`) and its verify stash (`stash_bytes`:
    the rows of a verify round, kept until their commit, instead of a copy of the state)."""
    layout = AreaLayout.for_model(drafter, ctx, kv_dtype, num_layers=drafter_layers)
    per_lane = layout.num_bytes
    kv_row = target.num_layers * 2 * target.num_kv_heads * target.head_dim * KV_ITEMSIZE[kv_dtype]
    lines = [
        f"{name}, drafter {drafter_name} ({drafter_layers} ring layer(s)), "
        f"--parallel {parallel} --ctx {ctx} --kv-dtype {kv_dtype}",
        f"  drafter area: ring {mib(layout.ring_bytes)} + pad + state {layout.state_bytes} B "
        f"= {layout.num_bytes} B ({mib(per_lane)})",
        f"  fixed a lane: {mib(per_lane)} -> 0 MiB (the area is borrowed from the lane's run)",
        f"  in the run a lane (full ctx): target KV {mib(kv_row * ctx)} + drafter area "
        f"{mib(per_lane)}; arena drafter region {mib(parallel * align_up(per_lane))} "
        f"({parallel} areas)",
    ]
    if recurrent_bytes:
        lines.append(f"  recurrent state a lane (in the run, zeroed at open): {mib(recurrent_bytes)}"
                     f" + verify stash {mib(stash_bytes)}; all lanes "
                     f"{mib(parallel * (recurrent_bytes + stash_bytes))}")
    return lines
