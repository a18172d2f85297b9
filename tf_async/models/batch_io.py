"""One upload per round: a forward batch's index arrays packed into one int64 buffer.

A round's metadata is six small arrays (token ids, positions, KV slots, row -> stream, the
block table, the logit rows; hybrid models add stream -> lane). Uploaded one by one they
cost six host-to-device copies from pageable memory; packed they cost one, from a reused
pinned buffer on the GPU. The ForwardBatch's fields are views into the device buffer (same
dtypes, shapes and C-contiguity as separate arrays), and the batch keeps the host buffer
(`ForwardBatch.packed`) so its indices can be validated with NumPy, with no device sync.

Layout, in int64 words, every section starting on a word:

    token_ids [rows] | positions [rows] | slots [rows] | logit_rows [m]       (int64)
    row_seq [rows] | seq_lanes [seqs] (hybrid only) | block_table [seqs, width]  (int32, two per word)

The block table comes last, so two layouts with the same rows, logit rows, streams and lanes
share every word before it (GraphDecoder copies that prefix into its static buffer at once).
On the CPU `ops.asarray` is the identity: the fields are views of the host buffer itself.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..backend.base import Array, Ops
from ..errors import BadInputError

FIELDS = ("token_ids", "positions", "slots", "row_seq", "block_table", "logit_rows")
NO_PAGE = -1  # a block table's padding past a stream's own pages: no page (fails the checks)


class BatchViews(NamedTuple):
    """The arrays of one packed buffer (NumPy or CuPy views of it)."""

    token_ids: Any  # [rows] int64
    positions: Any  # [rows] int64
    slots: Any  # [rows] int64
    row_seq: Any  # [rows] int32
    block_table: Any  # [seqs, width] int32
    logit_rows: Any  # [m] int64
    seq_lanes: Any  # [seqs] int32, or None


def _words32(count: int) -> int:
    return (count + 1) // 2


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each array lives in a packed buffer (see the module docstring)."""

    rows: int
    num_logits: int
    seqs: int
    width: int
    lanes: bool = False  # a seq_lanes section

    @property
    def int64_words(self) -> int:
        """Words of the int64 sections (token_ids, positions, slots, logit_rows)."""
        return 3 * self.rows + self.num_logits

    @property
    def table_offset(self) -> int:
        """Words before the block table (the prefix shared by layouts of one round shape)."""
        lanes = _words32(self.seqs) if self.lanes else 0
        return self.int64_words + _words32(self.rows) + lanes

    @property
    def words(self) -> int:
        return self.table_offset + _words32(self.seqs * self.width)

    def views(self, buf: Any, xp: Any = None) -> BatchViews:
        """Views of a [words] int64 buffer: a NumPy one, or a device one of module `xp`
        (CuPy: arrays at offsets of its memory, one object a field, cheaper than slicing)."""
        if buf.shape != (self.words,) or buf.dtype != np.int64:
            raise ValueError(f"packed batch: expected a ({self.words},) int64 buffer, "
                             f"got {buf.shape} {buf.dtype}")
        rows, seqs = self.rows, self.seqs
        if isinstance(buf, np.ndarray):  # slicing: cheaper than np.ndarray(buffer=...) here
            def at(word: int, shape: tuple[int, ...], dtype: Any) -> Any:
                count = shape[0] * shape[1] if len(shape) == 2 else shape[0]
                if dtype is np.int64:
                    part = buf[word:word + count]
                else:
                    part = buf[word:word + _words32(count)].view(np.int32)[:count]
                return part.reshape(shape) if len(shape) == 2 else part
        else:
            if xp is None:
                raise ValueError("packed batch: views of a device buffer need its module (xp)")
            memory = buf.data

            def at(word: int, shape: tuple[int, ...], dtype: Any) -> Any:
                return xp.ndarray(shape, dtype, memptr=memory + 8 * word)
        seq_at = self.int64_words
        lanes_at = seq_at + _words32(rows)
        return BatchViews(
            token_ids=at(0, (rows,), np.int64), positions=at(rows, (rows,), np.int64),
            slots=at(2 * rows, (rows,), np.int64), row_seq=at(seq_at, (rows,), np.int32),
            block_table=at(self.table_offset, (seqs, self.width), np.int32),
            logit_rows=at(3 * rows, (self.num_logits,), np.int64),
            seq_lanes=at(lanes_at, (seqs,), np.int32) if self.lanes else None)


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """A batch's packed buffers: `host` (NumPy, owned by the batch: the originals, for host
    checks) and `device` (the one uploaded copy its fields view)."""

    layout: Layout
    host: np.ndarray  # [words] int64
    device: Array  # [words] int64 on the ops' device (the host buffer itself on the CPU)
    device_views: BatchViews  # the views handed to ForwardBatch

    @property
    def host_views(self) -> BatchViews:
        return self.layout.views(self.host)

    def describes(self, batch: ForwardBatch) -> bool:
        """Whether `batch`'s index fields are still this buffer's views (a batch rebuilt with
        dataclasses.replace may carry another array in a field)."""
        dv = self.device_views
        return batch.seq_lanes is dv.seq_lanes and all(
            getattr(batch, name) is getattr(dv, name) for name in FIELDS)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Rows of one forward call (any mix of streams). Arrays live on the ops' device."""

    token_ids: Array  # [rows] int64
    positions: Array  # [rows] int64, absolute position of each row in its stream
    slots: Array  # [rows] int64, KV slot each row writes
    row_seq: Array  # [rows] int32, row -> index into block_table
    block_table: Array  # [seqs, max_pages] int32
    logit_rows: Array  # [m] int64, rows whose logits are wanted
    page_size: int
    seq_lanes: Array | None = None  # [seqs] int32, block-table row -> lane (recurrent state slot)
    # The one packed buffer the fields view, with its host original (pack_batch); None for
    # a batch built from separate arrays.
    packed: PackedBatch | None = None
    # Target layers whose outputs (pre final norm) forward(all_hidden=True) returns as the
    # hidden rows, side by side in this order ([rows, len * H]), instead of the final-normed
    # rows: what a DFlash drafter reads (its target_layer_ids). () for the final-normed rows.
    capture_layers: tuple[int, ...] = ()
    # [rows, H] float32 hidden rows fed with the tokens (the MTP head: the target's final-normed
    # rows h_s); None for decoders that start from the embedding alone
    hidden_in: Array | None = None


def captured_rows(ops: Ops, batch: ForwardBatch, index: int, h: Array,
                  captured: dict[int, Array]) -> None:
    """Keep a copy of layer `index`'s output rows h when the batch captures that layer."""
    if index in batch.capture_layers:
        captured[index] = h.copy()


def hidden_rows(ops: Ops, batch: ForwardBatch, captured: dict[int, Array], normed: Array) -> Array:
    """forward(all_hidden=True)'s hidden rows: the captured layers side by side, else normed."""
    if not batch.capture_layers:
        return normed
    return ops.xp.concatenate([captured[i] for i in batch.capture_layers], axis=-1)


def packed_of(batch: ForwardBatch) -> PackedBatch | None:
    """The batch's packed buffers while its fields are still their views, else None (a batch
    built from separate arrays, or rebuilt with dataclasses.replace)."""
    packed = batch.packed
    return packed if packed is not None and packed.describes(batch) else None


def pack_host(*, token_ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
              row_seq: Sequence[int] | np.ndarray, block_table: np.ndarray,
              logit_rows: Sequence[int] | np.ndarray, page_size: int,
              slots: Sequence[int] | np.ndarray | None = None,
              seq_lanes: Sequence[int] | np.ndarray | None = None) -> tuple[Layout, np.ndarray]:
    """The packed host buffer of a batch. `slots` defaults to each row's KV slot through the
    block table: table[row_seq, pos // page_size] * page_size + pos % page_size."""
    table = np.asarray(block_table, np.int32)
    if table.ndim != 2:
        raise ValueError(f"packed batch: block_table must be 2-D, got shape {table.shape}")
    pos = np.asarray(positions, np.int64)
    seq = np.asarray(row_seq, np.int32)
    logits = np.asarray(logit_rows, np.int64)
    layout = Layout(int(pos.shape[0]), int(logits.shape[0]), table.shape[0], table.shape[1],
                    seq_lanes is not None)
    buf = np.zeros(layout.words, np.int64)  # zeros: the odd int32 halves are defined
    v = layout.views(buf)
    v.token_ids[...] = np.asarray(token_ids, np.int64)
    v.positions[...] = pos
    v.row_seq[...] = seq
    v.block_table[...] = table
    v.logit_rows[...] = logits
    if slots is None:
        slots = table[seq, pos // page_size].astype(np.int64) * page_size + pos % page_size
    v.slots[...] = np.asarray(slots, np.int64)
    if seq_lanes is not None:
        v.seq_lanes[...] = np.asarray(seq_lanes, np.int32)
    return layout, buf


def upload(ops: Ops, layout: Layout, host: np.ndarray, page_size: int) -> ForwardBatch:
    """One copy of the packed buffer to the ops' device; the batch's fields view it."""
    device = _uploader(ops).put(host) if ops.name == "cuda" else ops.asarray(host)
    v = layout.views(device, ops.xp)
    return ForwardBatch(v.token_ids, v.positions, v.slots, v.row_seq, v.block_table, v.logit_rows,
                        page_size, v.seq_lanes, PackedBatch(layout, host, device, v))


def pack_batch(ops: Ops, *, token_ids: Sequence[int] | np.ndarray,
               positions: Sequence[int] | np.ndarray, row_seq: Sequence[int] | np.ndarray,
               block_table: np.ndarray, logit_rows: Sequence[int] | np.ndarray, page_size: int,
               slots: Sequence[int] | np.ndarray | None = None,
               seq_lanes: Sequence[int] | np.ndarray | None = None) -> ForwardBatch:
    """A ForwardBatch on the ops' device from host values, in one upload (see pack_host)."""
    layout, host = pack_host(token_ids=token_ids, positions=positions, row_seq=row_seq,
                             block_table=block_table, logit_rows=logit_rows, page_size=page_size,
                             slots=slots, seq_lanes=seq_lanes)
    return upload(ops, layout, host, page_size)


# ---------------------------------------------------------------------- host checks
def check_indices(layout: Layout, host: np.ndarray, *, vocab: int, num_slots: int,
                  page_size: int) -> None:
    """Every index a decode round's kernels use is in range, checked on the packed host copy
    (NumPy, no device work): token ids < vocab, slots < num_slots, row_seq < streams,
    positions < width * page_size, logit rows < rows, and every block-table entry a row's
    position needs < num_slots // page_size. Raises BadInputError naming the first bad kind.
    A few NumPy calls whatever the batch (the int64 sections in one comparison)."""
    num_pages = num_slots // page_size
    v = layout.views(host)
    highs = _highs(layout, vocab, num_slots, page_size)
    bad = None
    if np.any(host[:layout.int64_words].view(np.uint64) >= highs):  # negatives wrap to huge
        for name, high in (("token_ids", vocab), ("slots", num_slots),
                           ("positions", layout.width * page_size), ("logit_rows", layout.rows)):
            if _outside(getattr(v, name), high):
                bad = name
                break
    elif _outside(v.row_seq, layout.seqs):
        bad = "row_seq"
    elif layout.rows and layout.width:
        entries = v.block_table[v.row_seq]  # [rows, width]; row_seq and positions are in range
        used = _columns(layout.width) <= (v.positions // page_size)[:, None]
        if np.any(used & (entries.view(np.uint32) >= num_pages)):
            bad = "block_table"
    if bad is not None:
        raise BadInputError(f"decode round: an index is out of range ({bad}; vocab {vocab}, "
                            f"{num_slots} slots, {num_pages} pages, {layout.seqs} streams, "
                            f"{layout.rows} rows)")


@functools.lru_cache(maxsize=256)
def _highs(layout: Layout, vocab: int, num_slots: int, page_size: int) -> np.ndarray:
    """Bound of each int64 word of the layout: token_ids, positions, slots, logit_rows."""
    rows = layout.rows
    return np.repeat(np.array([vocab, layout.width * page_size, num_slots, rows], np.uint64),
                     [rows, rows, rows, layout.num_logits])


@functools.lru_cache(maxsize=64)
def _columns(width: int) -> np.ndarray:
    return np.arange(width)[None, :]


def _outside(values: np.ndarray, high: int) -> bool:
    """Any value outside [0, high): one reduction (a negative reads as a huge unsigned)."""
    if values.shape[0] == 0:
        return False
    unsigned = np.uint64 if values.dtype.itemsize == 8 else np.uint32
    return int(values.view(unsigned).max()) >= high


# ---------------------------------------------------------------------- uploads (CuPy)
class PinnedUploader:
    """Host-to-device copies from a ring of reused pinned buffers (one async copy a batch on
    the current stream). A buffer is written again only after its last copy finished (its
    event), so a batch never reads another's bytes; the batch's own host buffer stays its own."""

    SLOTS = 4
    MIN_WORDS = 1024

    def __init__(self, xp: Any):
        self.xp = xp
        self._pinned: list[Any] = [None] * self.SLOTS  # (memory, int64 NumPy view) per slot
        self._events: list[Any] = [None] * self.SLOTS
        self._next = 0
        self._lock = threading.Lock()

    def put(self, host: np.ndarray) -> Array:
        xp, words = self.xp, int(host.shape[0])
        device = xp.empty(words, xp.int64)
        if words == 0:
            return device
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % self.SLOTS
            if self._events[slot] is not None:
                self._events[slot].synchronize()  # the slot's previous copy is done
            else:
                self._events[slot] = xp.cuda.Event(disable_timing=True)
            staged = self._staging(slot, words)
            staged[...] = host
            device.set(staged, stream=xp.cuda.get_current_stream())  # async: pinned source
            self._events[slot].record()
        return device

    def _staging(self, slot: int, words: int) -> np.ndarray:
        pinned = self._pinned[slot]
        if pinned is None or pinned[1].shape[0] < words:
            capacity = max(self.MIN_WORDS, 1 << (words - 1).bit_length())
            memory = self.xp.cuda.alloc_pinned_memory(capacity * 8)
            pinned = (memory, np.frombuffer(memory, np.int64, capacity))
            self._pinned[slot] = pinned
        return pinned[1][:words]


_UPLOADERS: weakref.WeakKeyDictionary[Any, PinnedUploader] = weakref.WeakKeyDictionary()
_UPLOADERS_LOCK = threading.Lock()


def _uploader(ops: Ops) -> PinnedUploader:
    """The ops' uploader (one per ops object, made on first use)."""
    with _UPLOADERS_LOCK:
        uploader = _UPLOADERS.get(ops)
        if uploader is None:
            uploader = _UPLOADERS[ops] = PinnedUploader(ops.xp)
        return uploader
