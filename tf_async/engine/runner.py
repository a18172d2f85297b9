"""Runner: turns a RoundPlan into one forward call over the arena and returns logits.

It owns the arena (the KV memory of the engine, allocated once) and is the only place that
touches arrays on the step path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backend.base import Ops
from ..models.decoder import Decoder, ForwardBatch
from .sequence import RoundPlan, RoundResult, SeqRows

KV_DTYPES = ("f32", "bf16", "fp8")


class Arena:
    """KV memory: kv [layers, 2, num_pages * page_size, nkv, hd] plus per-layer fp8 scales."""

    def __init__(self, ops: Ops, decoder: Decoder, *, num_pages: int, page_size: int,
                 kv_dtype: str, kv_scales: np.ndarray | None = None):
        cfg = decoder.config
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.kv = ops.alloc_kv(cfg.num_layers, num_pages * page_size, cfg.num_kv_heads,
                               cfg.head_dim, kv_dtype)
        scales = np.ones((cfg.num_layers, 2), np.float32) if kv_scales is None else kv_scales
        self.kv_scales = ops.asarray(scales.astype(np.float32))
        self.drafter_region = None  # uint8 bytes for drafter areas (engine/area.py), or None

    def add_drafter_region(self, region):  # noqa: ANN001, ANN201 - an Array of uint8
        """Attach the drafter areas' byte region; done once at engine start."""
        assert self.drafter_region is None, "the drafter region is allocated once"
        self.drafter_region = region
        return region

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.drafter_region is None else int(self.drafter_region.nbytes)
        return int(self.kv.nbytes) + extra


class Runner:
    def __init__(self, decoder: Decoder, arena: Arena):
        self.decoder = decoder
        self.ops = decoder.ops
        self.arena = arena
        # Tests set this to raise inside a step for chosen requests (failure injection).
        self.fault_injector: Callable[[SeqRows], None] | None = None

    def zero_pages(self, page_ids: list[int] | tuple[int, ...]) -> None:
        if page_ids:
            ids = self.ops.asarray(np.asarray(page_ids, dtype=np.int32))
            self.ops.zero_pages(self.arena.kv, ids, self.arena.page_size)

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Run the round; if it fails, run each stream alone so one bad request fails alone."""
        self.zero_pages(plan.pages_to_zero)
        try:
            return self._forward(plan.rows, plan.block_tables)
        except Exception as exc:  # noqa: BLE001 - isolate the failing request below
            if len(plan.rows) == 1:
                return RoundResult({}, {}, {plan.rows[0].request_id: _describe(exc)})
        return self._isolate(plan)

    def _isolate(self, plan: RoundPlan) -> RoundResult:
        logits, hidden, failed = {}, {}, {}
        for rows in plan.rows:
            try:
                one = self._forward((rows,), plan.block_tables)
            except Exception as exc:  # noqa: BLE001 - a failed step fails that request only
                failed[rows.request_id] = _describe(exc)
                continue
            logits.update(one.logits)
            hidden.update(one.hidden)
        return RoundResult(logits, hidden, failed)

    def _forward(self, all_rows: tuple[SeqRows, ...], tables: dict[int, tuple[int, ...]]) -> RoundResult:
        if self.fault_injector is not None:
            for rows in all_rows:
                self.fault_injector(rows)
        batch = self._batch(all_rows, tables)
        logits, hidden = self.decoder.forward(batch, self.arena.kv, self.arena.kv_scales)
        logits_h = self.ops.to_host(logits)
        hidden_h = self.ops.to_host(hidden)
        out_l, out_h, start = {}, {}, 0
        for rows in all_rows:
            stop = start + rows.num_logit_rows
            if rows.num_logit_rows:
                out_l[rows.request_id] = logits_h[start:stop]
                out_h[rows.request_id] = hidden_h[start:stop]
            start = stop
        return RoundResult(out_l, out_h, {})

    def _batch(self, all_rows: tuple[SeqRows, ...], tables: dict[int, tuple[int, ...]]) -> ForwardBatch:
        page_size = self.arena.page_size
        lanes = sorted({r.lane for r in all_rows})
        seq_of_lane = {lane: i for i, lane in enumerate(lanes)}
        max_pages = max(1, max(len(tables[lane]) for lane in lanes))
        block_table = np.zeros((len(lanes), max_pages), np.int32)
        for lane in lanes:
            block_table[seq_of_lane[lane], : len(tables[lane])] = tables[lane]
        tokens, positions, row_seq, logit_rows = [], [], [], []
        for rows in all_rows:
            count = len(rows.token_ids)
            base = len(tokens)
            tokens.extend(rows.token_ids)
            positions.extend(range(rows.start_pos, rows.start_pos + count))
            row_seq.extend([seq_of_lane[rows.lane]] * count)
            logit_rows.extend(range(base + count - rows.num_logit_rows, base + count))
        pos = np.asarray(positions, np.int64)
        seq = np.asarray(row_seq, np.int32)
        slots = block_table[seq, pos // page_size].astype(np.int64) * page_size + pos % page_size
        put = self.ops.asarray
        return ForwardBatch(put(np.asarray(tokens, np.int64)), put(pos), put(slots), put(seq),
                            put(block_table), put(np.asarray(logit_rows, np.int64)), page_size)


def _describe(exc: Exception) -> str:
    return f"step failed: {type(exc).__name__}: {exc}"
