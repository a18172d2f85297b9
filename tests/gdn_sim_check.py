"""CUDA twins of the GDN kernels (cuda_kernels/gdn.py) in Numba's CUDA simulator, at tiny
sizes: each twin against its CPU kernel (tolerance 1e-5: the simulator evaluates some
math in float64), and within the CUDA kernels the bit-identities the gates need (split ==
whole, batch of streams == each stream alone, conv step == rows).

Run as `python -m tests.gdn_sim_check` from the repository root (tests/test_gdn_kernels.py
does, in a subprocess): the simulator must be enabled before numba is first imported.
"""

from __future__ import annotations

import os

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402

from cuda_kernels import gdn as cuda_gdn  # noqa: E402
from tests.test_gdn_kernels import conv_inputs, delta_inputs, run_delta  # noqa: E402
from tf_async.backend.cpu import gdn as cpu_gdn  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}


def check_delta(rows: int = 5, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 8) -> None:
    inp = delta_inputs(np.random.default_rng(11), rows, hk, hv, dk, dv)
    cuda_out, cuda_state = run_delta(cuda_gdn.gated_delta_rule, inp)
    cpu_out, cpu_state = run_delta(cpu_gdn.gated_delta_rule, inp)
    np.testing.assert_allclose(cuda_out, cpu_out, **TOL)
    np.testing.assert_allclose(cuda_state, cpu_state, **TOL)
    state = inp["state"].copy()
    head, _ = run_delta(cuda_gdn.gated_delta_rule_column_parallel, inp, slice(0, 2), state)
    tail, _ = run_delta(cuda_gdn.gated_delta_rule_column_parallel, inp, slice(2, None), state)
    assert np.array_equal(np.concatenate([head, tail]), cuda_out), "split != whole"
    assert np.array_equal(state, cuda_state), "split state != whole state"


def check_delta_batch() -> None:
    rng = np.random.default_rng(12)
    lengths, slots = [3, 1, 2], [2, 0, 1]
    streams = [delta_inputs(rng, n, 1, 2, 8, 4) for n in lengths]
    states = np.zeros((3, 2, 8, 4), np.float32)
    for inp, slot in zip(streams, slots, strict=True):
        states[slot] = inp["state"]
    cat = {n: np.concatenate([s[n] for s in streams]) for n in ("q", "k", "v", "g", "beta")}
    out = np.full(cat["v"].shape, np.nan, np.float32)
    row_seq = np.repeat(np.array(slots, np.int32), lengths)
    before = states.copy()
    cuda_gdn.gated_delta_rule_batch(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], states,
                                    row_seq, np.zeros(3, np.uint8), out)
    offsets = np.cumsum([0, *lengths])
    for i, inp in enumerate(streams):
        solo_out, solo_state = run_delta(cuda_gdn.gated_delta_rule, inp)
        assert np.array_equal(out[offsets[i]:offsets[i + 1]], solo_out), "batch != solo"
        assert np.array_equal(states[slots[i]], solo_state), "batch state != solo state"
    # Frozen slots 1 and 2 (draft verification): the same rows from the registers' copies,
    # their states untouched.
    frozen = np.array([0, 1, 1], np.uint8)
    held_states, held = before.copy(), np.full(cat["v"].shape, np.nan, np.float32)
    cuda_gdn.gated_delta_rule_batch(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"],
                                    held_states, row_seq, frozen, held)
    assert np.array_equal(held, out), "frozen rows differ"
    assert np.array_equal(held_states[1:], before[1:]), "a frozen state changed"
    assert np.array_equal(held_states[0], states[0]), "an unfrozen state did not advance"


def check_conv() -> None:
    inp = conv_inputs(np.random.default_rng(13), 4, 20, 4)
    results = {}
    for name, mod in (("cuda", cuda_gdn), ("cpu", cpu_gdn)):
        state, out = inp["state"].copy(), np.full(inp["x"].shape, np.nan, np.float32)
        mod.causal_conv1d_rows(inp["x"], state, inp["weight"], out)
        results[name] = (out, state)
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], **TOL)
    assert np.array_equal(results["cuda"][1], results["cpu"][1])
    state, steps = inp["state"].copy(), np.empty_like(inp["x"])
    for t in range(4):
        cuda_gdn.causal_conv1d_step(inp["x"][t], state, inp["weight"], steps[t])
    assert np.array_equal(steps, results["cuda"][0]), "conv step != rows"
    states, out = np.stack([np.zeros_like(inp["state"]), inp["state"]]), np.empty((5, 20), np.float32)
    x = np.concatenate([inp["x"][:1], inp["x"]])
    before = states.copy()
    row_seq = np.array([0, 1, 1, 1, 1], np.int32)
    cuda_gdn.causal_conv1d_batch(x, states, inp["weight"], row_seq, np.zeros(2, np.uint8), out)
    assert np.array_equal(out[1:], results["cuda"][0]), "conv batch != rows"
    held_states, held = before.copy(), np.empty_like(out)
    cuda_gdn.causal_conv1d_batch(x, held_states, inp["weight"], row_seq, np.array([0, 1], np.uint8),
                                 held)
    assert np.array_equal(held, out), "frozen conv rows differ"
    assert np.array_equal(held_states[1], before[1]) and np.array_equal(held_states[0], states[0])


def check_conv_many_streams(streams: int = cuda_gdn.CONV_RUN_BLOCKS + 6) -> None:
    """More streams than a batched conv launch has grid rows (so a block takes several runs),
    runs of 1 or 2 rows, slots in no order, every 7th lane frozen: each stream's rows and state
    are those of the stream alone (its state untouched when frozen)."""
    rng = np.random.default_rng(12)
    channels, hist = 20, 3
    weight = rng.standard_normal((channels, hist + 1)).astype(np.float32)
    slots = rng.permutation(streams).astype(np.int32)
    runs = 1 + (np.arange(streams) % 3 == 0)
    row_seq = np.repeat(slots, runs)
    x = rng.standard_normal((row_seq.size, channels)).astype(np.float32)
    states = rng.standard_normal((streams, hist, channels)).astype(np.float32)
    frozen = (np.arange(streams) % 7 == 0).astype(np.uint8)
    batch_states, out = states.copy(), np.full(x.shape, np.nan, np.float32)
    cuda_gdn.causal_conv1d_batch(x, batch_states, weight, row_seq, frozen, out)
    for slot in range(streams):
        rows = row_seq == slot
        alone_state, alone = states[slot].copy(), np.empty((int(rows.sum()), channels), np.float32)
        cuda_gdn.causal_conv1d_rows(x[rows], alone_state, weight, alone)
        assert np.array_equal(out[rows], alone), f"slot {slot}: batch rows != alone"
        want = states[slot] if frozen[slot] else alone_state
        assert np.array_equal(batch_states[slot], want), f"slot {slot}: state"


def _both(name: str, *args: np.ndarray | float | int, outs: list[np.ndarray]) -> None:
    """Run CUDA and CPU kernel `name` on copies of `outs`; compare every output."""
    cpu_outs = [o.copy() for o in outs]
    getattr(cuda_gdn, name)(*args, *outs)
    getattr(cpu_gdn, name)(*args, *cpu_outs)
    for got, want in zip(outs, cpu_outs, strict=True):
        np.testing.assert_allclose(got, want, **TOL, err_msg=name)


def check_small_kernels() -> None:
    rng = np.random.default_rng(14)
    f32 = np.float32
    a, b = (rng.standard_normal((3, 4)).astype(f32) * 4 for _ in range(2))
    _both("gdn_gates", a, b, rng.standard_normal(4).astype(f32), rng.standard_normal(4).astype(f32),
          outs=[np.empty_like(a), np.empty_like(b)])
    # a warp a head: heads of 40 (more than a warp's lanes), warps past the last head
    mixed = rng.standard_normal((3, 2 * 2 * 40 + 4 * 8)).astype(f32)
    _both("gdn_qk_l2norm", mixed, 2, 40, 1e-6, 40 ** -0.5,
          outs=[np.empty((3, 2, 40), f32), np.empty((3, 2, 40), f32)])
    x, z = (rng.standard_normal((3, 3, 40)).astype(f32) for _ in range(2))
    _both("gated_rms_norm", x, z, rng.standard_normal(40).astype(f32), 1e-6, outs=[np.empty_like(x)])
    qg = rng.standard_normal((3, 2 * 2 * 4)).astype(f32)
    _both("split_query_gate", qg, 2, 4, outs=[np.empty((3, 2, 4), f32), np.empty((3, 8), f32)])
    attn, gate = (rng.standard_normal((3, 8)).astype(f32) for _ in range(2))
    _both("sigmoid_gate_mul", attn, gate, outs=[np.empty_like(attn)])


def check_shared_expert_add() -> None:
    rng = np.random.default_rng(15)
    h, routed, shared = (rng.standard_normal((3, 40)).astype(np.float32) for _ in range(3))
    gate = (4 * rng.standard_normal((3, 1))).astype(np.float32)
    got, want = h.copy(), h.copy()
    cuda_gdn.shared_expert_add(got, routed, shared, gate)
    cpu_gdn.shared_expert_add(want, routed, shared, gate)
    np.testing.assert_allclose(got, want, **TOL, err_msg="shared_expert_add")
    gated = np.empty_like(shared)  # the ops it fuses, in the same (simulated) kernels
    cuda_gdn.sigmoid_gate_mul(shared, np.ascontiguousarray(np.broadcast_to(gate, shared.shape)), gated)
    assert np.array_equal(got, h + (routed + gated)), "shared_expert_add != its basic ops"


def main() -> None:
    check_delta()
    check_delta(3, 1, 2, 72, 40)  # three warps (the last one partly past dk), two column blocks
    check_delta_batch()
    check_conv()
    check_conv_many_streams()
    check_small_kernels()
    check_shared_expert_add()
    print("gdn simulator checks passed")


if __name__ == "__main__":
    main()
