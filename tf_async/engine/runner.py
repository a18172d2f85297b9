"""Runner: turns a RoundPlan into one forward call over the arena and returns logits, or
the tokens themselves where the ops choose them on the device.

It owns the arena (the KV memory of the engine, allocated once) and is the only place that
touches arrays on the step path. Hybrid models also keep each lane's recurrent state (the
decoder's RecurrentStates, one slot per lane): the runner zeroes a lane's slot where it
zeroes the run's new pages, freezes the slot of every lane that verifies drafts for the
forward (its rows stashed), and commits it over the accepted rows at the start of the next
round (plan.state_commits).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import numpy as np

from ..backend.base import Array, DeviceSampler, Ops, device_sampler
from ..models.batch_io import NO_PAGE, ForwardBatch, check_indices, pack_batch, packed_of
from ..models.protocol import DecoderProtocol
from ..models.qwen35 import LaneStates
from ..models.tp_decoder import RankGroup
from .choice import choice_arrays, choose_on_device, choose_on_host
from .sequence import RoundPlan, RoundResult, SeqRows, TokenChoice


class Arena:
    """KV memory: kv [layers, 2, num_pages * page_size, nkv, hd] plus per-layer fp8 scales."""

    def __init__(self, ops: Ops, decoder: DecoderProtocol, *, num_pages: int, page_size: int,
                 kv_dtype: str, kv_scales: np.ndarray | None = None,
                 split: RankGroup | None = None):
        cfg = decoder.config
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        # Tensor parallel: the KV split by heads over the ranks (a ShardedKV), same page ids.
        self.split = split
        self.kv: Array = (ops.alloc_kv(cfg.num_layers, num_pages * page_size, cfg.num_kv_heads,
                                         cfg.head_dim, kv_dtype) if split is None
                            else split.alloc_kv(num_pages * page_size, kv_dtype))
        scales = np.ones((cfg.num_layers, 2), np.float32) if kv_scales is None else kv_scales
        self.kv_scales = ops.asarray(scales.astype(np.float32))
        self.drafter_region = None  # uint8 bytes for drafter areas (engine/area.py), or None
        self.drafter_page_bytes = 0  # MTP slots kept beside the pages (drafters/page_slots.py)

    def add_drafter_region(self, region: Array) -> Array:  # region: [bytes] uint8
        """Attach the drafter areas' byte region; done once at engine start."""
        assert self.drafter_region is None, "the drafter region is allocated once"
        self.drafter_region = region
        return region

    def add_drafter_pages(self, num_bytes: int) -> None:
        """Count the drafter's memory kept beside the pages (allocated once, at start)."""
        self.drafter_page_bytes += num_bytes

    @property
    def num_bytes(self) -> int:
        extra = 0 if self.drafter_region is None else int(self.drafter_region.nbytes)
        return int(self.kv.nbytes) + extra + self.drafter_page_bytes


class Runner:
    def __init__(self, decoder: DecoderProtocol, arena: Arena):
        self.decoder = decoder
        self.ops = decoder.ops
        self.arena = arena
        self.states: LaneStates | None = decoder.states
        self.all_hidden = False  # drafters that sync every row (MTP) set it: hidden of all rows
        # with all_hidden: these target layers' outputs instead of the final-normed rows (DFlash)
        self.capture_layers: tuple[int, ...] = ()
        self._state_touched = False  # the decoder's forward ran (recurrent state may be advanced)
        # Tests set this to raise inside a step for chosen requests (failure injection).
        self.fault_injector: Callable[[SeqRows], None] | None = None
        # Ops that choose tokens where the logits are (CUDA): rows with `choices` send only
        # token ids to the host. None (CPU): every logit row goes to the host sampler.
        self.sampler: DeviceSampler | None = device_sampler(self.ops)
        # a drafter that keeps rows beside the pages copies them with the KV (DFlash)
        self.on_page_copies: Callable[[tuple[tuple[int, int, int], ...]], None] | None = None

    def zero_pages(self, page_ids: list[int] | tuple[int, ...]) -> None:
        if not page_ids:
            return
        split = self.arena.split
        if split is not None:  # every rank's heads of those pages
            split.zero_pages(self.arena.kv, np.asarray(page_ids, dtype=np.int32), self.arena.page_size)
            return
        ids = self.ops.asarray(np.asarray(page_ids, dtype=np.int32))
        self.ops.zero_pages(self.arena.kv, ids, self.arena.page_size)

    def copy_rows(self, copies: tuple[tuple[int, int, int], ...]) -> None:
        """Rows [0, rows) of page `source` into page `page`, every layer (prefix cache: the
        partial last page of a shared prefix). Bytes as stored: same KV dtype and scales."""
        size, kv, split = self.arena.page_size, self.arena.kv, self.arena.split
        for source, page, num_rows in copies:
            target_rows = slice(page * size, page * size + num_rows)
            source_rows = slice(source * size, source * size + num_rows)
            if split is not None:
                split.copy_rows(kv, source_rows, target_rows)
            else:
                kv[:, :, target_rows] = kv[:, :, source_rows]
        if copies and self.on_page_copies is not None:
            self.on_page_copies(copies)

    def prepare_lanes(self, plan: RoundPlan) -> None:
        """Lanes that verified drafts last round advance over their accepted rows first; then
        kept states are copied out; newly opened lanes start from zero state (after the
        commits and keeps: a lane released and opened again is zeroed), or from a kept state
        when they resume a cached prefix. Engine stream."""
        if self.states is None:
            return
        self.decoder.commit_states(plan.state_commits)
        for lane, slot in plan.states_to_keep:  # before zeroes and resumes change those lanes
            self.states.keep(lane, slot)
        for lane in plan.lanes_to_zero:
            self.states.zero(lane)
        for slot, lane in plan.states_to_resume:  # resumed streams: a kept state, not zero
            self.states.resume(slot, lane)

    def freeze_states(self, all_rows: tuple[SeqRows, ...]) -> tuple[int, ...]:
        """Freeze the state of every lane that verifies drafts for this round: its rows run
        from a copy and are stashed; the next plan commits the accepted ones."""
        if self.states is None:
            return ()
        lanes = tuple(sorted({r.lane for r in all_rows if r.draft_ids}))
        self.states.freeze(lanes)
        return lanes

    def _plan_stash(self, all_rows: tuple[SeqRows, ...]) -> None:
        """Where this forward's frozen rows go in the stash: (lane, first row, rows) each."""
        if self.states is None:
            return
        runs, row = [], 0
        for rows in all_rows:
            if rows.draft_ids:
                runs.append((rows.lane, row, len(rows.token_ids)))
            row += len(rows.token_ids)
        self.states.plan_stash(runs, row)

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Run the round; if it fails, run each stream alone so one bad request fails alone."""
        self.prepare_lanes(plan)
        self.zero_pages(plan.pages_to_zero)
        self.copy_rows(plan.page_copies)
        frozen = self.freeze_states(plan.rows)
        self._state_touched = False
        try:
            if plan.steps > 1:
                return self._forward_steps(plan.rows, plan.block_tables, plan.steps)
            return self._forward(plan.rows, plan.block_tables)
        except Exception as exc:  # noqa: BLE001 - isolate the failing request below
            if len(plan.rows) == 1:
                return RoundResult({}, {}, {plan.rows[0].request_id: _describe(exc)})
        return self._isolate(plan, frozen)

    def _lost_states(self, plan: RoundPlan, frozen: tuple[int, ...]) -> dict[int, str]:
        """After a hybrid forward failed midway: frozen lanes' state is as it was before the
        round; the others' is lost, so those streams fail too (never a silently wrong stream)."""
        if self.states is None or not self._state_touched:
            return {}
        return {r.request_id: "step failed: the batch failed and the stream's recurrent state "
                "was lost with it" for r in plan.rows if r.lane not in frozen}

    def _isolate(self, plan: RoundPlan, frozen: tuple[int, ...] = ()) -> RoundResult:
        logits: dict[int, np.ndarray] = {}
        hidden: dict[int, Any] = {}
        tokens: dict[int, list[int]] = {}
        failed = self._lost_states(plan, frozen)
        for rows in plan.rows:
            if rows.request_id in failed:
                continue
            try:
                one = self._forward((rows,), plan.block_tables)
            except Exception as exc:  # noqa: BLE001 - a failed step fails that request only
                failed[rows.request_id] = _describe(exc)
                continue
            logits.update(one.logits)
            hidden.update(one.hidden)
            tokens.update(one.tokens)
        return RoundResult(logits, hidden, failed, tokens)

    def _forward(self, all_rows: tuple[SeqRows, ...], tables: dict[int, tuple[int, ...]]) -> RoundResult:
        if self.fault_injector is not None:
            for rows in all_rows:
                self.fault_injector(rows)
        batch = self._batch(all_rows, tables)
        if self.capture_layers:  # the same index arrays: still the packed buffer's views
            batch = replace(batch, capture_layers=self.capture_layers)
        self._plan_stash(all_rows)
        self._state_touched = True
        with self._host_checked(batch):
            logits, hidden = self.decoder.forward(batch, self.arena.kv, self.arena.kv_scales,
                                                  all_hidden=self.all_hidden)
        host, tokens = self._choose(all_rows, logits)
        return self._split(all_rows, host, tokens, hidden, every_row=self.all_hidden)

    def _forward_steps(self, all_rows: tuple[SeqRows, ...], tables: dict[int, tuple[int, ...]],
                       steps: int) -> RoundResult:
        """Decode steps (RoundPlan.steps): `steps` forwards in a row over the same streams, one
        row each; step k's token of each row is the one chosen at step k - 1, copied where it
        was chosen (on the GPU: device to device, so the steps run back to back with no host
        round trip); every step's batch is packed and uploaded first, and the chosen ids of
        all steps come to the host in one copy at the end."""
        if self.fault_injector is not None:
            for rows in all_rows:
                self.fault_injector(rows)
        self._plan_stash(all_rows)  # none: decode steps carry no drafts
        step_rows = [_rows_at_step(all_rows, k) for k in range(steps)]
        batches = [self._batch(rows, tables) for rows in step_rows]
        # Seeded rows: every step's sampler arrays uploaded now, none between the steps.
        seeded = self.sampler is not None and not all(r.choices[0].greedy for r in all_rows)
        uploads = [choice_arrays(self.ops, [r.choices[0] for r in rows]) if seeded else None
                   for rows in step_rows]
        chosen: list[Any] = []
        for step, batch, uploaded in zip(step_rows, batches, uploads, strict=True):
            if chosen:
                batch.token_ids[...] = chosen[-1]  # the previous step's choices, in row order
            self._state_touched = True
            with self._host_checked(batch):
                logits, _ = self.decoder.forward(batch, self.arena.kv, self.arena.kv_scales)
            chosen.append(self._choose_each(step, logits, uploaded))
        ids = self.ops.to_host(self.ops.xp.stack(chosen))  # [steps, rows]
        return RoundResult({}, {}, {}, {r.request_id: ids[:, i].tolist() for i, r in enumerate(all_rows)})

    def _choose_each(self, all_rows: tuple[SeqRows, ...], logits: Any, uploaded: tuple[Any, ...] | None) -> Any:
        """The token of each row (one logit row each, all with a choice) where its logits are:
        on the device with a sampler (no copy to the host), else on the host exactly as the
        scheduler would sample it (choice.choose_on_host). -> [rows] int64 on the ops' device."""
        choices = [rows.choices[0] for rows in all_rows]
        if self.sampler is None:
            host = self.ops.to_host(logits)
            return self.ops.asarray(np.asarray([choose_on_host(host[i], c) for i, c in enumerate(choices)],
                                               np.int64))
        return self._on_device(logits, choices, uploaded)

    def _on_device(self, logits: Any, choices: list[TokenChoice], uploaded: tuple[Any, ...] | None = None) -> Any:
        """The chosen ids [rows] (device) of logits [rows, V]: the graph's own argmax when the
        decoder replayed them and every row is greedy (GraphDecoder), else one launch."""
        assert self.sampler is not None
        greedy = self.decoder.argmax_of(logits) if all(c.greedy for c in choices) else None
        return greedy if greedy is not None else choose_on_device(self.ops, self.sampler, logits, choices,
                                                                  uploaded)

    def _host_checked(self, batch: ForwardBatch) -> AbstractContextManager[Any]:
        """Check the round's indices once, on the packed host copy (NumPy, no device work),
        and run the forward without the backend's per-op index checks (on the GPU each is a
        host sync, on the CPU a kernel call: a few per layer). A batch without a host copy
        keeps the per-op checks."""
        packed = packed_of(batch)
        if not self.ops.capabilities.round_checks or packed is None:
            return nullcontext()
        check_indices(packed.layout, packed.host, vocab=self.decoder.weights.embed.out_features,
                      num_slots=int(self.arena.kv.shape[2]), page_size=batch.page_size)
        return self.ops.unchecked()

    def _choose(self, all_rows: tuple[SeqRows, ...], logits: Any,
                ) -> tuple[dict[int, np.ndarray], dict[int, list[int]]]:
        """Logits [logit rows, V] (device) -> (host logits of the requests sampled on the host,
        tokens chosen on the device for the requests with `choices`). One device launch
        over the device rows; only their int64 ids, and the host rows' logits, are copied."""
        spans: list[tuple[SeqRows, int]] = []  # (rows, first logit row) of each sampling request
        start = 0
        for rows in all_rows:
            if rows.num_logit_rows:
                spans.append((rows, start))
            start += rows.num_logit_rows
        sampler = self.sampler
        on_device = [(r, s) for r, s in spans if r.choices] if sampler is not None else []
        if not spans:  # only prompt rows before their last (no logits wanted): nothing to copy
            return {}, {}
        if not on_device:  # CPU, or no request can skip the host: today's path, bit for bit
            host = self.ops.to_host(logits)
            return {r.request_id: host[s: s + r.num_logit_rows] for r, s in spans}, {}
        rows = self._take(logits, _row_ids(on_device))
        chosen = self.ops.to_host(self._on_device(rows, [c for r, _ in on_device for c in r.choices]))
        tokens = {r.request_id: ids.tolist() for r, ids in _per_request(on_device, chosen)}
        on_host = [(r, s) for r, s in spans if r.request_id not in tokens]
        if not on_host:
            return {}, tokens
        host = self.ops.to_host(self._take(logits, _row_ids(on_host)))
        return {r.request_id: rows for r, rows in _per_request(on_host, host)}, tokens

    def _take(self, logits: Any, ids: list[int]) -> Any:
        """Rows `ids` (ascending) of the device logits: a view when they are one run (all of
        them in the common case), else one gather."""
        if ids == list(range(ids[0], ids[0] + len(ids))):
            return logits if len(ids) == logits.shape[0] else logits[ids[0]: ids[0] + len(ids)]
        return logits[self.ops.asarray(np.asarray(ids, np.int64))]

    @staticmethod
    def _split(all_rows: tuple[SeqRows, ...], logits: dict[int, np.ndarray],
               tokens: dict[int, list[int]], hidden: Any, *, every_row: bool = False) -> RoundResult:
        """Per request: its host logit rows or its device-chosen tokens, and its hidden rows
        (on the device: the logit rows, or every row when `every_row`)."""
        out_h: dict[int, Any] = {}
        start = row = 0
        for rows in all_rows:
            stop = start + rows.num_logit_rows
            if every_row:
                out_h[rows.request_id] = hidden[row: row + len(rows.token_ids)]
            elif rows.num_logit_rows:
                out_h[rows.request_id] = hidden[start:stop]
            start, row = stop, row + len(rows.token_ids)
        return RoundResult(logits, out_h, {}, tokens)

    def memory_stats(self) -> dict[str, int]:
        """Bytes of the arena and of each lane's recurrent state (live + verify stash)."""
        states = self.states
        return {"kv_bytes": int(self.arena.kv.nbytes),
                "arena_bytes": self.arena.num_bytes + (0 if states is None else states.num_bytes),
                "recurrent_state_bytes_per_lane": 0 if states is None else states.bytes_per_lane,
                "recurrent_stash_bytes_per_lane":
                    0 if states is None else states.stash_bytes_per_lane,
                "prefix_state_bytes":
                    0 if states is None else states.num_prefix_slots * states.bytes_per_lane}

    def _batch(self, all_rows: tuple[SeqRows, ...], tables: dict[int, tuple[int, ...]]) -> ForwardBatch:
        page_size = self.arena.page_size
        lanes = sorted({r.lane for r in all_rows})
        seq_of_lane = {lane: i for i, lane in enumerate(lanes)}
        max_pages = max(1, max(len(tables[lane]) for lane in lanes))
        # Padding past a lane's own pages is NO_PAGE, never a page: a row at a position its
        # lane holds no page for fails the index checks instead of reading page 0.
        block_table = np.full((len(lanes), max_pages), NO_PAGE, np.int32)
        for lane in lanes:
            block_table[seq_of_lane[lane], : len(tables[lane])] = tables[lane]
        tokens: list[int] = []
        positions: list[int] = []
        row_seq: list[int] = []
        logit_rows: list[int] = []
        for rows in all_rows:
            count = len(rows.token_ids)
            base = len(tokens)
            tokens.extend(rows.token_ids)
            positions.extend(range(rows.start_pos, rows.start_pos + count))
            row_seq.extend([seq_of_lane[rows.lane]] * count)
            logit_rows.extend(range(base + count - rows.num_logit_rows, base + count))
        # One upload: the arrays packed in one buffer, the batch's fields views of it.
        return pack_batch(self.ops, token_ids=tokens, positions=positions, row_seq=row_seq,
                          block_table=block_table, logit_rows=logit_rows, page_size=page_size,
                          seq_lanes=self._seq_lanes(lanes))


    def _seq_lanes(self, lanes: list[int]) -> np.ndarray | None:
        """Block-table row -> lane (host; packed with the batch), for models with per-lane
        recurrent state only (a dense round without it can be replayed from a CUDA graph)."""
        if self.decoder.states is None:
            return None
        return np.asarray(lanes, np.int32)


def _rows_at_step(all_rows: tuple[SeqRows, ...], k: int) -> tuple[SeqRows, ...]:
    """The rows of decode step k: each stream one position further, choosing for the next
    position (its token is fed from step k - 1 on the device; the host copy keeps step 0's)."""
    if k == 0:
        return all_rows
    return tuple(replace(rows, start_pos=rows.start_pos + k,
                         choices=(replace(rows.choices[0], position=rows.choices[0].position + k),))
                 for rows in all_rows)


def _row_ids(spans: list[tuple[SeqRows, int]]) -> list[int]:
    """The logit rows of `spans` ((rows, first logit row) each), in order."""
    return [start + i for rows, start in spans for i in range(rows.num_logit_rows)]


def _per_request(spans: list[tuple[SeqRows, int]], values: Any) -> list[tuple[SeqRows, Any]]:
    """values (one entry per row of _row_ids(spans)) cut into each request's rows."""
    out, at = [], 0
    for rows, _ in spans:
        out.append((rows, values[at: at + rows.num_logit_rows]))
        at += rows.num_logit_rows
    return out


def _describe(exc: Exception) -> str:
    return f"step failed: {type(exc).__name__}: {exc}"
