"""GraphDecoder: Decoder.forward with decode rounds replayed from CUDA graphs (CudaOps only).

A decode round of a 36-layer model is ~700 small launches; from Python each costs more than
the kernel itself at batch 1. The first round of each shape (rows, streams) runs eagerly on
a private stream and is then captured (CuPy stream capture records the Numba launches made
on that stream); later rounds of that shape copy their inputs into the graph's static
buffers and replay it. The replay runs the same kernels on the same values, so its logits
are bit-identical to the eager forward's and every gate holds unchanged.

Which rounds: every row wants logits (decode rows, draft verification rows) and there are
at most `max_rows` rows; anything else (prompt steps) runs eagerly, as do new shapes once
`max_graphs` shapes are captured (each keeps a memory pool of its own).

Hybrids (Qwen3.5/3.6, HybridDecoder): the lanes' recurrent states are addressed through the
round's lane table (`seq_lanes`, a section of the static buffer), so one graph serves any set
of lanes; the kernels read the `frozen` flags from the states' own array at replay. MoE rounds
with enough slots for the sorted-by-expert path run eagerly (its sort is not captured). A
capture that fails leaves that shape eager (the round's outputs are the eager forward's either
way).

Verify rounds (CAPTURE_VERIFY_ROUNDS): a hybrid round that stashes its frozen rows reads the
stash plan from the states' plan buffer (one entry a batch row), and a round that wants every
row's hidden (the MTP drafter) returns the graph's hidden rows when every row is a logit row,
in order (the final norm is a per-row op: the same bits). A round that hands out target
layers' outputs (`capture_layers`, the DFlash drafter's features) is captured with them: its
graph's hidden rows are those layers' outputs of every row, side by side (copies the graph
makes after each such layer), keyed by the layers. On by default (every GPU gate holds
with it, tests/test_gpu_qwen35.py); off, those rounds run eagerly. The commit of accepted
draft rows (`commit_states`) replays a graph a row count (models/call_graphs.py).

The static block table is as wide as the arena has pages; attention reads only the entries a row's position needs
(positions are checked against the round's own width), so the padding never changes a value.

The static inputs are one packed buffer (models/batch_io.py). A batch from `pack_batch`
carries its host original: its indices are checked there with NumPy (no device work) and
its device buffer is copied into the static one at once (one copy; two when the round has
several streams, whose block-table rows have another pitch). A batch of separate device
arrays is checked on the device (one sync) and copied array by array. A caller that checked
the round itself runs the forward inside `ops.unchecked()` (the engine's runner does), and
then nothing is checked twice.

    round:  check indices (host) -> copy into the static buffer -> replay -> copy outputs

Where the GPU (Hopper or later) and its driver allow, the kernel-to-kernel edges of the graph
are programmatic (GraphOps.capture_programmatic: cuda_kernels/graphs.py): each kernel is launched while the one before it
finishes and waits on the device before it reads anything, so the same kernels run in the
same order, with less time between them.

The graph also holds the greedy token of every logit row (ops.argmax, the launch the runner
would make next): `argmax_of(logits)` hands them out for the logits of the latest replay, so
a greedy round makes no launch of its own outside the graph (each costs ~50 us of host time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend.base import Array, GraphOps, graph_ops
from ..errors import BadInputError
from .batch_io import ForwardBatch, Layout, check_indices, packed_of
from .call_graphs import CallGraphs, array_address, relaxed_capture_mode
from .decoder import Decoder
from .qwen35 import HybridDecoder, RecurrentStates, commit_indices

log = logging.getLogger(__name__)

CAPTURE_VERIFY_ROUNDS = True  # rounds that stash verify rows or want every row's hidden


@dataclass(slots=True)
class _Captured:
    """One captured round: its stream, private memory pool, static inputs and outputs."""

    stream: Any
    pool: Any
    layout: Layout  # of the static input buffer
    buffer: Array  # [layout.words] int64, the static inputs packed
    batch: ForwardBatch  # static input buffers: views of `buffer`
    # The cache arrays the graph's kernels address: held, so that their ids (in the shape
    # key) cannot pass to other arrays while the graph that writes them exists.
    kv: Array = None
    kv_scales: Array = None
    states: RecurrentStates | None = None  # hybrids: the store whose arrays the graph addresses
    stash: tuple[Array, ...] = ()  # hybrids: the stash arrays it addresses (held, as kv is)
    graph: Any = None
    logits: Array = None
    hidden: Array = None
    greedy: Array = None  # ops.argmax(logits), in the graph


class GraphDecoder:
    """A DecoderProtocol that wraps one Decoder or HybridDecoder on GraphOps (CudaOps)."""

    def __init__(self, decoder: Decoder | HybridDecoder, *, max_rows: int = 64,
                 programmatic: bool = True, max_graphs: int = 32):
        ops = graph_ops(decoder.ops)
        if ops is None:
            raise BadInputError("CUDA graphs need the cuda device", param="device")
        self.decoder = decoder
        self.config = decoder.config
        self.ops: GraphOps = ops
        self.weights = decoder.weights
        self.max_rows = _captured_rows(decoder, max_rows)
        # Each captured shape keeps its own memory pool: past `max_graphs` shapes (drafting
        # at a high --parallel makes many), new shapes run eagerly (same bits).
        self.max_graphs = max_graphs
        # Programmatic edges between the round's kernels where the GPU and driver allow
        # (cuda_kernels/graphs.py): the same kernels in the same order, launched sooner.
        self.programmatic = programmatic
        self._graphs: dict[tuple[Any, ...], _Captured | None] = {}  # None: eager (capture failed)
        self.num_replays = 0  # rounds served from a graph (tests and benchmarks read it)
        self.num_verify_replays = 0  # of which rounds that stashed verify rows
        self.num_feature_replays = 0  # of which rounds that handed out target layers (DFlash)
        self._greedy: tuple[Array, Array] | None = None  # (latest replay's logits, their argmax)
        # Hybrids: the commit of accepted draft rows (conv + delta rule over every GDN layer,
        # ~4 launches a layer) replays a graph a row count.
        self._commits = CallGraphs(ops) if isinstance(decoder, HybridDecoder) else None

    @property
    def states(self) -> RecurrentStates | None:
        """The wrapped decoder's recurrent states (hybrids), else None."""
        return self.decoder.states if isinstance(self.decoder, HybridDecoder) else None

    def commit_states(self, commits: tuple[tuple[int, int], ...]) -> None:
        """The wrapped decoder's commits (before the round's forward), replayed from a graph
        keyed by the number of rows and the state arrays' addresses."""
        states, decoder = self.states, self.decoder
        if not commits or states is None or self._commits is None:
            decoder.commit_states(commits)
            return
        assert isinstance(decoder, HybridDecoder)
        lanes, positions = commit_indices(commits, states.stash_rows)

        def run(lane_ids: Array, rows: Array, row_lanes: Array) -> tuple[()]:
            return decoder.commit_rows(lane_ids, rows, row_lanes, states)

        key = (int(lanes.shape[0]), *array_address(states.conv), *array_address(states.delta),
               *array_address(states.stashed))
        self._commits(key, run, (lanes, positions, lanes.astype(np.int32)),
                      holds=(states.conv, states.delta, states.stashed))

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        return self.decoder.one_shot(batch, kv, kv_scales)

    def argmax_of(self, logits: Array) -> Array | None:
        """ops.argmax(logits), computed inside the graph, when `logits` is the very array the
        latest replay returned; else None (the caller launches it)."""
        if self._greedy is not None and self._greedy[0] is logits:
            return self._greedy[1]
        return None

    def forward(self, batch: ForwardBatch, kv: Array, kv_scales: Array, *,
                all_hidden: bool = False) -> tuple[Array, Array]:
        """Decoder.forward, replayed from a graph when the round is a decode-shaped one."""
        self._greedy = None
        layers = batch.capture_layers if all_hidden else ()
        if all_hidden and not (layers and CAPTURE_VERIFY_ROUNDS) and not _hidden_is_every_row(batch):
            return self.decoder.forward(batch, kv, kv_scales, all_hidden=True)
        rows = int(batch.token_ids.shape[0])
        decode_shaped = 0 < rows <= self.max_rows and int(batch.logit_rows.shape[0]) == rows
        seqs, width = (int(n) for n in batch.block_table.shape)
        if (not decode_shaped or not self._capturable(batch)
                or width > kv.shape[2] // batch.page_size):  # wider than the static table
            return self.decoder.forward(batch, kv, kv_scales, all_hidden=all_hidden)
        if self.ops.device_checks:  # False inside unchecked(): the caller checked (the runner)
            packed = packed_of(batch)
            if packed is not None:
                check_indices(packed.layout, packed.host,
                              vocab=self.weights.embed.out_features, num_slots=kv.shape[2],
                              page_size=batch.page_size)
            else:
                self._check_indices(batch, kv)
        states = self.states
        if states is not None and isinstance(self.decoder, HybridDecoder):
            self.decoder.row_lanes(batch, states, check_only=True)  # the graph reads the table
        stash = states.graph_inputs() if states is not None else ()
        key = (rows, seqs, batch.page_size, id(kv), id(kv_scales), id(states), layers,
               *(id(a) for a in stash))
        if key in self._graphs:
            captured = self._graphs[key]
            if captured is None:  # its capture failed: this shape runs eagerly
                return self.decoder.forward(batch, kv, kv_scales, all_hidden=all_hidden)
            self.num_verify_replays += bool(stash)
            self.num_feature_replays += bool(layers)
            return self._replay(captured, batch)
        if len(self._graphs) >= self.max_graphs:
            return self.decoder.forward(batch, kv, kv_scales, all_hidden=all_hidden)
        made, outputs = self._capture(batch, kv, kv_scales, layers)
        self._graphs[key] = made
        return outputs

    def _capturable(self, batch: ForwardBatch) -> bool:
        """Dense rounds without a lane table; hybrid rounds with one that hand out no captured
        layers and stash nothing (no drafts to verify) unless CAPTURE_VERIFY_ROUNDS."""
        states = self.states
        if states is None:
            return batch.seq_lanes is None
        return (batch.seq_lanes is not None and (not batch.capture_layers or CAPTURE_VERIFY_ROUNDS)
                and (states.stash_plan is None or CAPTURE_VERIFY_ROUNDS))

    # ------------------------------------------------------------------ replay
    def _replay(self, cap: _Captured, batch: ForwardBatch) -> tuple[Array, Array]:
        xp = self.ops.xp
        caller = xp.cuda.get_current_stream()
        cap.stream.wait_event(caller.record())
        with cap.stream:
            _load(xp, cap, batch)
            cap.graph.launch(cap.stream)
        caller.wait_event(cap.stream.record())
        self.num_replays += 1
        # The graph's buffers are reused next round: the caller gets copies.
        logits = _copied(xp, cap.logits)
        self._greedy = (logits, _copied(xp, cap.greedy))
        return logits, _copied(xp, cap.hidden)

    def _capture(self, batch: ForwardBatch, kv: Array, kv_scales: Array, layers: tuple[int, ...]
                 ) -> tuple[_Captured | None, tuple[Array, Array]]:
        """Run the round eagerly on a private stream and pool (compiles every kernel and sizes
        the pool), then capture the same round; return the capture (None: a hybrid round
        that could not be captured) and the eager outputs. `layers`: the target layers whose
        outputs the round hands out as its hidden rows (every row's, side by side)."""
        xp = self.ops.xp
        caller = xp.cuda.get_current_stream()
        # A blocking stream: ordered with the legacy default stream the engine uses.
        layout, buffer, static = _static_batch(xp, batch, kv, layers)
        states = self.states
        cap = _Captured(xp.cuda.Stream(non_blocking=False), xp.cuda.MemoryPool(), layout, buffer,
                        static, kv, kv_scales, states,
                        states.graph_inputs() if states is not None else ())
        cap.stream.wait_event(caller.record())
        with xp.cuda.using_allocator(cap.pool.malloc), cap.stream, self.ops.unchecked():
            _load(xp, cap, batch)
            logits, hidden = self.decoder.forward(cap.batch, kv, kv_scales, all_hidden=bool(layers))
            outputs = (logits.copy(), hidden.copy())
            made: _Captured | None = cap
            try:
                self._record(cap, kv, kv_scales)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured
                if self.states is None:
                    raise
                log.warning("hybrid round of %d rows not captured (runs eagerly): %s",
                            batch.token_ids.shape[0], exc)
                made = None
        caller.wait_event(cap.stream.record())
        return made, outputs

    def _record(self, cap: _Captured, kv: Array, kv_scales: Array) -> None:
        """Capture the round (its kernels are compiled and its pool sized by then)."""
        def record() -> None:
            cap.logits, cap.hidden = self.decoder.forward(cap.batch, kv, kv_scales,
                                                          all_hidden=bool(cap.batch.capture_layers))
            cap.greedy = self.ops.argmax(cap.logits)

        if self.programmatic:
            cap.graph = self.ops.capture_programmatic(cap.stream, record)
        if cap.graph is None:
            cap.stream.begin_capture(mode=relaxed_capture_mode(self.ops.xp))
            try:
                record()
            finally:
                cap.graph = cap.stream.end_capture()

    # ------------------------------------------------------------------ checks
    def _check_indices(self, batch: ForwardBatch, kv: Array) -> None:
        """Every index the captured kernels will use is in range (one reduction, one sync):
        inside the graph nothing is checked. For batches with no host copy (batch_io's
        check_indices checks the same on the host)."""
        xp = self.ops.xp
        rows, (seqs, width) = batch.token_ids.shape[0], batch.block_table.shape
        num_slots, page_size = kv.shape[2], batch.page_size
        num_pages = num_slots // page_size
        bad = [_outside(xp, batch.token_ids, self.weights.embed.out_features),
               _outside(xp, batch.slots, num_slots), _outside(xp, batch.row_seq, seqs),
               _outside(xp, batch.positions, width * page_size),
               _outside(xp, batch.logit_rows, rows)]
        seq = xp.clip(batch.row_seq, 0, seqs - 1).astype(xp.int64)
        entries = batch.block_table[seq]  # [rows, width]
        used = xp.arange(width)[None, :] <= (batch.positions // page_size)[:, None]
        bad.append(xp.any(used & ((entries < 0) | (entries >= num_pages))))
        if bool(xp.any(xp.stack(bad))):
            raise BadInputError(f"decode round: an index is out of range (vocab, {num_slots} slots, "
                                f"{num_pages} pages, {seqs} streams, {rows} rows)")


def _hidden_is_every_row(batch: ForwardBatch) -> bool:
    """Whether forward(all_hidden=True)'s hidden rows are the logit rows' (CAPTURE_VERIFY_ROUNDS
    on, no captured layers, every row a logit row in order: checked on the packed host copy)."""
    if not CAPTURE_VERIFY_ROUNDS or batch.capture_layers:
        return False
    packed = packed_of(batch)
    if packed is None:
        return False
    logit_rows = packed.host_views.logit_rows
    return bool(logit_rows.shape[0] == packed.layout.rows
                and np.array_equal(logit_rows, np.arange(packed.layout.rows)))


def _outside(xp: Any, values: Array, high: int) -> Array:
    return xp.any((values < 0) | (values >= high))


def _captured_rows(decoder: Decoder | HybridDecoder, max_rows: int) -> int:
    """The most rows a captured round has: `max_rows`, fewer for a hybrid MoE, whose rounds
    of MOE_SORTED_MIN_SLOTS routed slots or more sort by expert (not captured)."""
    if not isinstance(decoder, HybridDecoder) or not decoder.hybrid.is_moe:
        return max_rows
    from ..backend.cuda_ops import MOE_SORTED_MIN_SLOTS

    top_k = decoder.config.num_experts_per_tok
    return min(max_rows, (MOE_SORTED_MIN_SLOTS - 1) // top_k)


def _static_batch(xp: Any, batch: ForwardBatch, kv: Array, layers: tuple[int, ...] = ()
                  ) -> tuple[Layout, Array, ForwardBatch]:
    """Input buffers of a graph: one packed buffer (batch_io's layout; the lane table when the
    round has one) and the batch of its views, capturing `layers`; the block table is as wide
    as the arena has pages."""
    rows, seqs = batch.token_ids.shape[0], batch.block_table.shape[0]
    layout = Layout(rows, rows, seqs, kv.shape[2] // batch.page_size, batch.seq_lanes is not None)
    buffer = xp.zeros(layout.words, xp.int64)
    v = layout.views(buffer, xp)
    static = ForwardBatch(v.token_ids, v.positions, v.slots, v.row_seq, v.block_table,
                          v.logit_rows, batch.page_size, v.seq_lanes, capture_layers=layers)
    return layout, buffer, static


def _load(xp: Any, cap: _Captured, batch: ForwardBatch) -> None:
    """Copy a round's inputs into the static buffers (on the current stream). A packed batch
    whose layout shares the static prefix: one copy of its buffer (one stream: its table row
    is a prefix of the static one; the tail of the static row keeps entries no position
    reaches), or the prefix and then the table (several streams: another row pitch)."""
    packed, static = packed_of(batch), cap.batch
    if packed is not None and packed.layout.table_offset == cap.layout.table_offset:
        if packed.layout.seqs == 1:
            _copy_words(cap.buffer, packed.device, packed.layout.words)
        else:
            _copy_words(cap.buffer, packed.device, cap.layout.table_offset)
            xp.copyto(static.block_table[:, :packed.layout.width], batch.block_table)
        return
    for name in ("token_ids", "positions", "slots", "row_seq", "logit_rows"):
        getattr(static, name)[...] = getattr(batch, name)
    if static.seq_lanes is not None:
        static.seq_lanes[...] = batch.seq_lanes
    width = batch.block_table.shape[1]
    static.block_table[:, :width] = batch.block_table
    static.block_table[:, width:] = 0


def _copy_words(dst: Array, src: Array, words: int) -> None:
    """dst[:words] = src[:words] for contiguous int64 buffers: one device-to-device memcpy
    on the current stream (no kernel, no views); NumPy buffers (tests) are copied in place."""
    if isinstance(dst, np.ndarray):
        dst[:words] = src[:words]
    elif words:
        dst.data.copy_from_device_async(src.data, 8 * words)


def _copied(xp: Any, array: Array) -> Array:
    """A copy of a contiguous device array: one memcpy (ndarray.copy launches a kernel)."""
    if not array.flags.c_contiguous:
        return array.copy()
    out = xp.empty_like(array)
    if array.size:
        out.data.copy_from_device_async(array.data, array.nbytes)
    return out
