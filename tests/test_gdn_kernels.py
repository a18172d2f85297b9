"""Gated DeltaNet kernels (tf_async/backend/cpu/gdn.py) against the float64 reference, and
the bit-identity the gates need: multi-row == one row at a time, split == whole, batch of
streams == each stream alone. The CUDA twins run in Numba's simulator (subprocess).

Tolerances (float32 kernels vs float64 reference, O(1) values): 2e-5 absolute + 1e-4
relative on delta-rule outputs and states (a few hundred fp32 roundings per element),
1e-5 / 1e-5 on the one-pass kernels (conv, gates, norms).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import reference_qwen35 as ref
from tf_async.backend.cpu import gdn

ROOT = Path(__file__).resolve().parent.parent
DELTA_TOL = {"atol": 2e-5, "rtol": 1e-4}
ONE_PASS_TOL = {"atol": 1e-5, "rtol": 1e-5}


def delta_inputs(rng: np.random.Generator, num_rows: int, hk: int, hv: int, dk: int, dv: int
                 ) -> dict[str, np.ndarray]:
    """Random q, k (L2-normalised, q scaled), v, g < 0, beta in (0, 1), nonzero state."""
    q = rng.standard_normal((num_rows, hk, dk))
    k = rng.standard_normal((num_rows, hk, dk))
    f32 = np.float32
    return {
        "q": (ref.l2_normalize(q) / np.sqrt(dk)).astype(f32),
        "k": ref.l2_normalize(k).astype(f32),
        "v": rng.standard_normal((num_rows, hv, dv)).astype(f32),
        "g": -rng.uniform(0.01, 1.5, (num_rows, hv)).astype(f32),
        "beta": rng.uniform(0.0, 1.0, (num_rows, hv)).astype(f32),
        "state": rng.standard_normal((hv, dk, dv)).astype(f32),
    }


def run_delta(kernel, inp: dict[str, np.ndarray], rows: slice = slice(None),
              state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out, state after) of a one-stream delta-rule kernel over inp's `rows`."""
    state = inp["state"].copy() if state is None else state
    q, k, v, g, beta = (inp[n][rows] for n in ("q", "k", "v", "g", "beta"))
    out = np.full(v.shape, np.nan, np.float32)
    kernel(q, k, v, g, beta, state, out)
    return out, state


def conv_inputs(rng: np.random.Generator, num_rows: int, channels: int, kernel: int
                ) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((num_rows, channels)).astype(np.float32),
            "weight": (rng.standard_normal((channels, kernel)) / 2).astype(np.float32),
            "state": rng.standard_normal((kernel - 1, channels)).astype(np.float32)}


# ---------------------------------------------------------------------------------------
# gated delta rule


@pytest.mark.parametrize("kernel", [gdn.gated_delta_rule, gdn.gated_delta_rule_column_parallel])
def test_delta_rule_matches_float64_reference(kernel):
    inp = delta_inputs(np.random.default_rng(1), 37, 2, 6, 16, 40)  # Hv > Hk, dv % 16 != 0
    out, state = run_delta(kernel, inp)
    want_out, want_state = ref.recurrent_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"],
                                                    inp["beta"], inp["state"])
    np.testing.assert_allclose(out, want_out, **DELTA_TOL)
    np.testing.assert_allclose(state, want_state, **DELTA_TOL)


def test_column_parallel_is_bit_identical_to_recurrent():
    inp = delta_inputs(np.random.default_rng(2), 37, 2, 6, 16, 40)
    out_a, state_a = run_delta(gdn.gated_delta_rule, inp)
    out_b, state_b = run_delta(gdn.gated_delta_rule_column_parallel, inp)
    assert np.array_equal(out_a, out_b) and np.array_equal(state_a, state_b)


def test_multi_row_is_bit_identical_to_one_row_at_a_time():
    inp = delta_inputs(np.random.default_rng(3), 23, 1, 4, 32, 24)
    whole_out, whole_state = run_delta(gdn.gated_delta_rule_column_parallel, inp)
    state = inp["state"].copy()
    rows_out = [run_delta(gdn.gated_delta_rule, inp, slice(t, t + 1), state)[0] for t in range(23)]
    assert np.array_equal(np.concatenate(rows_out), whole_out)
    assert np.array_equal(state, whole_state)


@pytest.mark.parametrize("cut", [1, 7, 36])
def test_split_at_any_point_is_bit_identical(cut):
    inp = delta_inputs(np.random.default_rng(4), 37, 2, 4, 16, 16)
    whole_out, whole_state = run_delta(gdn.gated_delta_rule_column_parallel, inp)
    state = inp["state"].copy()
    head, _ = run_delta(gdn.gated_delta_rule_column_parallel, inp, slice(0, cut), state)
    tail, _ = run_delta(gdn.gated_delta_rule_column_parallel, inp, slice(cut, None), state)
    assert np.array_equal(np.concatenate([head, tail]), whole_out)
    assert np.array_equal(state, whole_state)


def test_batch_of_streams_is_bit_identical_to_each_alone():
    rng = np.random.default_rng(5)
    lengths, slots = [10, 1, 7], [3, 0, 1]  # a prompt step, a decode row, another step
    streams = [delta_inputs(rng, n, 2, 4, 16, 24) for n in lengths]
    states = rng.standard_normal((4, 4, 16, 24)).astype(np.float32)
    for inp, slot in zip(streams, slots, strict=True):
        states[slot] = inp["state"]
    untouched = states[2].copy()
    cat = {n: np.concatenate([s[n] for s in streams]) for n in ("q", "k", "v", "g", "beta")}
    row_seq = np.repeat(np.array(slots, np.int32), lengths)
    out = np.full(cat["v"].shape, np.nan, np.float32)
    gdn.gated_delta_rule_batch(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], states,
                               row_seq, np.zeros(4, np.uint8), out)
    offsets = np.cumsum([0, *lengths])
    for i, inp in enumerate(streams):
        solo_out, solo_state = run_delta(gdn.gated_delta_rule, inp)
        assert np.array_equal(out[offsets[i]:offsets[i + 1]], solo_out)
        assert np.array_equal(states[slots[i]], solo_state)
    assert np.array_equal(states[2], untouched)


def test_frozen_lanes_give_the_same_rows_and_keep_their_state():
    """A frozen slot (draft verification) computes its rows from a copy: outputs bit-identical
    to the unfrozen call, its stored state unchanged; other slots advance as usual."""
    rng = np.random.default_rng(15)
    lengths, slots = [3, 5, 1], [2, 0, 1]  # 5 rows: longer than one dv block's reload
    streams = [delta_inputs(rng, n, 2, 4, 16, 40) for n in lengths]
    states = rng.standard_normal((3, 4, 16, 40)).astype(np.float32)
    cat = {n: np.concatenate([s[n] for s in streams]) for n in ("q", "k", "v", "g", "beta")}
    row_seq = np.repeat(np.array(slots, np.int32), lengths)
    free, free_states = np.empty_like(cat["v"]), states.copy()
    gdn.gated_delta_rule_batch(*(cat[n] for n in ("q", "k", "v", "g", "beta")), free_states,
                               row_seq, np.zeros(3, np.uint8), free)
    held, held_states = np.empty_like(cat["v"]), states.copy()
    frozen = np.array([1, 0, 1], np.uint8)  # slots 0 and 2 frozen, slot 1 not
    gdn.gated_delta_rule_batch(*(cat[n] for n in ("q", "k", "v", "g", "beta")), held_states,
                               row_seq, frozen, held)
    assert np.array_equal(held, free)
    assert np.array_equal(held_states[[0, 2]], states[[0, 2]])
    assert np.array_equal(held_states[1], free_states[1])
    x = rng.standard_normal((9, 70)).astype(np.float32)
    weight = rng.standard_normal((70, 4)).astype(np.float32)
    conv = rng.standard_normal((3, 3, 70)).astype(np.float32)
    free_conv, held_conv = conv.copy(), conv.copy()
    out_free, out_held = np.empty_like(x), np.empty_like(x)
    gdn.causal_conv1d_batch(x, free_conv, weight, row_seq, np.zeros(3, np.uint8), out_free)
    gdn.causal_conv1d_batch(x, held_conv, weight, row_seq, frozen, out_held)
    assert np.array_equal(out_held, out_free)
    assert np.array_equal(held_conv[[0, 2]], conv[[0, 2]])
    assert np.array_equal(held_conv[1], free_conv[1])


def test_frozen_rows_must_be_contiguous():
    from tf_async.backend.cpu.ops import CpuOps
    from tf_async.errors import BadInputError

    ops = CpuOps()
    x = np.zeros((3, 8), np.float32)
    states = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(BadInputError, match="contiguous"):
        ops.causal_conv1d(x, states, np.zeros((8, 4), np.float32), np.array([0, 1, 0], np.int32),
                          np.array([1, 0], np.uint8))
    ops.causal_conv1d(x, states, np.zeros((8, 4), np.float32), np.array([0, 1, 0], np.int32),
                      np.array([0, 1], np.uint8))  # an unfrozen lane may come back


def test_reading_before_the_write_would_be_caught():
    """The reference reads o after the delta write; a kernel reading before it differs."""
    inp = delta_inputs(np.random.default_rng(6), 3, 1, 2, 8, 8)
    out, _ = run_delta(gdn.gated_delta_rule, inp)
    s = inp["state"][0].astype(np.float64) * np.exp(float(inp["g"][0, 0]))
    read_before = s.T @ inp["q"][0, 0]
    assert not np.allclose(out[0, 0], read_before, atol=1e-3)


# ---------------------------------------------------------------------------------------
# causal conv


def _conv_steps(inp: dict[str, np.ndarray], state: np.ndarray, rows: range) -> np.ndarray:
    out = np.full((len(rows), inp["x"].shape[1]), np.nan, np.float32)
    for i, t in enumerate(rows):
        gdn.causal_conv1d_step(inp["x"][t], state, inp["weight"], out[i])
    return out


def test_conv_matches_reference_and_steps_equal_rows():
    inp = conv_inputs(np.random.default_rng(7), 11, 150, 4)
    state_rows = inp["state"].copy()
    out_rows = np.full(inp["x"].shape, np.nan, np.float32)
    gdn.causal_conv1d_rows(inp["x"], state_rows, inp["weight"], out_rows)
    want, want_state = ref.causal_conv1d(inp["x"], inp["state"], inp["weight"])
    np.testing.assert_allclose(out_rows, want, **ONE_PASS_TOL)
    assert np.array_equal(state_rows, want_state.astype(np.float32))  # raw rows, copied
    state_steps = inp["state"].copy()
    assert np.array_equal(_conv_steps(inp, state_steps, range(11)), out_rows)
    assert np.array_equal(state_steps, state_rows)


def test_conv_split_and_batch_are_bit_identical():
    rng = np.random.default_rng(8)
    a, b = conv_inputs(rng, 9, 70, 4), conv_inputs(rng, 2, 70, 4)
    b["weight"] = a["weight"]
    whole = np.empty_like(a["x"])
    gdn.causal_conv1d_rows(a["x"], a["state"].copy(), a["weight"], whole)
    state = a["state"].copy()
    head, tail = np.empty_like(a["x"][:4]), np.empty_like(a["x"][4:])
    gdn.causal_conv1d_rows(a["x"][:4], state, a["weight"], head)
    gdn.causal_conv1d_rows(a["x"][4:], state, a["weight"], tail)
    assert np.array_equal(np.concatenate([head, tail]), whole)
    states = np.stack([b["state"], a["state"]])
    out = np.empty((11, 70), np.float32)
    gdn.causal_conv1d_batch(np.concatenate([b["x"], a["x"]]), states, a["weight"],
                            np.array([0, 0] + [1] * 9, np.int32), np.zeros(2, np.uint8), out)
    assert np.array_equal(out[2:], whole) and np.array_equal(states[1], state)


# ---------------------------------------------------------------------------------------
# gates, q/k norms, output norm, attention gate


def test_gates_and_qk_norm_match_reference():
    rng = np.random.default_rng(9)
    hk, hv, dk, dv, rows = 2, 4, 16, 8, 5
    a, b = (rng.standard_normal((rows, hv)).astype(np.float32) * 4 for _ in range(2))
    a[0, 0] = 30.0  # softplus's linear branch
    a_log, dt_bias = rng.standard_normal(hv).astype(np.float32), rng.standard_normal(hv).astype(np.float32)
    g, beta = np.empty_like(a), np.empty_like(b)
    gdn.gdn_gates(a, b, a_log, dt_bias, g, beta)
    want_g, want_beta = ref.gdn_gates(a, b, a_log, dt_bias)
    np.testing.assert_allclose(g, want_g, **ONE_PASS_TOL)
    np.testing.assert_allclose(beta, want_beta, **ONE_PASS_TOL)
    mixed = rng.standard_normal((rows, 2 * hk * dk + hv * dv)).astype(np.float32)
    q, k = np.empty((rows, hk, dk), np.float32), np.empty((rows, hk, dk), np.float32)
    gdn.gdn_qk_l2norm(mixed, hk, dk, 1e-6, dk ** -0.5, q, k)
    want_q = ref.l2_normalize(mixed[:, :hk * dk].reshape(rows, hk, dk)) / np.sqrt(dk)
    want_k = ref.l2_normalize(mixed[:, hk * dk:2 * hk * dk].reshape(rows, hk, dk))
    np.testing.assert_allclose(q, want_q, **ONE_PASS_TOL)
    np.testing.assert_allclose(k, want_k, **ONE_PASS_TOL)


def test_gated_rms_norm_and_attention_gate_match_reference():
    rng = np.random.default_rng(10)
    x, z = (rng.standard_normal((3, 4, 16)).astype(np.float32) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    out = np.empty_like(x)
    gdn.gated_rms_norm(x, z, w, 1e-6, out)
    np.testing.assert_allclose(out, ref.gated_rms_norm(x, z, w, 1e-6), **ONE_PASS_TOL)
    qg = rng.standard_normal((3, 2 * 2 * 8)).astype(np.float32)  # nh=2, hd=8
    q, gate = np.empty((3, 2, 8), np.float32), np.empty((3, 16), np.float32)
    gdn.split_query_gate(qg, 2, 8, q, gate)
    per_head = qg.reshape(3, 2, 16)
    assert np.array_equal(q, per_head[..., :8])
    assert np.array_equal(gate, per_head[..., 8:].reshape(3, 16))
    attn = rng.standard_normal((3, 16)).astype(np.float32)
    gated = np.empty_like(attn)
    gdn.sigmoid_gate_mul(attn, gate, gated)
    np.testing.assert_allclose(gated, attn * ref.sigmoid(gate.astype(np.float64)), **ONE_PASS_TOL)


def test_shared_expert_add_has_the_bits_of_its_basic_ops():
    """h += routed + shared * sigmoid(gate) in one pass == sigmoid_gate_mul on the broadcast
    gate, then routed + shared, then h + that (what the MoE layer did op by op)."""
    rng = np.random.default_rng(16)
    h, routed, shared = (rng.standard_normal((5, 48)).astype(np.float32) for _ in range(3))
    gate = (3 * rng.standard_normal((5, 1))).astype(np.float32)
    got = h.copy()
    gdn.shared_expert_add(got, routed, shared, gate)
    gated = np.empty_like(shared)
    gdn.sigmoid_gate_mul(shared, np.ascontiguousarray(np.broadcast_to(gate, shared.shape)), gated)
    assert np.array_equal(got, h + (routed + gated))
    assert not np.array_equal(got, (h + routed) + gated)  # the order shows in the bits


# ---------------------------------------------------------------------------------------
# CUDA twins (simulator)


def test_cuda_twins_in_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.gdn_sim_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gdn simulator checks passed" in proc.stdout
