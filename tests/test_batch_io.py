"""Packed batches (models/batch_io.py): exact round trips, one upload per batch (pinned ring
with a CuPy stand-in), host index checks of every kind, and GraphDecoder refusing bad
indices from the host copy without touching the device, then loading the static buffer."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tf_async.backend.cpu.ops import CpuOps
from tf_async.errors import BadInputError
from tf_async.models.batch_io import (
    Layout,
    PinnedUploader,
    check_indices,
    pack_batch,
    pack_host,
    upload,
)
from tf_async.models.decoder import ForwardBatch

PAGE = 4


def _random_batch(rng: np.random.Generator, rows: int, seqs: int, width: int, num_logits: int,
                  lanes: bool) -> dict[str, Any]:
    return dict(token_ids=rng.integers(0, 2**40, rows), positions=rng.integers(0, width * PAGE, rows),
                row_seq=rng.integers(0, seqs, rows).astype(np.int32),
                block_table=rng.integers(-2**31, 2**31, (seqs, width), dtype=np.int64).astype(np.int32),
                logit_rows=rng.integers(0, max(rows, 1), num_logits), page_size=PAGE,
                seq_lanes=rng.integers(0, 99, seqs).astype(np.int32) if lanes else None)


@pytest.mark.parametrize("rows,seqs,width,num_logits,lanes", [
    (1, 1, 1, 1, False), (1, 1, 7, 1, False), (5, 3, 5, 2, True), (6, 2, 4, 0, False),
    (3, 3, 9, 3, True), (0, 1, 1, 0, False)])
def test_packing_round_trips_exactly(rows: int, seqs: int, width: int, num_logits: int,
                                     lanes: bool) -> None:
    values = _random_batch(np.random.default_rng(rows * 31 + width), rows, seqs, width, num_logits, lanes)
    layout, host = pack_host(**values)
    assert host.dtype == np.int64 and host.shape == (layout.words,)
    v = layout.views(host)
    pos, seq, table = values["positions"], values["row_seq"], values["block_table"]
    slots = table[seq, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE  # the runner's formula
    expect = dict(token_ids=(values["token_ids"], np.int64), positions=(pos, np.int64),
                  slots=(slots, np.int64), row_seq=(seq, np.int32), block_table=(table, np.int32),
                  logit_rows=(values["logit_rows"], np.int64))
    if lanes:
        expect["seq_lanes"] = (values["seq_lanes"], np.int32)
    else:
        assert v.seq_lanes is None
    for name, (want, dtype) in expect.items():
        got = getattr(v, name)
        assert got.dtype == dtype and got.flags.c_contiguous and got.shape == np.shape(want), name
        assert np.array_equal(got, want), name
        assert np.shares_memory(got, host) or got.size == 0, name
    # the block table is the tail; everything before it is the shared prefix
    assert layout.words - layout.table_offset == (seqs * width + 1) // 2


def test_explicit_slots_are_kept() -> None:
    layout, host = pack_host(token_ids=[1, 2], positions=[0, 1], row_seq=[0, 0],
                             block_table=np.zeros((1, 1), np.int32), logit_rows=[1], page_size=PAGE,
                             slots=[7, 9])
    assert layout.views(host).slots.tolist() == [7, 9]


def test_views_refuse_a_wrong_buffer() -> None:
    layout = Layout(2, 1, 1, 3)
    with pytest.raises(ValueError, match="int64 buffer"):
        layout.views(np.zeros(layout.words + 1, np.int64))
    with pytest.raises(ValueError, match="int64 buffer"):
        layout.views(np.zeros(layout.words, np.int32))


def test_cpu_pack_batch_is_the_host_buffer_with_the_old_bits() -> None:
    """On the CPU the upload is the identity: the fields view the host buffer, and hold what
    the runner's separate arrays held (same dtypes, values, contiguity)."""
    values = _random_batch(np.random.default_rng(5), 6, 2, 3, 2, True)
    batch = pack_batch(CpuOps(), **values)
    assert batch.packed is not None and batch.packed.device is batch.packed.host
    assert batch.packed.describes(batch) and batch.page_size == PAGE
    pos, seq, table = values["positions"], values["row_seq"], values["block_table"]
    old = ForwardBatch(np.asarray(values["token_ids"], np.int64), pos.astype(np.int64),
                       table[seq, pos // PAGE].astype(np.int64) * PAGE + pos % PAGE, seq, table,
                       np.asarray(values["logit_rows"], np.int64), PAGE, values["seq_lanes"])
    for name in ("token_ids", "positions", "slots", "row_seq", "block_table", "logit_rows",
                 "seq_lanes"):
        got, want = getattr(batch, name), getattr(old, name)
        assert got.dtype == want.dtype and got.flags.c_contiguous and np.array_equal(got, want)


def test_a_replaced_field_is_not_described() -> None:
    from dataclasses import replace

    batch = pack_batch(CpuOps(), **_random_batch(np.random.default_rng(1), 2, 1, 2, 1, False))
    assert batch.packed is not None
    assert not batch.packed.describes(replace(batch, token_ids=np.array([1, 2], np.int64)))
    assert not batch.packed.describes(replace(batch, seq_lanes=np.array([0], np.int32)))


# ---------------------------------------------------------------------- uploads
class _FakeDeviceArray(np.ndarray):
    """A 'device' array: records each host-to-device copy (`set`, as on CuPy)."""

    def set(self, arr: np.ndarray, stream: Any = None) -> None:  # noqa: A003
        assert stream is not None  # async on the current stream
        _FakeXp.log.append(("set", arr.ctypes.data, arr.shape[0]))
        self[...] = arr


class _FakeEvent:
    def __init__(self, disable_timing: bool = False) -> None:
        _FakeXp.log.append(("event",))

    def record(self, stream: Any = None) -> None:
        _FakeXp.log.append(("record",))

    def synchronize(self) -> None:
        _FakeXp.log.append(("sync",))


class _FakeXp:
    """The few CuPy calls the uploader makes."""

    int64 = np.int64
    log: list[tuple[Any, ...]] = []

    @staticmethod
    def empty(n: int, dtype: Any) -> _FakeDeviceArray:
        return np.full(n, -1, dtype).view(_FakeDeviceArray)

    cuda = SimpleNamespace(
        Event=_FakeEvent,
        get_current_stream=lambda: "stream",
        alloc_pinned_memory=lambda nbytes: (_FakeXp.log.append(("pin", nbytes)), bytearray(nbytes))[1])


def test_pinned_uploader_one_copy_per_batch_from_reused_buffers() -> None:
    _FakeXp.log = []
    up = PinnedUploader(_FakeXp)
    rng = np.random.default_rng(2)
    hosts = [rng.integers(-5, 5, n) for n in (10, 3, 7, 12, 9, 5, 2000)]
    for host in hosts:
        device = up.put(host)
        assert isinstance(device, _FakeDeviceArray) and np.array_equal(device, host)
    sets = [e for e in _FakeXp.log if e[0] == "set"]
    assert len(sets) == len(hosts)  # one copy per batch
    pins = [e for e in _FakeXp.log if e[0] == "pin"]
    assert len(pins) == PinnedUploader.SLOTS + 1  # one buffer per slot, regrown once for 2000
    assert pins[-1][1] == 2048 * 8
    assert sets[0][1] == sets[PinnedUploader.SLOTS][1]  # slot 0 reused (same pinned address)
    # a slot is reused only after its previous copy's event synchronized
    assert _FakeXp.log.count(("sync",)) == len(hosts) - PinnedUploader.SLOTS
    assert _FakeXp.log.count(("event",)) == PinnedUploader.SLOTS


def test_upload_on_cuda_uses_one_copy_and_views_it() -> None:
    _FakeXp.log = []
    class FakeCudaOps:  # hashable and weak-referable, as CudaOps is
        name, xp = "cuda", _FakeXp

    ops = FakeCudaOps()
    layout, host = pack_host(**_random_batch(np.random.default_rng(3), 4, 2, 3, 4, False))
    batch = upload(ops, layout, host, PAGE)  # type: ignore[arg-type]
    assert [e[0] for e in _FakeXp.log].count("set") == 1
    assert batch.packed is not None and batch.packed.host is host
    assert upload(ops, layout, host, PAGE).packed.device is not batch.packed.device  # type: ignore[arg-type,union-attr]
    assert [e[0] for e in _FakeXp.log].count("event") == 2  # the ops' one uploader, two slots used
    assert isinstance(batch.packed.device, _FakeDeviceArray)
    for name in ("token_ids", "positions", "slots", "row_seq", "block_table", "logit_rows"):
        got, want = getattr(batch, name), getattr(layout.views(host), name)
        assert np.shares_memory(got, batch.packed.device) and np.array_equal(got, want)
        assert got.dtype == want.dtype and got.flags.c_contiguous


# ---------------------------------------------------------------------- host checks
VOCAB, SLOTS = 50, 64  # 16 pages of 4


def _packed(**change: Any) -> tuple[Layout, np.ndarray]:
    """Two streams, three rows; stream 1 at position 9 (pages 0..2 used of width 4)."""
    values: dict[str, Any] = dict(token_ids=[3, 4, 5], positions=[0, 1, 9], row_seq=[0, 0, 1],
                                  block_table=np.array([[1, 0, 0, 0], [2, 3, 4, -1]], np.int32),
                                  logit_rows=[1, 2], page_size=PAGE, slots=[4, 5, 13])
    values.update(change)
    return pack_host(**values)


def _check(packed: tuple[Layout, np.ndarray]) -> None:
    check_indices(*packed, vocab=VOCAB, num_slots=SLOTS, page_size=PAGE)


def test_host_check_passes_a_good_batch() -> None:
    _check(_packed())  # the -1 in stream 1's table is past its position: never read


@pytest.mark.parametrize("kind,change", [
    ("token_ids", dict(token_ids=[3, VOCAB, 5])), ("token_ids", dict(token_ids=[3, -1, 5])),
    ("slots", dict(slots=[4, SLOTS, 13])), ("slots", dict(slots=[-1, 5, 13])),
    ("row_seq", dict(row_seq=[0, 2, 1], slots=[4, 5, 13])), ("row_seq", dict(row_seq=[0, -1, 1], slots=[4, 5, 13])),
    ("positions", dict(positions=[0, 1, 16], slots=[4, 5, 13])),
    ("positions", dict(positions=[-1, 1, 9], slots=[4, 5, 13])),
    ("logit_rows", dict(logit_rows=[1, 3])), ("logit_rows", dict(logit_rows=[-1])),
    ("block_table", dict(positions=[0, 1, 12], slots=[4, 5, 13])),  # needs stream 1's -1 entry
    ("block_table", dict(block_table=np.array([[16, 0, 0, 0], [2, 3, 4, 5]], np.int32))),
])
def test_host_check_catches_each_kind(kind: str, change: dict[str, Any]) -> None:
    with pytest.raises(BadInputError, match=rf"out of range \({kind};"):
        _check(_packed(**change))


# ---------------------------------------------------------------------- GraphDecoder
class _Untouchable:
    """An xp that fails the test when the graph decoder touches the device."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"device touched: xp.{name}")


def _graph_decoder() -> Any:
    from tf_async.backend.base import Capabilities
    from tf_async.models.graph_decoder import GraphDecoder

    ops = SimpleNamespace(name="cuda", xp=_Untouchable(), device_checks=True,
                          capabilities=Capabilities(cuda_graphs=True))
    weights = SimpleNamespace(embed=SimpleNamespace(out_features=VOCAB))
    decoder = SimpleNamespace(ops=ops, config=None, weights=weights)
    return GraphDecoder(decoder)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind,change", [
    ("token_ids", dict(token_ids=[VOCAB])), ("slots", dict(slots=[SLOTS])),
    ("row_seq", dict(row_seq=[1])), ("positions", dict(positions=[16], slots=[0])),
    ("block_table", dict(positions=[5], slots=[0])), ("logit_rows", dict(logit_rows=[1]))])
def test_graph_decoder_refuses_bad_indices_on_the_host(kind: str, change: dict[str, Any]) -> None:
    values: dict[str, Any] = dict(token_ids=[3], positions=[2], row_seq=[0],
                                  block_table=np.array([[1, 99, 0, 0]], np.int32), logit_rows=[0],
                                  page_size=PAGE, slots=[6])
    values.update(change)
    batch = pack_batch(CpuOps(), **values)  # host arrays stand in for device ones
    kv = np.zeros((1, 2, SLOTS, 1, 1), np.float32)
    graphed = _graph_decoder()
    with pytest.raises(BadInputError, match=rf"out of range \({kind};"):
        graphed.forward(batch, kv, np.ones((1, 2), np.float32))
    assert graphed.num_replays == 0 and not graphed._graphs


def test_graph_decoder_leaves_the_check_to_a_caller_that_ran_it() -> None:
    """Inside ops.unchecked() (the runner checked the round on the host) the graph decoder
    does not check the same indices again: it goes straight to the device."""
    batch = pack_batch(CpuOps(), token_ids=[VOCAB], positions=[2], row_seq=[0],
                       block_table=np.array([[1, 99, 0, 0]], np.int32), logit_rows=[0],
                       page_size=PAGE, slots=[6])
    kv = np.zeros((1, 2, SLOTS, 1, 1), np.float32)
    graphed = _graph_decoder()
    graphed.ops.device_checks = False
    with pytest.raises(AssertionError, match="device touched"):
        graphed.forward(batch, kv, np.ones((1, 2), np.float32))


def test_graph_decoder_captures_at_most_max_graphs_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past max_graphs captured shapes a new shape runs eagerly (each shape keeps its own
    memory pool); the shapes already captured still replay."""
    graphed = _graph_decoder()
    graphed.ops.device_checks = False
    graphed.max_graphs = 2
    calls: list[str] = []
    graphed.decoder.forward = lambda batch, kv, scales, **kw: calls.append("eager") or ("logits", "hidden")
    monkeypatch.setattr(graphed, "_capture", lambda batch, kv, scales, layers: (
        calls.append("capture") or "cap", ("logits", "hidden")))
    monkeypatch.setattr(graphed, "_replay", lambda cap, batch: calls.append("replay") or ("logits", "hidden"))
    kv = np.zeros((1, 2, SLOTS, 1, 1), np.float32)
    scales = np.ones((1, 2), np.float32)  # one array: the shape key holds the cache's ids

    def round_of(rows: int) -> ForwardBatch:
        return pack_batch(CpuOps(), token_ids=[3] * rows, positions=[2] * rows, row_seq=list(range(rows)),
                          block_table=np.zeros((rows, 4), np.int32), logit_rows=list(range(rows)),
                          page_size=PAGE, slots=[6] * rows)

    for rows in (1, 2, 3, 1, 3, 2):
        graphed.forward(round_of(rows), kv, scales)
    assert calls == ["capture", "capture", "eager", "replay", "eager", "replay"]
    assert len(graphed._graphs) == 2


@pytest.mark.parametrize("capture_verify", [False, True])
def test_graph_decoder_serves_every_row_hidden_only_when_every_row_is_a_logit_row(
        monkeypatch: pytest.MonkeyPatch, capture_verify: bool) -> None:
    """forward(all_hidden=True) (the MTP drafter's rounds) goes to the graph only with
    CAPTURE_VERIFY_ROUNDS on and every row a logit row in order (the graph's hidden rows are
    then every row's); else it runs eagerly, asking for every row's hidden."""
    from tf_async.models import graph_decoder

    monkeypatch.setattr(graph_decoder, "CAPTURE_VERIFY_ROUNDS", capture_verify)
    graphed = _graph_decoder()
    graphed.ops.device_checks = False
    calls: list[tuple[str, bool]] = []
    graphed.decoder.forward = lambda batch, kv, scales, all_hidden=False: (
        calls.append(("eager", all_hidden)) or ("logits", "hidden"))
    monkeypatch.setattr(graphed, "_capture", lambda batch, kv, scales, layers: (
        calls.append(("capture", False)) or "cap", ("logits", "hidden")))
    kv = np.zeros((1, 2, SLOTS, 1, 1), np.float32)
    scales = np.ones((1, 2), np.float32)
    graphed.forward(_two_rows([0, 1]), kv, scales, all_hidden=True)
    graphed.forward(_two_rows([1]), kv, scales, all_hidden=True)
    first = ("capture", False) if capture_verify else ("eager", True)
    assert calls == [first, ("eager", True)]


def _two_rows(logit_rows: list[int], layers: tuple[int, ...] = ()) -> ForwardBatch:
    batch = pack_batch(CpuOps(), token_ids=[3, 4], positions=[2, 3], row_seq=[0, 0],
                       block_table=np.zeros((1, 4), np.int32), logit_rows=logit_rows,
                       page_size=PAGE, slots=[6, 7])
    return replace(batch, capture_layers=layers)


@pytest.mark.parametrize("capture_verify", [False, True])
def test_graph_decoder_captures_rounds_that_hand_out_layers(
        monkeypatch: pytest.MonkeyPatch, capture_verify: bool) -> None:
    """forward(all_hidden=True) of a round with capture_layers (the DFlash drafter's rounds)
    goes to a graph captured with those layers (one a set of layers, then replayed) when
    CAPTURE_VERIFY_ROUNDS is on and every row is a logit row; a prompt-shaped round, or any
    with the flag off, runs eagerly with every row's layers."""
    from tf_async.models import graph_decoder

    monkeypatch.setattr(graph_decoder, "CAPTURE_VERIFY_ROUNDS", capture_verify)
    graphed = _graph_decoder()
    graphed.ops.device_checks = False
    calls: list[Any] = []
    graphed.decoder.forward = lambda batch, kv, scales, all_hidden=False: (
        calls.append(("eager", batch.capture_layers, all_hidden)) or ("logits", "hidden"))
    monkeypatch.setattr(graphed, "_capture", lambda batch, kv, scales, layers: (
        calls.append(("capture", layers)) or "cap", ("logits", "hidden")))
    monkeypatch.setattr(graphed, "_replay", lambda cap, batch: calls.append("replay") or ("logits", "hidden"))
    kv = np.zeros((1, 2, SLOTS, 1, 1), np.float32)
    scales = np.ones((1, 2), np.float32)
    for logit_rows, layers in (([0, 1], (1, 3)), ([0, 1], (1, 3)), ([0, 1], (2,)), ([1], (1, 3))):
        graphed.forward(_two_rows(logit_rows, layers), kv, scales, all_hidden=True)
    if capture_verify:
        assert calls == [("capture", (1, 3)), "replay", ("capture", (2,)), ("eager", (1, 3), True)]
        assert graphed.num_feature_replays == 1
    else:
        assert calls == [("eager", (1, 3), True)] * 2 + [("eager", (2,), True), ("eager", (1, 3), True)]


def _captured(batch: ForwardBatch, max_pages: int) -> Any:
    from tf_async.models.graph_decoder import _Captured, _static_batch

    kv = np.zeros((1, 2, max_pages * PAGE, 1, 1), np.float32)
    layout, buffer, static = _static_batch(np, batch, kv)
    buffer[...] = 7  # stale values of an earlier round
    return _Captured(None, None, layout, buffer, static)


@pytest.mark.parametrize("seqs,width", [(1, 3), (1, 4), (3, 2), (2, 5)])
@pytest.mark.parametrize("packed", [True, False])
def test_graph_static_buffer_loads_the_round(seqs: int, width: int, packed: bool) -> None:
    from tf_async.models.graph_decoder import _load

    rng = np.random.default_rng(seqs * 10 + width)
    rows = seqs
    table = rng.integers(0, 8, (seqs, width)).astype(np.int32)
    values = dict(token_ids=rng.integers(0, VOCAB, rows), positions=rng.integers(0, width * PAGE, rows),
                  row_seq=np.arange(rows, dtype=np.int32), block_table=table,
                  logit_rows=np.arange(rows), page_size=PAGE)
    batch = pack_batch(CpuOps(), **values)
    if not packed:  # separate arrays: the array-by-array fallback
        batch = ForwardBatch(*(getattr(batch, f).copy() for f in
                               ("token_ids", "positions", "slots", "row_seq", "block_table",
                                "logit_rows")), PAGE)
    cap = _captured(batch, max_pages=8)
    _load(np, cap, batch)
    for name in ("token_ids", "positions", "slots", "row_seq", "logit_rows"):
        assert np.array_equal(getattr(cap.batch, name), getattr(batch, name)), name
    assert np.array_equal(cap.batch.block_table[:, :width], table)


class _Pointer:
    """A CuPy-like MemoryPointer over a NumPy buffer (`+ bytes` moves it)."""

    def __init__(self, buf: np.ndarray, offset: int = 0) -> None:
        self.buf, self.offset = buf, offset

    def __add__(self, nbytes: int) -> _Pointer:
        return _Pointer(self.buf, self.offset + nbytes)


def test_device_views_are_arrays_at_offsets_of_the_buffer() -> None:
    """The device path of Layout.views (xp.ndarray(shape, dtype, memptr=...)) gives the same
    arrays as the NumPy path."""
    class Buffer:  # a device buffer: shape, dtype and .data, as a cupy.ndarray
        def __init__(self, host: np.ndarray) -> None:
            self.shape, self.dtype, self.data = host.shape, host.dtype, _Pointer(host)

    xp = SimpleNamespace(ndarray=lambda shape, dtype, memptr: np.ndarray(
        shape, dtype, buffer=memptr.buf, offset=memptr.offset))
    layout, host = pack_host(**_random_batch(np.random.default_rng(9), 5, 3, 3, 2, True))
    with pytest.raises(ValueError, match="need its module"):
        layout.views(Buffer(host))
    device, plain = layout.views(Buffer(host), xp), layout.views(host)
    for got, want in zip(device, plain, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert np.shares_memory(got, host)
