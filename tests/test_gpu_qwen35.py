"""Qwen3.5 hybrids on a real GPU (`pytest -m gpu`, needs CuPy and a CUDA GPU).

1. Every kernel of cuda_kernels/gdn.py against its CPU twin (tf_async/backend/cpu/gdn.py) at
   the real layer sizes of Qwen3.5-27B (Hk 16, Hv 48, dk = dv 128, conv K 4, C 10240, gated
   attention 24 heads of 256) and Qwen3.5-35B-A3B (Hv 32, C 8192, 16 heads of 256), with 1, 7
   and 64 rows and batches of several streams: the recurrent and the chunked (column-parallel)
   delta rule, the batch form with state slots, the conv (prompt rows, one-step, batch), the
   gates, q/k L2 norm, gated RMSNorm, the query/gate split and the sigmoid gate. Plus the
   bit-identities the gates need, on the GPU: split == whole, batch of streams == each stream
   alone, conv step == rows, a row alone == the same row among others.
2. The engine gates for the tiny hybrids (tests/test_qwen35_engine.py `VARIANTS`: qwen3_5
   dense and qwen3_5_moe, HF bf16 and MLX 4-bit) with the MTP drafter (drafted == plain) and
   ngram, one of them with fp8 KV; the hybrid decoder's GPU logits against the CPU's, and on
   the GPU: several streams in one forward == each alone, stepped == whole.

Fresh random inputs every run; outputs poisoned with NaN before every launch.

Error bounds (relative Frobenius error of the GPU result against the CPU twin's on the same
float32 inputs). Every kernel computes in float32 with float32 state; the two backends differ
only by rounding (FMA contraction, expf / log1pf implementations), so:
- delta rule outputs and states: 1e-5 (each backend is ~2e-7 from float64 at these sizes);
- one-pass kernels (conv, gates, L2 norm, gated RMSNorm, sigmoid gate): 2e-6;
- copies: exact (conv state = raw rows, split_query_gate).
Tiny-hybrid logits, GPU vs CPU: max |gpu - cpu| / max |cpu| <= 1e-4 (4 layers, float32), or,
where the matmuls take int8 x (MLX 4-bit), no more than 4x what nudging the CPU's own
embeddings by one ulp does to its logits: one rounding difference upstream can move an int8
level of x (on the dense MLX 4-bit tiny hybrid a one-ulp nudge moves the CPU's logits by ~9e-3).

The kernel part also runs in Numba's CUDA simulator at tiny sizes, on host arrays (no CuPy):
    TF_ASYNC_GPU_TESTS_SIM=1 python -m pytest -m gpu tests/test_gpu_qwen35.py
(it sets NUMBA_ENABLE_CUDASIM=1 when numba is not yet imported; run the file alone, in its own
process). The engine part skips there: it needs a real GPU.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

SIM = os.environ.get("TF_ASYNC_GPU_TESTS_SIM") == "1"
if SIM:  # before numba is first imported (the imports below pull it in)
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from tests.cuda_sim_check import rel_err  # noqa: E402
from tests.test_gdn_kernels import conv_inputs, delta_inputs, run_delta  # noqa: E402
from tests.test_qwen35_engine import HOT, VARIANTS, write_variant  # noqa: E402
from tf_async.backend.cpu import gdn as cpu_gdn  # noqa: E402
from tf_async.gate import PROMPTS, run_gates  # noqa: E402
from tf_async.models.decoder import ForwardBatch  # noqa: E402

pytestmark = pytest.mark.gpu
DELTA_BOUND = 1e-5
ONE_PASS_BOUND = 2e-6
TINY_BOUND = 1e-4


@dataclass(frozen=True)
class Shape:
    """One GDN layer and one gated-attention layer of a model."""

    hk: int  # linear_num_key_heads
    hv: int  # linear_num_value_heads
    dk: int  # linear_key_head_dim
    dv: int  # linear_value_head_dim
    kernel: int  # linear_conv_kernel_dim
    nh: int  # num_attention_heads (gated attention)
    hd: int  # head_dim
    hidden: int  # hidden_size (the MoE shared-expert gate multiplies [rows, H])

    @property
    def channels(self) -> int:  # C = 2*Hk*dk + Hv*dv
        return 2 * self.hk * self.dk + self.hv * self.dv


REAL_SHAPES = {  # benchmarks/bench_qwen35_gpu.py SHAPES, MODELS.md 5
    "27b": Shape(hk=16, hv=48, dk=128, dv=128, kernel=4, nh=24, hd=256, hidden=5120),
    "35b-a3b": Shape(hk=16, hv=32, dk=128, dv=128, kernel=4, nh=16, hd=256, hidden=2048),
}
SIM_SHAPES = {  # the same head ratios, small enough for the simulator
    "27b": Shape(hk=1, hv=3, dk=8, dv=8, kernel=4, nh=3, hd=8, hidden=16),
    "35b-a3b": Shape(hk=2, hv=4, dk=8, dv=4, kernel=4, nh=2, hd=8, hidden=16),
}
SHAPES = SIM_SHAPES if SIM else REAL_SHAPES
LONG = 16 if SIM else 64  # the longest prompt step
ROWS = (1, 7, LONG)


# ---------------------------------------------------------------------------------------
# where the CUDA kernels run


class Device:
    """CuPy arrays on the GPU (launches on CuPy's current stream, as CudaOps does), or, in
    the simulator, host NumPy arrays."""

    def __init__(self) -> None:
        from cuda_kernels import gdn

        self.gdn = gdn
        if SIM:
            from numba import config

            if not config.ENABLE_CUDASIM:
                pytest.fail("TF_ASYNC_GPU_TESTS_SIM=1 but numba was imported before "
                            "NUMBA_ENABLE_CUDASIM=1 was set: run this file alone")
            self.xp: Any = np
            self.ops: Any = None
            return
        pytest.importorskip("cupy")
        from tf_async.backend.select import cuda_available

        if not cuda_available():
            pytest.skip("no CUDA GPU")
        from tf_async.backend.cuda_ops import CudaOps

        self.ops = CudaOps()
        self.xp = self.ops.xp

    def put(self, a: np.ndarray) -> Any:
        """A device copy of a host array."""
        return self.xp.array(a, copy=True)

    def get(self, a: Any) -> np.ndarray:
        """A host copy of a device array."""
        return np.array(a, copy=True) if self.ops is None else self.ops.to_host(a)

    def poisoned(self, shape: tuple[int, ...]) -> Any:
        return self.xp.full(shape, np.nan, dtype=np.float32)

    def launch(self, name: str, *args: Any) -> None:
        """Launcher `name` of cuda_kernels/gdn.py on these arguments, then wait for it."""
        if self.ops is None:
            getattr(self.gdn, name)(*args)
            return
        views = [self.ops._dev(a) if isinstance(a, self.xp.ndarray) else a for a in args]
        getattr(self.gdn, name)(*views, stream=self.ops._stream())
        self.ops.synchronize()


@pytest.fixture(scope="module")
def dev() -> Device:
    return Device()


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng()


# ---------------------------------------------------------------------------------------
# gated delta rule

STEP_NAMES = ("q", "k", "v", "g", "beta")


def gpu_delta(dev: Device, kernel: str, inp: dict[str, np.ndarray], rows: slice = slice(None),
              state: Any = None) -> tuple[np.ndarray, Any]:
    """(out on the host, device state after) of a one-stream delta-rule launcher."""
    state = dev.put(inp["state"]) if state is None else state
    q, k, v, g, beta = (dev.put(inp[n][rows]) for n in STEP_NAMES)
    out = dev.poisoned(v.shape)
    dev.launch(kernel, q, k, v, g, beta, state, out)
    return dev.get(out), state


@pytest.mark.parametrize("kernel", ["gated_delta_rule", "gated_delta_rule_column_parallel"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", list(SHAPES))
def test_delta_rule_matches_cpu_twin(dev, rng, model, rows, kernel) -> None:
    s = SHAPES[model]
    inp = delta_inputs(rng, rows, s.hk, s.hv, s.dk, s.dv)
    out, state = gpu_delta(dev, kernel, inp)
    want_out, want_state = run_delta(getattr(cpu_gdn, kernel), inp)
    assert np.isfinite(out).all(), "rows left unwritten"
    assert rel_err(out, want_out) < DELTA_BOUND
    assert rel_err(dev.get(state), want_state) < DELTA_BOUND


@pytest.mark.parametrize("model", list(SHAPES))
def test_delta_rule_split_equals_whole(dev, rng, model) -> None:
    """64 prompt rows (16 in the simulator) in one chunked launch == the recurrent launch ==
    cut into 1 + 6 + the rest == one decode row at a time, outputs and states bit for bit."""
    s = SHAPES[model]
    inp = delta_inputs(rng, LONG, s.hk, s.hv, s.dk, s.dv)
    whole, whole_state = gpu_delta(dev, "gated_delta_rule_column_parallel", inp)
    recurrent, recurrent_state = gpu_delta(dev, "gated_delta_rule", inp)
    assert np.array_equal(recurrent, whole) and np.array_equal(dev.get(recurrent_state),
                                                               dev.get(whole_state))
    state = dev.put(inp["state"])
    pieces = [gpu_delta(dev, "gated_delta_rule_column_parallel", inp, cut, state)[0]
              for cut in (slice(0, 1), slice(1, 7), slice(7, None))]
    assert np.array_equal(np.concatenate(pieces), whole), "split != whole"
    assert np.array_equal(dev.get(state), dev.get(whole_state)), "split state != whole state"
    state = dev.put(inp["state"])
    steps = [gpu_delta(dev, "gated_delta_rule", inp, slice(t, t + 1), state)[0]
             for t in range(LONG)]
    assert np.array_equal(np.concatenate(steps), whole), "one row at a time != whole"
    assert np.array_equal(dev.get(state), dev.get(whole_state))


STREAMS = ((7, 4), (1, 0), (LONG, 6), (1, 2), (7, 1))  # (rows, state slot): prompt steps, decodes


def _mixed_with_v(rng: np.random.Generator, s: Shape, v: np.ndarray) -> np.ndarray:
    """A conv-output-like [rows, C] buffer whose v channels hold v (the engine passes v as a
    strided view of the conv output)."""
    mixed = rng.standard_normal((v.shape[0], s.channels)).astype(np.float32)
    mixed[:, 2 * s.hk * s.dk:] = v.reshape(v.shape[0], -1)
    return mixed


@pytest.mark.parametrize("model", list(SHAPES))
def test_delta_rule_batch_of_streams(dev, rng, model) -> None:
    """Rows of five streams in one launch (state slots out of order, v a strided view as in
    the engine) == each stream alone, bit for bit; slots no row names stay untouched; and
    the batch against the CPU batch kernel."""
    s = SHAPES[model]
    streams = [delta_inputs(rng, n, s.hk, s.hv, s.dk, s.dv) for n, _ in STREAMS]
    slots = [slot for _, slot in STREAMS]
    states = rng.standard_normal((7, s.hv, s.dk, s.dv)).astype(np.float32)
    for inp, slot in zip(streams, slots, strict=True):
        states[slot] = inp["state"]
    cat = {n: np.concatenate([inp[n] for inp in streams]) for n in STEP_NAMES}
    rows = cat["v"].shape[0]
    row_seq = np.repeat(np.array(slots, np.int32), [n for n, _ in STREAMS])
    mixed = dev.put(_mixed_with_v(rng, s, cat["v"]))
    v_view = mixed[:, 2 * s.hk * s.dk:].reshape(rows, s.hv, s.dv)
    if dev.ops is None:  # the simulator copies host arrays in, which must be contiguous
        v_view = np.ascontiguousarray(v_view)
    dev_states, out = dev.put(states), dev.poisoned((rows, s.hv, s.dv))
    thawed = dev.put(np.zeros(states.shape[0], np.uint8))
    dev.launch("gated_delta_rule_batch", dev.put(cat["q"]), dev.put(cat["k"]), v_view,
               dev.put(cat["g"]), dev.put(cat["beta"]), dev_states, dev.put(row_seq), thawed, out)
    got, got_states = dev.get(out), dev.get(dev_states)
    # every stream frozen (draft verification): the same rows, no state written
    frozen_states, frozen_out = dev.put(states), dev.poisoned((rows, s.hv, s.dv))
    dev.launch("gated_delta_rule_batch", dev.put(cat["q"]), dev.put(cat["k"]), v_view,
               dev.put(cat["g"]), dev.put(cat["beta"]), frozen_states, dev.put(row_seq),
               dev.put(np.ones(states.shape[0], np.uint8)), frozen_out)
    assert np.array_equal(dev.get(frozen_out), got), "frozen rows differ"
    assert np.array_equal(dev.get(frozen_states), states), "a frozen state was written"
    offsets = np.cumsum([0, *(n for n, _ in STREAMS)])
    for i, inp in enumerate(streams):
        solo, solo_state = gpu_delta(dev, "gated_delta_rule", inp)
        assert np.array_equal(got[offsets[i]:offsets[i + 1]], solo), f"stream {i}: batch != solo"
        assert np.array_equal(got_states[slots[i]], dev.get(solo_state)), f"stream {i} state"
    for slot in (3, 5):
        assert np.array_equal(got_states[slot], states[slot]), f"slot {slot} was written"
    cpu_states, cpu_out = states.copy(), np.full((rows, s.hv, s.dv), np.nan, np.float32)
    cpu_gdn.gated_delta_rule_batch(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"],
                                   cpu_states, row_seq, np.zeros(states.shape[0], np.uint8), cpu_out)
    assert rel_err(got, cpu_out) < DELTA_BOUND
    assert rel_err(got_states, cpu_states) < DELTA_BOUND


# ---------------------------------------------------------------------------------------
# causal conv


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", list(SHAPES))
def test_conv_rows_and_steps(dev, rng, model, rows) -> None:
    """Prompt rows against the CPU twin (the carried state exactly: raw rows), and one-step
    launches row by row == the rows launch, bit for bit."""
    s = SHAPES[model]
    inp = conv_inputs(rng, rows, s.channels, s.kernel)
    state, out = dev.put(inp["state"]), dev.poisoned(inp["x"].shape)
    weight = dev.put(inp["weight"])
    dev.launch("causal_conv1d_rows", dev.put(inp["x"]), state, weight, out)
    got, got_state = dev.get(out), dev.get(state)
    cpu_state, cpu_out = inp["state"].copy(), np.full(inp["x"].shape, np.nan, np.float32)
    cpu_gdn.causal_conv1d_rows(inp["x"], cpu_state, inp["weight"], cpu_out)
    assert np.isfinite(got).all()
    assert rel_err(got, cpu_out) < ONE_PASS_BOUND
    assert np.array_equal(got_state, cpu_state)
    step_state, steps = dev.put(inp["state"]), []
    for t in range(rows):
        step_out = dev.poisoned((s.channels,))
        dev.launch("causal_conv1d_step", dev.put(inp["x"][t]), step_state, weight, step_out)
        steps.append(dev.get(step_out))
    assert np.array_equal(np.stack(steps), got), "conv step != rows"
    assert np.array_equal(dev.get(step_state), got_state)


@pytest.mark.parametrize("model", list(SHAPES))
def test_conv_batch_of_streams(dev, rng, model) -> None:
    s = SHAPES[model]
    streams = [conv_inputs(rng, n, s.channels, s.kernel) for n, _ in STREAMS]
    weight = streams[0]["weight"]
    slots = [slot for _, slot in STREAMS]
    states = rng.standard_normal((7, s.kernel - 1, s.channels)).astype(np.float32)
    for inp, slot in zip(streams, slots, strict=True):
        states[slot] = inp["state"]
    x = np.concatenate([inp["x"] for inp in streams])
    row_seq = np.repeat(np.array(slots, np.int32), [n for n, _ in STREAMS])
    dev_states, out = dev.put(states), dev.poisoned(x.shape)
    dev.launch("causal_conv1d_batch", dev.put(x), dev_states, dev.put(weight), dev.put(row_seq),
               dev.put(np.zeros(7, np.uint8)), out)
    got, got_states = dev.get(out), dev.get(dev_states)
    frozen_states, frozen_out = dev.put(states), dev.poisoned(x.shape)
    dev.launch("causal_conv1d_batch", dev.put(x), frozen_states, dev.put(weight), dev.put(row_seq),
               dev.put(np.ones(7, np.uint8)), frozen_out)
    assert np.array_equal(dev.get(frozen_out), got), "frozen conv rows differ"
    assert np.array_equal(dev.get(frozen_states), states), "a frozen conv state was written"
    offsets = np.cumsum([0, *(n for n, _ in STREAMS)])
    for i, inp in enumerate(streams):
        state, solo = dev.put(inp["state"]), dev.poisoned(inp["x"].shape)
        dev.launch("causal_conv1d_rows", dev.put(inp["x"]), state, dev.put(weight), solo)
        assert np.array_equal(got[offsets[i]:offsets[i + 1]], dev.get(solo)), f"stream {i}"
        assert np.array_equal(got_states[slots[i]], dev.get(state)), f"stream {i} state"
    for slot in (3, 5):
        assert np.array_equal(got_states[slot], states[slot]), f"slot {slot} was written"
    cpu_states, cpu_out = states.copy(), np.full(x.shape, np.nan, np.float32)
    cpu_gdn.causal_conv1d_batch(x, cpu_states, weight, row_seq, np.zeros(7, np.uint8), cpu_out)
    assert rel_err(got, cpu_out) < ONE_PASS_BOUND
    assert np.array_equal(got_states, cpu_states)


# ---------------------------------------------------------------------------------------
# gates, q/k norm, gated RMSNorm, gated attention


def _against_cpu(dev: Device, name: str, args: list[Any], out_shapes: list[tuple[int, ...]],
                 bound: float | None) -> list[np.ndarray]:
    """Launch `name` on the GPU and its CPU twin (NaN-poisoned outputs); compare every output
    (bound None: bit for bit); when there are several rows, the middle row alone must give
    the same bits as among the others. Returns the GPU outputs."""
    dev_args = [dev.put(a) if isinstance(a, np.ndarray) else a for a in args]
    outs = [dev.poisoned(shape) for shape in out_shapes]
    dev.launch(name, *dev_args, *outs)
    got = [dev.get(o) for o in outs]
    want = [np.full(shape, np.nan, np.float32) for shape in out_shapes]
    getattr(cpu_gdn, name)(*args, *want)
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g).all(), name
        if bound is None:
            assert np.array_equal(g, w), name
        else:
            assert rel_err(g, w) < bound, name
    rows = out_shapes[0][0]
    if rows > 1:
        mid = rows // 2
        row_args = [a[mid:mid + 1] if isinstance(a, np.ndarray) and a.ndim > 1 else a
                    for a in args]
        alone = _against_cpu(dev, name, row_args, [(1, *sh[1:]) for sh in out_shapes], bound)
        for g, a in zip(got, alone, strict=True):
            assert np.array_equal(g[mid:mid + 1], a), f"{name}: row {mid} depends on the batch"
    return got


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", list(SHAPES))
def test_gates_and_norms(dev, rng, model, rows) -> None:
    s, f32 = SHAPES[model], np.float32
    a, b = (rng.standard_normal((rows, s.hv)).astype(f32) * 4 for _ in range(2))
    a[0, 0], b[0, -1] = 30.0, -40.0  # softplus's linear branch; sigmoid far in its tail
    a_log = rng.standard_normal(s.hv).astype(f32)
    dt_bias = rng.standard_normal(s.hv).astype(f32)
    _against_cpu(dev, "gdn_gates", [a, b, a_log, dt_bias], [(rows, s.hv)] * 2, ONE_PASS_BOUND)
    mixed = rng.standard_normal((rows, s.channels)).astype(f32)
    _against_cpu(dev, "gdn_qk_l2norm", [mixed, s.hk, s.dk, 1e-6, s.dk ** -0.5],
                 [(rows, s.hk, s.dk)] * 2, ONE_PASS_BOUND)
    x, z = (rng.standard_normal((rows, s.hv, s.dv)).astype(f32) for _ in range(2))
    norm_w = (1 + 0.1 * rng.standard_normal(s.dv)).astype(f32)
    _against_cpu(dev, "gated_rms_norm", [x, z, norm_w, 1e-6], [(rows, s.hv, s.dv)],
                 ONE_PASS_BOUND)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", list(SHAPES))
def test_gated_attention_kernels(dev, rng, model, rows) -> None:
    """split_query_gate copies exactly; sigmoid_gate_mul against the CPU, out of place and in
    place (the engine writes into attn), and at the MoE shared-expert gate's width H."""
    s, f32 = SHAPES[model], np.float32
    width = s.nh * s.hd
    qg = rng.standard_normal((rows, 2 * width)).astype(f32)
    _, gate = _against_cpu(dev, "split_query_gate", [qg, s.nh, s.hd],
                           [(rows, s.nh, s.hd), (rows, width)], None)
    attn = rng.standard_normal((rows, width)).astype(f32)
    (gated,) = _against_cpu(dev, "sigmoid_gate_mul", [attn, gate], [(rows, width)],
                            ONE_PASS_BOUND)
    in_place = dev.put(attn)
    dev.launch("sigmoid_gate_mul", in_place, dev.put(gate), in_place)
    assert np.array_equal(dev.get(in_place), gated), "in place != out of place"
    shared = rng.standard_normal((rows, s.hidden)).astype(f32)
    shared_gate = np.repeat(rng.standard_normal((rows, 1)).astype(f32) * 3, s.hidden, axis=1)
    _against_cpu(dev, "sigmoid_gate_mul", [shared, shared_gate], [(rows, s.hidden)],
                 ONE_PASS_BOUND)


# ---------------------------------------------------------------------------------------
# the hybrid layer's fused launches (CudaOps) against the ops they replace, bit for bit


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_hybrid_ops_give_the_bits_of_the_ops_they_replace(gpu, rng, monkeypatch, rows) -> None:
    """shared_expert_add == sigmoid_gate_mul on the broadcast gate, + routed, + h; moe with the
    experts' [gate; up] fused (one swiglu launch; sorted path at 300 rows) == gate and up apart;
    rms_norm_for + one matmul on the concatenated GDN inputs == the four matmuls on rms_norm's
    rows; linear_into == h + linear."""
    from tf_async.backend import cuda_ops
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.backend.weights import DenseWeight, quantize_affine

    ops, f32, hidden = CudaOps(), np.float32, 512
    h, routed, shared = (rng.standard_normal((rows, hidden)).astype(f32) for _ in range(3))
    gate = (3 * rng.standard_normal((rows, 1))).astype(f32)
    got = ops.asarray(h)
    ops.shared_expert_add(got, ops.asarray(routed), ops.asarray(shared), ops.asarray(gate))
    gated = ops.asarray(shared)
    ops.sigmoid_gate_mul(gated, ops.asarray(np.repeat(gate, hidden, axis=1)))
    want = ops.asarray(h) + (ops.asarray(routed) + gated)
    assert np.array_equal(ops.to_host(got), ops.to_host(want))

    experts, inter, top_k = 16, 128, 4
    router = DenseWeight(rng.standard_normal((experts, hidden)).astype(f32))
    e_gate, e_up = (ops.upload_linear(quantize_affine(
        rng.standard_normal((experts, inter, hidden)).astype(f32), 4, 64)) for _ in range(2))
    down = ops.upload_linear(quantize_affine(rng.standard_normal((experts, hidden, inter)).astype(f32), 4, 64))
    router = ops.upload_linear(router)
    fused = ops.concat_linears([e_gate, e_up])
    assert fused is not None
    x = ops.asarray(rng.standard_normal((rows, hidden)).astype(f32))
    apart = ops.to_host(ops.moe(x, router, e_gate, e_up, down, top_k, True))
    together = ops.to_host(ops.moe(x, router, *fused[1], down, top_k, True, gate_up=fused[0]))
    assert np.array_equal(apart, together)
    monkeypatch.setattr(cuda_ops, "MOE_SORTED_MIN_SLOTS", 1 << 30)  # every row one slot a row
    assert np.array_equal(ops.to_host(ops.moe(x, router, *fused[1], down, top_k, True,
                                              gate_up=fused[0])), together)

    norm = (1 + 0.1 * rng.standard_normal(hidden)).astype(f32)
    widths = [96, 64, 8, 8]
    parts = [ops.upload_linear(quantize_affine(rng.standard_normal((n, hidden)).astype(f32), 4, 64))
             for n in widths]
    whole, _ = ops.concat_linears(parts)
    hx = ops.asarray(h)
    one = ops.to_host(ops.linear(ops.rms_norm_for(hx, ops.asarray(norm), 1e-6, whole), whole))
    normed = ops.rms_norm(hx, ops.asarray(norm), 1e-6)
    assert np.array_equal(one, np.concatenate([ops.to_host(ops.linear(normed, p)) for p in parts], axis=1))
    into = ops.asarray(routed)
    out_w = ops.upload_linear(quantize_affine(rng.standard_normal((hidden, 128)).astype(f32), 4, 64))
    y = ops.asarray(rng.standard_normal((rows, 128)).astype(f32))
    ops.linear_into(y, out_w, into)
    assert np.array_equal(ops.to_host(into), routed + ops.to_host(ops.linear(y, out_w)))


# ---------------------------------------------------------------------------------------
# the engine and the hybrid decoder on the GPU (tiny checkpoints)


@pytest.fixture(scope="module")
def gpu() -> None:
    if SIM:
        pytest.skip("the simulator runs the kernel part only; the engine needs a real GPU")
    pytest.importorskip("cupy")
    from tf_async.backend.select import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")


@pytest.fixture(scope="module")
def hybrids(gpu, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The CPU engine tests' tiny hybrids: dense and MoE, HF bf16 and MLX 4-bit, with MTP."""
    from tf_async.models.loader import load_checkpoint

    return {name: load_checkpoint(write_variant(tmp_path_factory.mktemp(f"gpu_{name}"), moe,
                                                kind, **kw))
            for name, (moe, kind, kw) in VARIANTS.items()}


GATE_CASES = [(name, "f32") for name in VARIANTS] + [("moe-mlx4", "fp8")]


@pytest.mark.parametrize("name,kv_dtype", GATE_CASES)
@pytest.mark.asyncio
async def test_every_gate_holds_on_the_gpu(hybrids, name, kv_dtype) -> None:
    """concurrent == solo, paging == contiguous, stepped == whole, drafted == plain (MTP and
    ngram), greedy and seeded (hot, far from greedy), idle is empty."""
    rows, idle = await run_gates(hybrids[name], device="cuda", kv_dtype=kv_dtype,
                                 max_tokens=10, ctx=128, prompts=PROMPTS[:6],
                                 drafters=("mtp", "ngram"), temperature=HOT)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert len(rows) == 2 * (4 + 1 + 3 + 1 + 1 + 2) + 1
    mtp = idle["drafted-mtp-seeded"]
    assert mtp["drafted_tokens"] > 0 and mtp["recurrent_state_bytes_per_lane"] > 0
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())


@pytest.mark.asyncio
async def test_engine_keeps_the_recurrent_state_on_the_device(hybrids) -> None:
    import cupy

    from tf_async import Engine

    async with Engine(hybrids["moe-mlx4"], device="cuda", parallel=2, ctx=128,
                      drafter="mtp") as eng:
        states = eng.parts.runner.states
        assert eng.parts.ops.name == "cuda"
        assert isinstance(states.conv, cupy.ndarray) and isinstance(states.delta, cupy.ndarray)
        done = await eng.complete("Hello there", max_tokens=5, temperature=0.0)
        assert len(done.token_ids) == 5
    assert eng.stats()["lanes_in_use"] == 0


@pytest.mark.asyncio
async def test_hybrid_decode_steps_equal_one_step_on_the_gpu(hybrids) -> None:
    """--decode-steps on a hybrid: each step's token fed on the device, the recurrent state
    advanced a token a step; the same tokens as one step a round (greedy and seeded)."""
    from tf_async import Engine

    async def run(steps: int) -> list[list[int]]:
        async with Engine(hybrids["dense-mlx4"], device="cuda", parallel=4, ctx=128, page_size=4,
                          decode_steps=steps, prefix_cache=False) as eng:
            outs = await asyncio.gather(*(eng.complete(p, max_tokens=12, ignore_eos=True,
                                                       **({"temperature": HOT, "seed": i} if i % 2 else {}))
                                          for i, p in enumerate(PROMPTS[:4])))
        assert eng.stats()["lanes_in_use"] == 0
        return [o.token_ids for o in outs]

    assert await run(4) == await run(1)


PAGE = 4
PAGES_PER_STREAM = 8
PROMPT = [5, 17, 200, 33, 9, 41, 300, 7, 12, 250, 3, 77, 18, 64, 2, 140, 9, 31, 5, 222, 13, 8]
STREAM_TOKENS = (PROMPT, PROMPT[4:11], PROMPT[9:10])  # 22, 7 and 1 rows


def _round(decoder: Any, kv: Any, streams: list[tuple[int, list[int], int]], scales: Any
           ) -> list[np.ndarray]:
    """One forward over the rows of `streams` (lane, tokens, start position); lane i owns pages
    [8i, 8i + 8). Logits of every row on the host, per stream."""
    ops = decoder.ops
    table = np.array([[lane * PAGES_PER_STREAM + p for p in range(PAGES_PER_STREAM)]
                      for lane, _, _ in streams], np.int32)
    tokens: list[int] = []
    pos: list[int] = []
    seq: list[int] = []
    for i, (_, ids, start) in enumerate(streams):
        tokens += ids
        pos += range(start, start + len(ids))
        seq += [i] * len(ids)
    pos_a, seq_a = np.array(pos, np.int64), np.array(seq, np.int32)
    slots = table[seq_a, pos_a // PAGE].astype(np.int64) * PAGE + pos_a % PAGE
    lanes = np.array([lane for lane, _, _ in streams], np.int32)
    put = ops.asarray
    batch = ForwardBatch(put(np.array(tokens, np.int64)), put(pos_a), put(slots), put(seq_a),
                         put(table), put(np.arange(len(tokens), dtype=np.int64)), PAGE,
                         put(lanes))
    logits, _ = decoder.forward(batch, kv, scales)
    host = ops.to_host(logits)
    bounds = np.cumsum([0, *(len(ids) for _, ids, _ in streams)])
    return [host[bounds[i]:bounds[i + 1]] for i in range(len(streams))]


def _run(decoder: Any, streams: list[tuple[int, list[int]]], step: int | None = None
         ) -> list[np.ndarray]:
    """Every stream (lane, tokens) from zero state in a fresh arena, all streams in each round,
    prompts cut into `step` rows a round (None: whole). Logits of every row, per stream."""
    cfg = decoder.config
    kv = decoder.ops.alloc_kv(cfg.num_layers, 3 * PAGES_PER_STREAM * PAGE, cfg.num_kv_heads,
                              cfg.head_dim, "f32")
    scales = decoder.ops.asarray(np.ones((cfg.num_layers, 2), np.float32))  # one a run: a graph key
    for lane, _ in streams:
        decoder.states.zero(lane)
    out: list[list[np.ndarray]] = [[] for _ in streams]
    longest = max(len(ids) for _, ids in streams)
    step = step or longest
    for start in range(0, longest, step):
        live = [(i, lane, ids[start:start + step]) for i, (lane, ids) in enumerate(streams)
                if start < len(ids)]
        got = _round(decoder, kv, [(lane, part, start) for _, lane, part in live], scales)
        for (i, _, _), rows in zip(live, got, strict=True):
            out[i].append(rows)
    return [np.concatenate(parts) for parts in out]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hybrid_decoder_gpu_logits_close_to_cpu_and_batch_invariant(hybrids, name) -> None:
    from tf_async.backend.cpu.ops import CpuOps
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.models.loader import make_decoder

    ckpt = hybrids[name]
    streams = [(lane, list(ids)) for lane, ids in enumerate(STREAM_TOKENS)]
    cpu = _run(make_decoder(ckpt, CpuOps(int8_x=True), num_lanes=3), streams)  # the GPU's int8 x
    decoder = make_decoder(ckpt, CudaOps(), num_lanes=3)
    gpu = _run(decoder, streams)
    cpu_all, gpu_all = np.concatenate(cpu), np.concatenate(gpu)
    assert np.isfinite(gpu_all).all()
    nudged = np.concatenate(_run(make_decoder(ckpt, _nudged_embeddings_ops(), num_lanes=3), streams))
    bound = max(TINY_BOUND, 4 * _rel_max(nudged, cpu_all))  # int8 x: what one ulp upstream does
    assert _rel_max(gpu_all, cpu_all) <= bound
    for i, (_, ids) in enumerate(streams):
        alone = _run(decoder, [((i + 1) % 3, ids)])[0]  # alone, in another lane
        assert np.array_equal(alone, gpu[i]), f"stream {i}: alone != among others"
    for step in (1, 3, 7):
        stepped = _run(decoder, streams, step)
        for i, rows in enumerate(stepped):
            assert np.array_equal(rows, gpu[i]), f"stream {i}: stepped ({step}) != whole"


def _rel_max(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _nudged_embeddings_ops() -> Any:
    from tf_async.backend.cpu.ops import CpuOps

    class Nudged(CpuOps):
        """The CPU backend with every embedding row one ulp up: the sensitivity of a model's
        logits to a single rounding difference at its input."""

        def embed(self, w: Any, ids: Any) -> Any:
            return np.nextafter(super().embed(w, ids), np.float32(np.inf)).astype(np.float32)

    return Nudged(int8_x=True)


@pytest.mark.parametrize("name", ["dense-mlx4", "moe-mlx4"])
def test_hybrid_rounds_replayed_from_graphs_equal_eager(hybrids, name) -> None:
    """GraphDecoder over a HybridDecoder: rounds whose rows all want logits are captured once a
    shape and replayed with the lanes' states addressed through the lane table: the same bits
    as the eager decoder, in any lane, whole or stepped (MoE: rounds past the sorted-expert
    threshold run eagerly, with the same bits)."""
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.models.graph_decoder import GraphDecoder
    from tf_async.models.loader import make_decoder

    ckpt = hybrids[name]
    streams = [(lane, list(ids)) for lane, ids in enumerate(STREAM_TOKENS)]
    eager = _run(make_decoder(ckpt, CudaOps(), num_lanes=3), streams)
    graphed = GraphDecoder(make_decoder(ckpt, CudaOps(), num_lanes=3))  # type: ignore[arg-type]
    for step in (1, 3, None):
        for i, rows in enumerate(_run(graphed, streams, step)):
            assert np.array_equal(rows, eager[i]), f"stream {i}: graphed (step {step}) != eager"
    swapped = [((lane + 1) % 3, ids) for lane, ids in streams]
    for i, rows in enumerate(_run(graphed, swapped, 1)):
        assert np.array_equal(rows, eager[i]), f"stream {i} in lane {(i + 1) % 3}: != eager"
    assert graphed.num_replays > 10
    assert all(g is not None for g in graphed._graphs.values())  # every capture succeeded


@pytest.mark.asyncio
async def test_hybrid_engine_replays_decode_rounds_from_graphs(hybrids) -> None:
    """The engine's default on a GPU: a hybrid's plain decode rounds (and decode steps) replay
    graphs; outputs equal cuda_graphs=False token for token, greedy and seeded."""
    from tf_async import Engine

    async def run(graphs: bool, steps: int) -> tuple[list[list[int]], int]:
        async with Engine(hybrids["moe-mlx4"], device="cuda", parallel=4, ctx=128,
                          cuda_graphs=graphs, decode_steps=steps) as eng:
            outs = await asyncio.gather(*(eng.complete(p, max_tokens=12, ignore_eos=True,
                                                       **({"temperature": HOT, "seed": i} if i % 2 else {}))
                                          for i, p in enumerate(PROMPTS[:4])))
            replays = getattr(eng.parts.runner.decoder, "num_replays", 0)
        assert eng.stats()["lanes_in_use"] == 0
        return [o.token_ids for o in outs], replays

    plain, _ = await run(False, 1)
    for steps in (1, 4):
        graphed, replays = await run(True, steps)
        assert graphed == plain, f"decode steps {steps}"
        assert replays > 5


@pytest.mark.parametrize("name", ["dense-mlx4", "moe-mlx4"])
@pytest.mark.asyncio
async def test_verify_rounds_replayed_from_graphs_keep_every_gate(hybrids, name, monkeypatch) -> None:
    """CAPTURE_VERIFY_ROUNDS on: rounds that verify drafts (their rows stashed through the plan
    buffer) and MTP rounds (every row's hidden) replay graphs too; every gate holds (drafted ==
    plain with mtp and ngram, greedy and seeded) and verify rounds really were replayed."""
    from tests.engine_helpers import graph_decoders_built
    from tf_async.models import graph_decoder

    monkeypatch.setattr(graph_decoder, "CAPTURE_VERIFY_ROUNDS", True)
    made = graph_decoders_built(monkeypatch)
    rows, idle = await run_gates(hybrids[name], device="cuda", max_tokens=10, ctx=128,
                                 prompts=PROMPTS[:6], drafters=("mtp", "ngram"), temperature=HOT)
    failed = [r for r in rows if not r.ok]
    assert not failed, failed
    assert all(s["pages_in_use"] == 0 and s["lanes_in_use"] == 0 for s in idle.values())
    graphed = [g for g in made if isinstance(g, graph_decoder.GraphDecoder)]
    assert graphed and sum(g.num_verify_replays for g in graphed) > 0
    assert sum(g._commits.num_replays for g in graphed if g._commits is not None) > 0


@pytest.mark.parametrize("name", ["dense-mlx4", "moe-mlx4"])
def test_mtp_head_graphs_equal_eager(hybrids, name) -> None:
    """The MTP head with graphs (its draft steps and committed-slot writes replayed, keyed by
    the ring's address): logits, outputs and ring bits equal the eager head's, over rounds
    that wrap the ring, in two rings at once; the calls really were replayed."""
    import cupy

    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.models.loader import make_decoder
    from tf_async.models.mtp import MtpHead

    ckpt = hybrids[name]
    decoder = make_decoder(ckpt, CudaOps(), num_lanes=2)
    heads = {False: MtpHead(decoder), True: MtpHead(decoder, graphs=True)}  # type: ignore[arg-type]
    cfg = decoder.config
    scales = cupy.asarray(np.ones((1, 2), np.float32))

    def drive(graphs: bool) -> list[np.ndarray]:
        head, seen = heads[graphs], []
        rings = [decoder.ops.alloc_kv(1, 16, cfg.num_kv_heads, cfg.head_dim, "f32") for _ in range(2)]
        local = np.random.default_rng(7)
        pos = [0, 0]
        for _ in range(9):
            for r, ring in enumerate(rings):
                n = int(local.integers(1, 5))
                hidden = cupy.asarray(local.standard_normal((n, cfg.hidden_size), np.float32))
                tokens = local.integers(0, cfg.vocab_size, n).tolist()
                head.write_slots(tokens, pos[r], hidden, ring, scales)
                pos[r] += n
                h = hidden[-1:]
                for step in range(3):
                    logits, h = head.rows(np.asarray([tokens[-1]], np.int64),
                                          np.asarray([pos[r] + step], np.int64), h, ring, scales)
                    seen += [cupy.asnumpy(logits), cupy.asnumpy(h)]
                seen.append(cupy.asnumpy(ring))
        return seen

    eager, graphed = drive(False), drive(True)
    assert len(eager) == len(graphed)
    for i, (a, b) in enumerate(zip(eager, graphed, strict=True)):
        assert np.array_equal(a, b), f"output {i}: graphed != eager"
    graphs = heads[True].graphs
    assert graphs is not None and graphs.num_replays > 20 and graphs.num_captures > 2
