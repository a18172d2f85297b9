"""GraphDecoder: Decoder.forward with decode rounds replayed from CUDA graphs (CudaOps only).

A decode round of a 36-layer model is ~700 small launches; from Python each costs more than
the kernel itself at batch 1. The first round of each shape (rows, streams) runs eagerly on
a private stream and is then captured (CuPy stream capture records the Numba launches made
on that stream); later rounds of that shape copy their inputs into the graph's static
buffers and replay it. The replay runs the same kernels on the same values, so its logits
are bit-identical to the eager forward's and every gate holds unchanged.

Which rounds: every row wants logits (decode rows, draft verification rows) and there are
at most `max_rows` rows; anything else (prompt steps) runs eagerly. The static block table
is as wide as the arena has pages; attention reads only the entries a row's position needs,
so the zero padding never changes a value.

    round:  check indices (one sync) -> copy into static buffers -> replay -> copy outputs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backend.base import Array
from ..errors import BadInputError
from .decoder import Decoder, ForwardBatch


@dataclass(slots=True)
class _Captured:
    """One captured round: its stream, private memory pool, static inputs and outputs."""

    stream: Any
    pool: Any
    batch: ForwardBatch  # static input buffers
    graph: Any = None
    logits: Array = None
    hidden: Array = None


class GraphDecoder:
    """Same interface as Decoder (config, ops, weights, forward); wraps one Decoder on CudaOps."""

    def __init__(self, decoder: Decoder, *, max_rows: int = 64):
        if decoder.ops.name != "cuda":
            raise BadInputError("CUDA graphs need the cuda device", param="device")
        self.decoder = decoder
        self.config = decoder.config
        self.ops = decoder.ops
        self.weights = decoder.weights
        self.max_rows = max_rows
        self._graphs: dict[tuple[int, ...], _Captured] = {}
        self.num_replays = 0  # rounds served from a graph (tests and benchmarks read it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decoder, name)  # inv_freq, mscale, sm_scale, ...

    def forward(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        """Decoder.forward, replayed from a graph when the round is a decode-shaped one."""
        rows = int(batch.token_ids.shape[0])
        decode_shaped = 0 < rows <= self.max_rows and int(batch.logit_rows.shape[0]) == rows
        if not decode_shaped or batch.seq_lanes is not None:  # recurrent state: not captured
            return self.decoder.forward(batch, kv, kv_scales)
        self._check_indices(batch, kv)
        key = (rows, int(batch.block_table.shape[0]), batch.page_size, id(kv), id(kv_scales))
        captured = self._graphs.get(key)
        if captured is None:
            captured, outputs = self._capture(batch, kv, kv_scales)
            self._graphs[key] = captured
            return outputs
        return self._replay(captured, batch)

    # ------------------------------------------------------------------ replay
    def _replay(self, cap: _Captured, batch: ForwardBatch) -> tuple[Array, Array]:
        xp = self.ops.xp
        caller = xp.cuda.get_current_stream()
        cap.stream.wait_event(caller.record())
        with cap.stream:
            _load(cap.batch, batch)
            cap.graph.launch(cap.stream)
        caller.wait_event(cap.stream.record())
        self.num_replays += 1
        return cap.logits.copy(), cap.hidden.copy()  # the graph's buffers are reused next round

    def _capture(self, batch: ForwardBatch, kv: Array, kv_scales: Array
                 ) -> tuple[_Captured, tuple[Array, Array]]:
        """Run the round eagerly on a private stream and pool (compiles every kernel and sizes
        the pool), then capture the same round; return the capture and the eager outputs."""
        xp = self.ops.xp
        caller = xp.cuda.get_current_stream()
        # A blocking stream: ordered with the legacy default stream the engine uses.
        cap = _Captured(xp.cuda.Stream(non_blocking=False), xp.cuda.MemoryPool(),
                        _static_batch(xp, batch, kv))
        cap.stream.wait_event(caller.record())
        with xp.cuda.using_allocator(cap.pool.malloc), cap.stream, self.ops.unchecked():  # type: ignore[attr-defined]
            _load(cap.batch, batch)
            logits, hidden = self.decoder.forward(cap.batch, kv, kv_scales)
            outputs = (logits.copy(), hidden.copy())
            cap.stream.begin_capture(mode=_relaxed(xp))
            try:
                cap.logits, cap.hidden = self.decoder.forward(cap.batch, kv, kv_scales)
            finally:
                cap.graph = cap.stream.end_capture()
        caller.wait_event(cap.stream.record())
        return cap, outputs

    # ------------------------------------------------------------------ checks
    def _check_indices(self, batch: ForwardBatch, kv: Array) -> None:
        """Every index the captured kernels will use is in range (one reduction, one sync):
        inside the graph nothing is checked."""
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


def _outside(xp: Any, values: Array, high: int) -> Array:
    return xp.any((values < 0) | (values >= high))


def _relaxed(xp: Any) -> Any:
    # Relaxed capture: a pool growing (cudaMalloc) during capture is not an error.
    return getattr(xp.cuda.runtime, "streamCaptureModeRelaxed", None)


def _static_batch(xp: Any, batch: ForwardBatch, kv: Array) -> ForwardBatch:
    """Input buffers of a graph; the block table is as wide as the arena has pages."""
    rows, seqs = batch.token_ids.shape[0], batch.block_table.shape[0]
    max_pages = kv.shape[2] // batch.page_size
    return ForwardBatch(
        token_ids=xp.zeros(rows, xp.int64), positions=xp.zeros(rows, xp.int64),
        slots=xp.zeros(rows, xp.int64), row_seq=xp.zeros(rows, xp.int32),
        block_table=xp.zeros((seqs, max_pages), xp.int32),
        logit_rows=xp.zeros(rows, xp.int64), page_size=batch.page_size)


def _load(static: ForwardBatch, batch: ForwardBatch) -> None:
    """Copy a round's inputs into the static buffers (on the current stream)."""
    for name in ("token_ids", "positions", "slots", "row_seq", "logit_rows"):
        getattr(static, name)[...] = getattr(batch, name)
    width = batch.block_table.shape[1]
    static.block_table[:, :width] = batch.block_table
    static.block_table[:, width:] = 0
