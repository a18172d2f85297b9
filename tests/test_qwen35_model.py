"""Qwen3.5 hybrids on the CPU backend: tiny qwen3_5 / qwen3_5_moe checkpoints (HF and MLX)
load, match the float64 reference, and keep the gates bit for bit: stepped == whole,
concurrent == solo, snapshot/restore + recompute == plain decoding; the MTP head matches the
reference MTP; bad files raise ModelFormatError naming file and tensor."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from tests import reference_qwen35 as ref
from tests import tiny_qwen35 as tq
from tf_async.backend.cpu.ops import CpuOps
from tf_async.errors import BadInputError, ModelFormatError
from tf_async.models.decoder import Decoder, ForwardBatch
from tf_async.models.loader import load_checkpoint, make_decoder
from tf_async.models.mtp import MtpHead, make_mtp_head
from tf_async.models.qwen35 import HybridDecoder, RecurrentStates

PAGE = 4
NUM_PAGES = 12
PROMPT = [5, 17, 200, 33, 9, 41, 300, 7, 12, 250, 3, 77, 18, 64, 2, 140, 9, 31, 5, 222, 13, 8, 90]
VARIANTS = {  # name: (moe, writer kwargs)
    "dense-hf-bf16": (False, {"kind": "hf", "dtype": "bf16"}),
    "dense-mlx8": (False, {"kind": "mlx", "bits": 8}),
    "moe-hf-f32-flat-per-expert-mtp": (True, {"kind": "hf", "dtype": "f32", "nested": False,
                                              "per_expert_mtp": True}),
    "moe-mlx4": (True, {"kind": "mlx", "bits": 4}),
}


@dataclass
class Model:
    cfg: dict
    effective: dict  # HF-named float weights the files decode to
    path: Path
    decoder: HybridDecoder


def write_variant(folder: Path, moe: bool, kind: str, **kw) -> tuple[dict, dict, Path]:
    cfg = tq.tiny_qwen35_config(moe=moe)
    weights = tq.random_qwen35_weights(cfg, seed=11 if moe else 7)
    if kind == "hf":
        dtype = kw.pop("dtype")
        path = tq.write_qwen35_hf(folder, cfg, weights, dtype, **kw)
        return cfg, tq.hf_effective_weights(weights, dtype), path
    bits = kw.pop("bits")
    path = tq.write_qwen35_mlx(folder, cfg, weights, bits, 32, **kw)
    return cfg, tq.mlx_effective_weights(weights, bits, 32), path


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory) -> Model:
    moe, kw = VARIANTS[request.param]
    cfg, effective, path = write_variant(tmp_path_factory.mktemp(request.param), moe, **dict(kw))
    # float32 x: the float64 references' arithmetic (int8 x: the gate tests and test_cpu_kernels)
    decoder = make_decoder(load_checkpoint(path), CpuOps(int8_x=False), num_lanes=4)
    assert isinstance(decoder, HybridDecoder)
    return Model(cfg, effective, path, decoder)


# ---------------------------------------------------------------------------------------
# running rows: each entry is one stream's rows (pages, lane, tokens, start_pos)


@dataclass
class Rows:
    pages: list[int]
    lane: int
    tokens: list[int]
    start_pos: int


def new_kv(decoder: HybridDecoder) -> np.ndarray:
    cfg = decoder.config
    return decoder.ops.alloc_kv(cfg.num_layers, NUM_PAGES * PAGE, cfg.num_kv_heads, cfg.head_dim,
                                "f32")


def run_round(decoder: HybridDecoder, kv: np.ndarray, entries: list[Rows]) -> list[np.ndarray]:
    """One forward over the rows of several streams; logits of every row, per entry."""
    table = np.zeros((len(entries), NUM_PAGES), np.int32)
    tokens, pos, row_seq = [], [], []
    for seq, rows in enumerate(entries):
        table[seq, :len(rows.pages)] = rows.pages
        tokens += rows.tokens
        pos += range(rows.start_pos, rows.start_pos + len(rows.tokens))
        row_seq += [seq] * len(rows.tokens)
    pos_arr, seq_arr = np.asarray(pos, np.int64), np.asarray(row_seq, np.int32)
    slots = table[seq_arr, pos_arr // PAGE].astype(np.int64) * PAGE + pos_arr % PAGE
    batch = ForwardBatch(np.asarray(tokens, np.int64), pos_arr, slots, seq_arr, table,
                         np.arange(len(tokens), dtype=np.int64), PAGE,
                         np.asarray([r.lane for r in entries], np.int32))
    logits, _ = decoder.forward(batch, kv, np.ones((decoder.config.num_layers, 2), np.float32))
    out, start = [], 0
    for rows in entries:
        out.append(logits[start:start + len(rows.tokens)].copy())
        start += len(rows.tokens)
    return out


SCATTERED = [7, 2, 9, 0, 11, 4, 1, 8, 3, 10]  # pages out of order (40 rows)


def run_cuts(decoder: HybridDecoder, tokens: list[int], cuts: list[int], lane: int = 0
             ) -> np.ndarray:
    decoder.states.zero(lane)
    kv, out, start = new_kv(decoder), [], 0
    for size in cuts:
        out += run_round(decoder, kv, [Rows(SCATTERED, lane, tokens[start:start + size], start)])
        start += size
    return np.concatenate(out)


def cuts_of(total: int, step: int) -> list[int]:
    return [min(step, total - s) for s in range(0, total, step)]


def lane_state(decoder: HybridDecoder, lane: int) -> tuple[np.ndarray, np.ndarray]:
    return decoder.states.conv[:, lane].copy(), decoder.states.delta[:, lane].copy()


# ---------------------------------------------------------------------------------------
# loading and the reference


def test_logits_match_float64_reference(model):
    logits = run_cuts(model.decoder, PROMPT, [len(PROMPT)])
    expected = ref.reference_logits(model.cfg, model.effective, PROMPT)
    np.testing.assert_allclose(logits, expected, rtol=2e-4, atol=2e-4)


def test_meta_and_kv_view(model):
    ckpt = load_checkpoint(model.path)
    hybrid = ckpt.weights.hybrid
    assert ckpt.meta["mtp"] == "present" and ckpt.weights.mtp is not None
    assert ckpt.meta["num_trunk_layers"] == 4 == hybrid.num_trunk_layers
    assert ckpt.config.num_layers == 1  # the KV view: one full-attention layer
    assert hybrid.gdn_layers == (0, 1, 2) and hybrid.attention_layers == (3,)
    assert ckpt.config.rotary_dim == 8 and ckpt.config.arch == model.cfg["model_type"]
    expected_norms = "hf" if "quantization" not in json.loads(
        (model.path / "config.json").read_text()) else "mlx"
    assert ckpt.meta["norms"].startswith(expected_norms)


# ---------------------------------------------------------------------------------------
# gates


def test_stepped_equals_whole_bit_for_bit(model):
    decoder = model.decoder
    whole = run_cuts(decoder, PROMPT, [len(PROMPT)])
    whole_state = lane_state(decoder, 0)
    for cuts in (cuts_of(len(PROMPT), 1), cuts_of(len(PROMPT), 3), cuts_of(len(PROMPT), 7),
                 [2, 9, 1, 5, 6]):
        assert np.array_equal(run_cuts(decoder, PROMPT, cuts), whole), cuts
        for got, want in zip(lane_state(decoder, 0), whole_state, strict=True):
            assert np.array_equal(got, want), cuts


def test_two_streams_in_one_batch_equal_solo(model):
    decoder = model.decoder
    other = [int(t) for t in np.random.default_rng(1).integers(3, 320, 17)]
    solo_a = run_cuts(decoder, PROMPT, [len(PROMPT)], lane=0)
    solo_b = run_cuts(decoder, other, [len(other)], lane=0)
    decoder.states.zero(3)
    decoder.states.zero(1)
    kv, got_a, got_b = new_kv(decoder), [], []
    # rounds mix prompt steps of both streams, in either order, lanes 3 and 1
    plan = [(0, 5, 0, 4), (5, 6, 4, 5), (6, 15, 5, 12), (15, 23, 12, 17)]
    for a0, a1, b0, b1 in plan:
        rows_a = Rows([0, 1, 2, 3, 4, 5], 3, PROMPT[a0:a1], a0)
        rows_b = Rows([11, 10, 9, 8, 7], 1, other[b0:b1], b0)
        if a0 % 2:
            out_b, out_a = run_round(decoder, kv, [rows_b, rows_a])
        else:
            out_a, out_b = run_round(decoder, kv, [rows_a, rows_b])
        got_a.append(out_a)
        got_b.append(out_b)
    assert np.array_equal(np.concatenate(got_a), solo_a)
    assert np.array_equal(np.concatenate(got_b), solo_b)


def greedy_plain(decoder: HybridDecoder, num_new: int, lane: int
                 ) -> tuple[list[int], dict[int, np.ndarray]]:
    """Greedy tokens after PROMPT, one row a step; logits by position."""
    decoder.states.zero(lane)
    kv = new_kv(decoder)
    logits = run_round(decoder, kv, [Rows(SCATTERED, lane, PROMPT, 0)])[0][-1]
    tokens, by_pos = [], {}
    for pos in range(len(PROMPT), len(PROMPT) + num_new):
        tokens.append(int(np.argmax(logits)))
        logits = run_round(decoder, kv, [Rows(SCATTERED, lane, tokens[-1:], pos)])[0][-1]
        by_pos[pos] = logits
    return tokens, by_pos


def test_frozen_verify_and_commit_equal_plain_decoding(model):
    """Verify rows with wrong drafts on a frozen lane (its state untouched, the rows stashed),
    then commit the accepted rows: the logits and the state bits of plain decoding."""
    decoder, lane = model.decoder, 2
    plain, plain_logits = greedy_plain(decoder, 12, lane=0)
    plain_state = lane_state(decoder, 0)
    decoder.states.zero(lane)
    kv = new_kv(decoder)
    first = run_round(decoder, kv, [Rows(SCATTERED, lane, PROMPT, 0)])[0][-1]
    emitted, pos = [int(np.argmax(first))], len(PROMPT)
    bad = [(plain[i] + 1) % 320 for i in range(len(plain))]
    for wrong_at in (1, None, 0, 2):  # first rejected draft index (None: all accepted)
        i = len(emitted)
        drafts = [bad[i + j] if j == wrong_at else plain[i + j] for j in range(3)]
        before = lane_state(decoder, lane)
        decoder.states.freeze((lane,))
        decoder.states.plan_stash([(lane, 0, 4)], 4)
        verify = run_round(decoder, kv, [Rows(SCATTERED, lane, [emitted[-1], *drafts], pos)])[0]
        decoder.states.freeze(())
        decoder.states.plan_stash([], 4)
        for got, want in zip(lane_state(decoder, lane), before, strict=True):
            assert np.array_equal(got, want), "a frozen lane's state changed in the verify round"
        accepted = 0
        while accepted < 3 and drafts[accepted] == int(np.argmax(verify[accepted])):
            accepted += 1
        assert accepted == (3 if wrong_at is None else wrong_at)
        decoder.commit_states(((lane, accepted + 1),))
        for row in range(accepted + 1):
            assert np.array_equal(verify[row], plain_logits[pos + row])
        emitted += drafts[:accepted] + [int(np.argmax(verify[accepted]))]
        pos += accepted + 1
    assert emitted == plain[:len(emitted)]
    # finish plain decoding of the same length and compare states bit for bit
    rest = run_round(decoder, kv, [Rows(SCATTERED, lane, plain[len(emitted) - 1:], pos)])[0]
    assert np.array_equal(rest[-1], plain_logits[len(PROMPT) + 11])
    for got, want in zip(lane_state(decoder, lane), plain_state, strict=True):
        assert np.array_equal(got, want)


# ---------------------------------------------------------------------------------------
# the MTP head


def prompt_hidden(decoder: HybridDecoder) -> tuple[int, np.ndarray]:
    decoder.states.zero(0)
    pos = np.arange(len(PROMPT), dtype=np.int64)
    batch = ForwardBatch(np.asarray(PROMPT, np.int64), pos, pos.copy(),
                         np.zeros(len(PROMPT), np.int32), np.zeros((1, 1), np.int32),
                         np.asarray([len(PROMPT) - 1], np.int64), 64, np.zeros(1, np.int32))
    kv = decoder.ops.alloc_kv(1, 64, decoder.config.num_kv_heads, decoder.config.head_dim, "f32")
    logits, hidden = decoder.forward(batch, kv, np.ones((1, 2), np.float32), all_hidden=True)
    assert hidden.shape == (len(PROMPT), decoder.config.hidden_size)
    return int(np.argmax(logits[-1])), hidden


def new_ring(decoder: HybridDecoder, capacity: int = 48) -> np.ndarray:
    return decoder.ops.alloc_kv(1, capacity, decoder.config.num_kv_heads,
                                decoder.config.head_dim, "f32")


def test_mtp_matches_reference_and_drafts_greedily_like_it(model):
    decoder = model.decoder
    head = make_mtp_head(decoder)
    next_token, hidden = prompt_hidden(decoder)
    tokens = np.asarray(PROMPT[1:] + [next_token], np.int64)
    positions = np.arange(len(PROMPT), dtype=np.int64)
    ring = new_ring(decoder)
    logits, out = head.rows(tokens, positions, hidden, ring)
    want_logits, want_out = ref.reference_mtp(model.cfg, model.effective, hidden.astype(np.float64),
                                              tokens.tolist(), positions, ref.KVCache())
    np.testing.assert_allclose(logits, want_logits, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(out, want_out, rtol=2e-4, atol=2e-4)
    drafts, prev = [int(np.argmax(logits[-1]))], out[-1:]
    for pos in range(len(PROMPT), len(PROMPT) + 3):
        step_logits, prev = head.rows(np.asarray(drafts[-1:], np.int64),
                                         np.asarray([pos], np.int64), prev, ring)
        drafts.append(int(np.argmax(step_logits[-1])))
    assert (next_token, drafts) == ref.reference_mtp_drafts(model.cfg, model.effective, PROMPT, 4)


def test_mtp_sync_in_pieces_equals_whole(model):
    decoder = model.decoder
    head = MtpHead(decoder)
    _, hidden = prompt_hidden(decoder)
    tokens = np.asarray(PROMPT[1:] + [4], np.int64)
    positions = np.arange(len(PROMPT), dtype=np.int64)
    whole, _ = head.rows(tokens, positions, hidden, new_ring(decoder))
    ring, pieces = new_ring(decoder), []
    for lo, hi in ((0, 1), (1, 8), (8, 9), (9, len(PROMPT))):
        pieces.append(head.rows(tokens[lo:hi], positions[lo:hi], hidden[lo:hi], ring)[0])
    assert np.array_equal(np.concatenate(pieces), whole)
    last, _ = head.rows(tokens, positions, hidden, new_ring(decoder),
                           logit_rows=np.asarray([len(PROMPT) - 1], np.int64))
    assert np.array_equal(last[0], whole[-1])


# ---------------------------------------------------------------------------------------
# MTP declared without weights, factories


@pytest.mark.parametrize("kind", ["hf", "mlx"])
def test_declared_mtp_without_weights_loads_and_refuses_drafting(tmp_path, kind):
    flag = {"with_mtp": False} if kind == "hf" else {"keep_mtp": False}
    extra = {"dtype": "f32"} if kind == "hf" else {"bits": 4}
    _, _, path = write_variant(tmp_path, False, kind, **extra, **flag)
    ckpt = load_checkpoint(path)
    assert ckpt.weights.mtp is None
    assert ckpt.meta["mtp"].startswith("missing") and "mtp_num_hidden_layers=1" in ckpt.meta["mtp"]
    decoder = make_decoder(ckpt, CpuOps())
    with pytest.raises(BadInputError, match="no usable MTP layer.*no mtp"):
        make_mtp_head(decoder)


def test_make_decoder_picks_the_dense_decoder_for_other_models(tiny_llama):
    decoder = make_decoder(tiny_llama, CpuOps())
    assert isinstance(decoder, Decoder)
    with pytest.raises(BadInputError, match="not a Qwen3.5 hybrid"):
        make_mtp_head(decoder)


def test_make_decoder_dispatches_from_one_table_by_architecture(tiny_llama):
    from dataclasses import replace

    from tf_async.errors import ModelFormatError
    from tf_async.models.config import SUPPORTED_ARCHS
    from tf_async.models.loader import DECODERS
    from tf_async.models.qwen35 import HYBRID_ARCHS

    assert set(DECODERS) == set(SUPPORTED_ARCHS) | set(HYBRID_ARCHS)
    unknown = replace(tiny_llama, config=replace(tiny_llama.config, arch="mamba"))
    with pytest.raises(ModelFormatError, match="no decoder for architecture 'mamba'"):
        make_decoder(unknown, CpuOps())


def test_recurrent_states_sizes_zero_and_stash(model):
    decoder = model.decoder
    states: RecurrentStates = decoder.new_states(3)
    conv_bytes = 4 * 3 * (4 - 1) * (2 * 2 * 16 + 4 * 16)  # gdn layers * (K-1) * C
    delta_bytes = 4 * 3 * 4 * 16 * 16  # gdn layers * Hv * dk * dv
    assert states.bytes_per_lane == conv_bytes + delta_bytes
    assert states.num_bytes == 3 * states.bytes_per_lane  # no copy of any state
    states.plan_stash([(2, 1, 4), (0, 5, 2)], 7)  # grows to the longest run: 4 rows a lane
    row_bytes = 4 * 3 * ((2 * 2 * 16 + 4 * 16) + 2 * 4)  # gdn layers * (C + 2 Hv)
    assert states.stash_bytes_per_lane == 4 * row_bytes
    assert states.num_bytes == 3 * states.bytes_per_lane + 4 * 4 * row_bytes  # + discard lane
    width = 2 * 2 * 16 + 4 * 16
    qkv = np.arange(7 * width, dtype=np.float32).reshape(7, width)
    g, beta = -np.arange(7 * 4, dtype=np.float32).reshape(7, 4), np.ones((7, 4), np.float32)
    states.stash(1, qkv, g, beta)
    assert np.array_equal(states.stashed[1, 2, :, :width], qkv[1:5])
    assert np.array_equal(states.stashed[1, 0, :2, width:width + 4], g[5:7])
    assert not states.stashed[0].any() and not states.stashed[1, 1].any()
    assert np.array_equal(states.stashed[1, 3, 0, :width], qkv[0])  # row 0: discard lane
    with pytest.raises(ValueError, match="outside a batch of 6 rows"):
        states.plan_stash([(2, 1, 4), (0, 5, 2)], 6)
    states.conv[...] = 1.0
    states.delta[...] = 2.0
    states.zero(2)
    assert not states.conv[:, 2].any() and not states.delta[:, 2].any()
    assert states.conv[:, 1].all() and states.delta[:, 0].all()
    states.freeze((2, 0))
    assert states.frozen.tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="outside"):
        states.zero(3)
    with pytest.raises(ValueError, match="outside"):
        states.freeze((3,))


def test_forward_needs_lanes_and_one_shot_equals_fresh_state(model):
    decoder = model.decoder
    pos = np.arange(5, dtype=np.int64)
    batch = ForwardBatch(np.asarray(PROMPT[:5], np.int64), pos, pos.copy(),
                         np.zeros(5, np.int32), np.zeros((1, 1), np.int32),
                         np.arange(5, dtype=np.int64), 8)
    kv = decoder.ops.alloc_kv(1, 8, decoder.config.num_kv_heads, decoder.config.head_dim, "f32")
    scales = np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="seq_lanes"):
        decoder.forward(batch, kv, scales)
    bad_lane = replace(batch, seq_lanes=np.asarray([9], np.int32))  # 4 lanes attached
    with pytest.raises(ValueError, match="outside"):
        decoder.forward(bad_lane, kv, scales)
    once, _ = decoder.one_shot(batch, kv, scales)
    assert np.array_equal(once, run_cuts(decoder, PROMPT[:5], [5]))


# ---------------------------------------------------------------------------------------
# bad files


def _rewrite(path: Path, tensors_edit) -> None:
    """Apply an edit to the first shard's tensors (HF f32 folder) and rewrite it."""
    from tests.tiny_hf import write_safetensors
    from tf_async.models.safetensors_io import load_safetensors

    shard = path / "model-00001-of-00002.safetensors"
    tensors = load_safetensors(shard)
    tensors_edit(tensors)
    write_safetensors(shard, tensors, dtype="f32")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items()
                           if n in tensors or s != shard.name}
    index["weight_map"].update({n: shard.name for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


LM = "model.language_model."


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop(LM + "layers.1.linear_attn.in_proj_z.weight"),
     r"missing tensor 'model\.language_model\.layers\.1\.linear_attn\.in_proj_z\.weight'"),
    (lambda t: t.update({LM + "layers.0.linear_attn.dt_bias": np.zeros(3, np.float32)}),
     r"tensor 'model\.language_model\.layers\.0\.linear_attn\.dt_bias' has shape \[3\]"),
    (lambda t: t.update({LM + "layers.2.linear_attn.conv1d.weight": np.zeros((128, 4), np.float32)}),
     r"conv1d\.weight' has shape \[128, 4\], expected \[128, 1, 4\]"),
    (lambda t: t.update({LM + "layers.0.linear_attn.in_proj_qkvz.weight": np.zeros((2, 64), np.float32)}),
     r"unexpected tensor.*in_proj_qkvz"),
    (lambda t: t.pop("mtp.layers.0.self_attn.k_norm.weight"),
     r"missing tensor 'mtp\.layers\.0\.self_attn\.k_norm\.weight'"),
])
def test_bad_tensors_name_file_and_tensor(tmp_path, edit, message):
    _, _, path = write_variant(tmp_path, False, "hf", dtype="f32")
    _rewrite(path, edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
     "unknown layer type 'mamba' at layer 1"),
    ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
])
def test_bad_configs_are_model_format_errors(tmp_path, change, message):
    _, _, path = write_variant(tmp_path, False, "hf", dtype="f32")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(change)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match=message) as info:
        load_checkpoint(path)
    assert "config.json" in str(info.value)


def test_the_mtp_head_is_a_decoder(model):
    """MtpHead implements models/protocol.py's Decoder (the type checker checks the assignment;
    this checks the protocol's forward gives rows()'s bits)."""
    from tf_async.models.protocol import DecoderProtocol

    head: DecoderProtocol = MtpHead(model.decoder)
    assert head.states is None and head.argmax_of(np.zeros((1, 4), np.float32)) is None
    _, hidden = prompt_hidden(model.decoder)
    tokens = np.asarray(PROMPT[1:] + [4], np.int64)
    positions = np.arange(len(PROMPT), dtype=np.int64)
    via_rows = MtpHead(model.decoder).rows(tokens, positions, hidden, new_ring(model.decoder))
    other, ring = MtpHead(model.decoder), new_ring(model.decoder)
    batch = other._ring_batch(other._ring_inputs(positions, ring, tokens, None),
                              int(ring.shape[2]), hidden)
    via_forward = head.forward(batch, new_ring(model.decoder), None)
    assert all(np.array_equal(a, b) for a, b in zip(via_rows, via_forward, strict=True))
