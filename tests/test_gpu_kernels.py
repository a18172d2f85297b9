"""The CUDA kernels on a real GPU at real sizes (`pytest -m gpu`): fresh random inputs each
run, outputs poisoned with NaN before every launch, float64 references, and batch
invariance bit for bit (a row alone == the same row among others).

Error bounds (relative Frobenius error against float64 on the same stored values):
float32 arithmetic everywhere, so 2e-5 for matmuls and attention over thousands of terms and
1e-5 for row-wise ops; KV conversions and token choices must match exactly. Affine matmuls
multiply int8 x (cuda_kernels/qdot.py), so their references use that x: float64 of it, or
CpuOps(int8_x=True) (the CPU twin of those numerics).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import cuda_sim_check as ref

pytestmark = pytest.mark.gpu
MATMUL_BOUND = 2e-5
ATTN_BOUND = 2e-5
ROW_BOUND = 1e-5


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("cupy")
    from tf_async.backend.cuda_ops import CudaOps

    return CudaOps()


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng()


def _poisoned(ops, shape, dtype=np.float32):
    fill = np.nan if np.dtype(dtype).kind == "f" else -1
    return ops.xp.full(shape, fill, dtype=dtype)


def _run(ops, fn, *arrays_and_scalars, **kw) -> None:
    args = [ops._dev(a) if isinstance(a, ops.xp.ndarray) else a for a in arrays_and_scalars]
    fn(*args, ops._stream(), **kw)
    ops.synchronize()


def _matmul(ops, kind, x, parts, gs, path=None):
    from cuda_kernels import launch

    out = _poisoned(ops, (x.shape[0], parts[0].shape[1]))
    _run(ops, launch.matmul, kind, ops.asarray(x), *[ops.asarray(p) for p in parts], gs,
         ops._no_experts, out, path=path)
    return ops.to_host(out)


@pytest.mark.parametrize("kind,bits", [("q4", 4), ("q8", 8)])
def test_affine_matmul_paths_and_batch_invariance(ops, rng, kind, bits) -> None:
    in_f, out_f, gs = 4096, 1536, 64
    codes, scales, biases, deq = ref.affine_weight(rng, 1, out_f, in_f, bits, gs)
    x = rng.standard_normal((37, in_f)).astype(np.float32)
    parts = (codes, scales, biases)
    many = _matmul(ops, kind, x, parts, gs, path="many")
    few = _matmul(ops, kind, x, parts, gs, path="few")
    assert ref.rel_err(many, ref.affine_x_ref(x, gs) @ deq[0].T) < MATMUL_BOUND
    assert np.array_equal(many, few), "few-rows and many-rows paths differ"
    for rows in (1, 3, 8, 20):
        part = _matmul(ops, kind, x[5 : 5 + rows], parts, gs)
        assert np.array_equal(part, many[5 : 5 + rows]), rows


@pytest.mark.parametrize("kind,bits,gs", [("q4", 4, 64), ("q8", 8, 32)])
def test_tensor_core_rows_are_bit_identical_at_every_row_count(ops, rng, kind, bits, gs) -> None:
    """Rows through the tensor cores (cuda_kernels/qmma.py, 3+ rows) give the bits of the same
    rows alone (qdot's one-row kernel) at 1, 7, 64, 512 and 2048 rows a launch."""
    in_f, out_f = 4096, 1040  # not a whole number of 32-feature blocks
    codes, scales, biases, deq = ref.affine_weight(rng, 1, out_f, in_f, bits, gs)
    x = rng.standard_normal((2048, in_f)).astype(np.float32)
    parts = (codes, scales, biases)
    full = _matmul(ops, kind, x, parts, gs)
    assert ref.rel_err(full, ref.affine_x_ref(x, gs) @ deq[0].T) < MATMUL_BOUND
    for rows in (1, 7, 64, 512):
        start = int(rng.integers(0, 2048 - rows))
        assert np.array_equal(_matmul(ops, kind, x[start : start + rows], parts, gs), full[start : start + rows]), rows
        mma = _matmul(ops, kind, x[start : start + rows], parts, gs, path="mma")  # whatever 'many' would pick
        assert np.array_equal(mma, full[start : start + rows]), rows


@pytest.mark.parametrize("in_f,gs", [(5120, 64), (17408, 64), (2048, 32)])
def test_few_rows_tensor_core_path_gives_qdot_bits_at_every_row_count(ops, rng, in_f, gs) -> None:
    """The few-rows tensor-core path (cuda_kernels/qmma_few.py) gives qdot's bits at 1 to 16
    rows (one and two row blocks) at Qwen3.5-27B's K (5120, 17408) and a K of 64 chunks."""
    out_f = 1040  # not a whole number of 16-feature blocks
    codes, scales, biases, deq = ref.affine_weight(rng, 1, out_f, in_f, 4, gs)
    x = rng.standard_normal((16, in_f)).astype(np.float32)
    parts = (codes, scales, biases)
    qdot = _matmul(ops, "q4", x, parts, gs, path="few")
    assert ref.rel_err(qdot, ref.affine_x_ref(x, gs) @ deq[0].T) < MATMUL_BOUND
    for rows in (1, 2, 3, 8, 9, 16):
        start = int(rng.integers(0, 17 - rows))
        few = _matmul(ops, "q4", x[start : start + rows], parts, gs, path="mma_few")
        assert np.array_equal(few, qdot[start : start + rows]), rows


@pytest.mark.parametrize("path,rows,in_f", [("mma", 45, 4096), ("mma_few", 8, 5120)])
@pytest.mark.parametrize("epilogue", ["swiglu", "add"])
def test_tensor_core_epilogues_equal_the_one_row_kernel(ops, rng, epilogue, path, rows, in_f) -> None:
    """The tensor-core paths (qmma at 45 rows, qmma_few at 8) with the swiglu and add
    epilogues give qdot's bits."""
    from cuda_kernels import launch

    out_f, gs = 3000, 64
    codes, scales, biases, _ = ref.affine_weight(rng, 1, out_f, in_f, 4, gs)
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    width = out_f // 2 if epilogue == "swiglu" else out_f
    start = rng.standard_normal((rows, width)).astype(np.float32)
    outs = []
    for p in ("few", path):
        out = ops.asarray(start) if epilogue == "add" else _poisoned(ops, (rows, width))
        _run(ops, launch.matmul, "q4", ops.asarray(x), *[ops.asarray(a) for a in (codes, scales, biases)], gs,
             ops._no_experts, out, path=p, epilogue=epilogue)
        outs.append(ops.to_host(out))
    assert np.array_equal(outs[0], outs[1]) and not np.isnan(outs[1]).any()


@pytest.mark.parametrize("kind,bits,gs", [("q4", 4, 64), ("q8", 8, 32)])
def test_int8_x_matmul_equals_cpu_twin(ops, rng, kind, bits, gs) -> None:
    """The int8-activation matmul gives its CPU twin's bits (tf_async/backend/cpu/kernels.py):
    the same int8 x and chunk scales, the same outputs, on both paths."""
    from cuda_kernels import launch
    from tf_async.backend.cpu import kernels as cpu

    rows, in_f, out_f = 5, 4096, 1000
    codes, scales, biases, _ = ref.affine_weight(rng, 1, out_f, in_f, bits, gs)
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    xq_host, xs_host = np.empty((rows, in_f), np.int8), np.empty((rows, in_f // 16), np.float32)
    host = np.full((rows, out_f), np.nan, np.float32)
    cpu.quantize_rows_int8(x, bits == 4, xq_host, xs_host)
    cpu.matmul_affine_int8x(xq_host, xs_host, codes[0], scales[0], biases[0], bits, gs, host)
    parts = [ops._dev(ops.asarray(p)) for p in (x, codes, scales, biases)]
    for path in ("few", "many"):
        xq, xs = ops.xp.full((rows, in_f), 99, ops.xp.int8), _poisoned(ops, (rows, in_f // 16))
        out = _poisoned(ops, (rows, out_f))
        launch.matmul(kind, *parts, gs, ops._dev(ops._no_experts), ops._dev(out), ops._stream(), path=path,
                      xq=ops._dev(xq), xs=ops._dev(xs))
        ops.synchronize()
        assert np.array_equal(ops.to_host(xq), xq_host) and np.array_equal(ops.to_host(xs), xs_host), path
        assert np.array_equal(ops.to_host(out), host), path


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_dense_matmul(ops, rng, kind) -> None:
    w = rng.standard_normal((1, 1000, 2048)).astype(np.float32)
    dummy = np.zeros((1, 1, 1), np.float32)
    if kind == "bf16":
        bits = ref.bf16_bits_ref(w)
        w_val, words = ref.bf16_value_ref(bits), bits.view(np.uint32)
    else:
        w_val, words = w, w
    x = rng.standard_normal((19, 2048)).astype(np.float32)
    out = _matmul(ops, kind, x, (words, dummy, dummy), 1 << 30)
    assert ref.rel_err(out, x @ w_val[0].T.astype(np.float64)) < MATMUL_BOUND
    assert np.array_equal(_matmul(ops, kind, x[7:8], (words, dummy, dummy), 1 << 30), out[7:8])


@pytest.fixture(scope="module")
def matmul_cases():
    return ref.matmul_cases(np.random.default_rng(), rows=37, out_f=4104, scale=16)


@pytest.mark.parametrize("case", range(7))
def test_matmul_rows_paths_alignment_invariance(ops, matmul_cases, case) -> None:
    """Every kind at sizes ending in a partial step, a non-power-of-two group, a row shorter
    than a warp: float64 bound, and each row bit-identical across row counts, paths and
    the alignment of x (scalar-load kernels)."""
    from cuda_kernels import launch

    name, kind, x, parts, gs, want = matmul_cases[case]
    many = _matmul(ops, kind, x, parts, gs, path="many")
    assert ref.rel_err(many, want) < MATMUL_BOUND, name
    assert np.array_equal(_matmul(ops, kind, x, parts, gs, path="few"), many), name
    for start, rows in ((5, 1), (6, 2), (7, 3), (9, 8), (10, 20)):
        got = _matmul(ops, kind, x[start : start + rows], parts, gs)
        assert np.array_equal(got, many[start : start + rows]), (name, rows)
    shifted = ops.xp.empty(3 * x.shape[1] + 1, ops.xp.float32)[1:].reshape(3, x.shape[1])
    shifted[...] = ops.asarray(x[2:5])
    out = _poisoned(ops, (3, parts[0].shape[1]))
    dev_parts = [ops.asarray(p) for p in parts]
    _run(ops, launch.matmul, kind, shifted, *dev_parts, gs, ops._no_experts, out)
    assert np.array_equal(ops.to_host(out), many[2:5]), (name, "unaligned x")


# Qwen3-8B's linears of one layer (out_features, in_features): q, k, v, o, gate, up, down.
QWEN3_8B_LAYER = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096),
                  (12288, 4096), (4096, 12288))


def _layer_weights(xp, kind: str) -> list[tuple[tuple, int]]:
    """One layer's weights on the device: [(words, scales, biases), bytes] per linear."""
    layer = []
    for out_f, in_f in QWEN3_8B_LAYER:
        per_word = 8 if kind == "q4" else 2
        words = (xp.random.random((1, out_f, in_f // per_word)) * 2.0**32).astype(xp.uint32)
        if kind == "q4":
            scales = xp.random.random((1, out_f, in_f // 64), dtype=xp.float32) * 0.01
            parts = (words, scales, -7.5 * scales)
        else:  # bf16 pairs with exponents well inside the finite range
            none = xp.zeros((1, 1, 1), xp.float32)
            parts = (words & xp.uint32(0x3FFF3FFF), none, none)
        layer.append((parts, sum(int(p.nbytes) for p in parts)))
    return layer


def _replay_seconds(xp, stream, record, replays: int) -> float:
    """GPU seconds of one replay of a CUDA graph of record()'s launches on `stream`: record()
    runs once eagerly (compiles), once under capture (relaxed, as
    tf_async/models/graph_decoder.py captures); replays timed with events."""
    with stream:
        record()
        stream.begin_capture(mode=getattr(xp.cuda.runtime, "streamCaptureModeRelaxed", None))
        record()
        graph = stream.end_capture()
        graph.launch(stream)
        start = stream.record()
        for _ in range(replays):
            graph.launch(stream)
        stop = stream.record()
        stop.synchronize()
    return xp.cuda.get_elapsed_time(start, stop) / 1e3 / replays


def _graph_seconds(ops, kind: str, layers: list, rows: int) -> float:
    """GPU seconds per layer: every linear of every layer captured in one CUDA graph (as the
    engine's decode rounds are), replays timed with events."""
    from cuda_kernels import launch

    xp, gs = ops.xp, 64 if kind == "q4" else 1 << 30
    xs = {n: xp.random.standard_normal((rows, n), dtype=xp.float32) for _, n in QWEN3_8B_LAYER}
    outs = {n: xp.empty((rows, n), xp.float32) for n, _ in QWEN3_8B_LAYER}
    scratch = {}  # int8 x for the affine kind: held for the graph's life, not per launch
    for n in xs if kind == "q4" else ():
        q_shape, s_shape = launch.quantize_scratch_shapes(rows, n)
        scratch[n] = {"xq": ops._dev(xp.empty(q_shape, xp.int8)), "xs": ops._dev(xp.empty(s_shape, xp.float32))}
    stream = xp.cuda.Stream(non_blocking=False)
    with stream:
        launches = [(ops._dev(xs[n_in]), [ops._dev(p) for p in parts], ops._dev(outs[n_out]), scratch.get(n_in, {}))
                    for layer in layers
                    for (n_out, n_in), (parts, _) in zip(QWEN3_8B_LAYER, layer, strict=True)]
        experts = ops._dev(ops._no_experts)

    def record() -> None:
        for x, parts, out, kw in launches:
            launch.matmul(kind, x, *parts, gs, experts, out, ops._stream(), **kw)

    return _replay_seconds(xp, stream, record, 5) / len(layers)


@pytest.mark.parametrize("kind", ["q4", "bf16"])
def test_matmul_throughput_qwen3_shapes(ops, kind) -> None:
    """The 7 linears of a Qwen3-8B layer (weights of 4 layers, more than L2 holds) at 1, 8,
    32 and 256 rows: prints ms per 36 layers and weight bytes/s (pytest -s); a measurement for
    docs/PERFORMANCE.md, never a timed assertion. The H200 copies at ~4.2 TB/s."""
    layers = [_layer_weights(ops.xp, kind) for _ in range(4)]
    layer_bytes = sum(nbytes for _, nbytes in layers[0])
    rates = {}
    for rows in (1, 8, 32, 256):
        seconds = _graph_seconds(ops, kind, layers, rows)
        rates[rows] = layer_bytes / seconds
        print(f"{kind} rows={rows:3d}: {36 * seconds * 1e3:7.2f} ms per 36 layers, "
              f"{rates[rows] / 1e12:5.2f} TB/s of weights, {rows / (36 * seconds):8.0f} rows/s")
    assert all(rate > 0 for rate in rates.values())  # figures only: no timed assertion


def _attention(ops, q, kv_layer, scales, bt, row_seq, row_pos, page_size, sm_scale, **kw):
    from cuda_kernels import launch

    out = _poisoned(ops, q.shape)
    xs = [ops.asarray(a) for a in (q, kv_layer)]
    tables = [ops.asarray(a) for a in (bt, row_seq, row_pos)]
    _run(ops, launch.attention, *xs, np.float32(scales[0]), np.float32(scales[1]), *tables,
         page_size, np.float32(sm_scale), out, **kw)
    return ops.to_host(out)


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
def test_tiled_prompt_attention_gives_the_same_bits(ops, rng, kv_kind, nh, nkv, hd) -> None:
    """cuda_kernels/attention_tiled.py == attention.py bit for bit: a 1,100-row prompt step
    (rows across the switch to 64-key chunks) and a launch mixing two streams with decode rows."""
    page_size, scales = 16, (0.05, 0.04)
    bt, kv = ref.paged_setup(rng, seqs=3, max_pages=80, page_size=page_size, nkv=nkv, hd=hd)
    kv_layer = ref.to_kv_dtype(kv * 3, kv_kind, scales)
    prompt = np.arange(0, 1100, dtype=np.int64)
    mixed = np.concatenate([np.arange(500, 540), np.arange(30, 70), [1200, 3]]).astype(np.int64)
    mixed_seq = np.array([0] * 40 + [1] * 40 + [2, 1], np.int32)
    for row_seq, row_pos in ((np.zeros(prompt.shape[0], np.int32), prompt), (mixed_seq, mixed)):
        q = rng.standard_normal((row_pos.shape[0], nh, hd)).astype(np.float32)
        args = (kv_layer, scales, bt, row_seq, row_pos, page_size, hd**-0.5)
        plain = _attention(ops, q, *args, tiled=False)
        assert np.array_equal(_attention(ops, q, *args, tiled=True), plain)


@pytest.mark.parametrize("kv_kind", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64), (16, 2, 256)])
def test_paged_attention(ops, rng, kv_kind, nh, nkv, hd) -> None:
    page_size, scales = 16, (0.05, 0.04)
    bt, kv = ref.paged_setup(rng, seqs=3, max_pages=40, page_size=page_size, nkv=nkv, hd=hd)
    kv_layer = ref.to_kv_dtype(kv * 3, kv_kind, scales)
    row_seq = np.array([0, 1, 1, 1, 2, 0], np.int32)
    row_pos = np.array([0, 500, 501, 502, 639, 31], np.int64)
    q = rng.standard_normal((6, nh, hd)).astype(np.float32)
    out = _attention(ops, q, kv_layer, scales, bt, row_seq, row_pos, page_size, hd**-0.5)
    want = ref.attention_ref(q, kv_layer, scales, bt, row_seq, row_pos, page_size, hd**-0.5)
    assert ref.rel_err(out, want) < ATTN_BOUND
    for r in (0, 2, 4):
        solo = _attention(ops, q[r : r + 1], kv_layer, scales, bt, row_seq[r : r + 1],
                          row_pos[r : r + 1], page_size, hd**-0.5)
        assert np.array_equal(solo[0], out[r]), f"row {r} depends on the batch"


@pytest.mark.parametrize("kv_kind", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (8, 2, 256)])
def test_paged_attention_long_context(ops, rng, kv_kind, nh, nkv, hd) -> None:
    """2048 keys (32 chunks of 64), rows at chunk boundaries (chunks of 32 keys up to 1024
    keys, of 64 past) and a causal prompt run; a row alone == in the batch == in a batch with a
    block table twice as wide == through CudaOps.attention (its own scratch), bit for bit."""
    from cuda_kernels.attention import KEY_TILE, chunk_keys

    assert chunk_keys(1024) == KEY_TILE and chunk_keys(1025) == 2 * KEY_TILE

    page_size, scales = 16, (0.05, 0.04)
    bt, kv = ref.paged_setup(rng, seqs=2, max_pages=130, page_size=page_size, nkv=nkv, hd=hd)
    kv_layer = ref.to_kv_dtype(kv * 3, kv_kind, scales)
    prompt = np.arange(1000, 1040, dtype=np.int64)
    row_pos = np.concatenate([[2047, 0, KEY_TILE - 1, KEY_TILE, 1024, 2079], prompt])
    row_seq = np.concatenate([[0, 1, 1, 0, 1, 0], np.ones(prompt.shape[0])]).astype(np.int32)
    q = rng.standard_normal((row_pos.shape[0], nh, hd)).astype(np.float32)
    out = _attention(ops, q, kv_layer, scales, bt, row_seq, row_pos, page_size, hd**-0.5)
    want = ref.attention_ref(q, kv_layer, scales, bt, row_seq, row_pos, page_size, hd**-0.5)
    assert ref.rel_err(out, want) < ATTN_BOUND
    solo = _attention(ops, q[:1], kv_layer, scales, bt, row_seq[:1], row_pos[:1], page_size, hd**-0.5)
    assert np.array_equal(solo[0], out[0]), "the 2048-key row depends on the batch"
    wide = np.concatenate([bt, np.zeros_like(bt)], axis=1)
    again = _attention(ops, q, kv_layer, scales, wide, row_seq, row_pos, page_size, hd**-0.5)
    assert np.array_equal(again, out), "attention depends on the block-table width"
    via_ops = ops.attention(ops.asarray(q), ops.asarray(kv_layer[None]), 0,
                            ops.asarray(np.array([scales], np.float32)), ops.asarray(bt),
                            ops.asarray(row_seq), ops.asarray(row_pos), page_size, hd**-0.5)
    assert np.array_equal(ops.to_host(via_ops), out), "CudaOps.attention differs from the launcher"


@pytest.mark.parametrize("keys", [72, 2048])
def test_attention_decode_time_qwen3_8b(ops, rng, keys) -> None:
    """One decode row of Qwen3-8B (32 q heads, 8 KV heads, head_dim 128, bf16 KV) at `keys`
    keys, with a static block table 16K keys wide as graph_decoder uses: prints microseconds
    per layer of graph replays (pytest -s); a measurement, never a timed assertion."""
    from cuda_kernels import launch

    xp, page_size, layers = ops.xp, 16, 8
    bt, kv = ref.paged_setup(rng, seqs=1, max_pages=1024, page_size=page_size, nkv=8, hd=128)
    first = ops.asarray(ref.to_kv_dtype(kv, "bf16", (1.0, 1.0)))
    kv_layers = [first.copy() for _ in range(layers)]  # more than L2 holds, as in a model
    q = xp.asarray(rng.standard_normal((1, 32, 128)).astype(np.float32))
    out = xp.empty_like(q)
    tables = [xp.asarray(a) for a in (bt, np.zeros(1, np.int32), np.array([keys - 1], np.int64))]
    stream = xp.cuda.Stream(non_blocking=False)
    with stream:
        shape = launch.attention_scratch_shape(1, 32, 128, bt.shape[1], page_size)
        scratch = ops._dev(xp.empty(shape, xp.float32))
        args = [ops._dev(a) for a in tables]

    def record() -> None:
        for kv_layer in kv_layers:
            launch.attention(ops._dev(q), ops._dev(kv_layer), np.float32(1), np.float32(1), *args, page_size,
                             np.float32(128**-0.5), ops._dev(out), ops._stream(), scratch=scratch)

    us = _replay_seconds(xp, stream, record, 10) * 1e6 / layers
    print(f"attention 1 row, {keys} keys: {us:8.1f} us per layer, {36 * us / 1e3:6.2f} ms per 36 layers")
    assert us > 0


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_kv_write_bits(ops, rng, kv_dtype) -> None:
    from cuda_kernels import launch

    rows, nkv, hd = 300, 8, 128
    k = (rng.standard_normal((rows, nkv, hd)) * 40).astype(np.float32)
    v = (rng.standard_normal((rows, nkv, hd)) * 0.01).astype(np.float32)
    scales = (0.3, 0.0001)
    slots = rng.permutation(1000)[:rows].astype(np.int64)
    dtype = np.uint16 if kv_dtype == "bf16" else np.uint8
    kv_layer = ops.xp.zeros((2, 1000, nkv, hd), dtype)
    _run(ops, launch.kv_write, ops.asarray(k), ops.asarray(v), kv_layer, ops.asarray(slots),
         np.float32(scales[0]), np.float32(scales[1]))
    want = ref.to_kv_dtype(np.stack([k, v]), kv_dtype, scales)
    assert np.array_equal(ops.to_host(kv_layer)[:, slots], want)


def test_ops_level_against_cpu(ops, rng) -> None:
    """CudaOps end to end (allocation, checks, stream) against CpuOps on the same inputs."""
    from tf_async.backend.cpu.ops import CpuOps
    from tf_async.backend.weights import quantize_affine

    cpu = CpuOps(int8_x=True)
    w = quantize_affine(rng.standard_normal((512, 256)).astype(np.float32), 4, 64)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    dev_w = ops.upload_linear(w)
    assert ref.rel_err(ops.to_host(ops.linear(ops.asarray(x), dev_w)), cpu.linear(x, w)) < MATMUL_BOUND
    norm_w = rng.standard_normal(256).astype(np.float32)
    got = ops.to_host(ops.rms_norm(ops.asarray(x), ops.asarray(norm_w), 1e-6))
    assert ref.rel_err(got, cpu.rms_norm(x, norm_w, 1e-6)) < ROW_BOUND
    ids = np.array([3, 0, 511], np.int64)
    assert ref.rel_err(ops.to_host(ops.embed(dev_w, ops.asarray(ids))), cpu.embed(w, ids)) < ROW_BOUND
    kv = ops.alloc_kv(2, 64, 2, 32, "fp8")
    ops.kv_write(kv, 1, *(ops.asarray(a) for a in (rng.standard_normal((2, 2, 32)).astype(np.float32),) * 2),
                 ops.asarray(np.array([5, 9], np.int64)), None)
    ops.zero_pages(kv, ops.asarray(np.array([0, 2], np.int32)), 4)
    assert not ops.to_host(kv)[:, :, 0:4].any()
    assert ops.to_host(kv)[1, :, 5].any()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_fused_layer_ops_equal_the_ops_they_replace(ops, rng, kv_dtype, rows) -> None:
    """Qwen3-8B sizes: concat_linears views == the originals, linear_into == h + linear,
    swiglu_linear == silu_mul of two linears, attn_inputs == rms_norm + rope + kv_write;
    bit for bit, fresh random inputs, outputs poisoned."""
    from tf_async.backend.weights import quantize_affine

    nh, nkv, hd, hidden, inter = 32, 8, 128, 4096, 1024
    xp = ops.xp
    mats = [ops.upload_linear(quantize_affine(rng.standard_normal((n, hidden)).astype(np.float32), 4, 64))
            for n in (nh * hd, nkv * hd, nkv * hd, inter, inter)]
    qkv_w, views = ops.concat_linears(mats[:3])
    for view, orig in zip(views, mats[:3], strict=True):
        assert all(bool(xp.array_equal(getattr(view, f), getattr(orig, f))) for f in ("codes", "scales", "biases"))
    gate_up, _ = ops.concat_linears(mats[3:])
    x = ops.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
    h = ops.asarray(rng.standard_normal((rows, nh * hd)).astype(np.float32))
    want = h + ops.linear(x, mats[0])
    assert bool(xp.array_equal(ops.linear_into(x, mats[0], h.copy()), want))
    want = ops.silu_mul(ops.linear(x, mats[3]), ops.linear(x, mats[4]))
    assert bool(xp.array_equal(ops.swiglu_linear(x, gate_up), want))
    qkv = ops.linear(x, qkv_w)
    norm_w = ops.asarray((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    normed = ops.rms_norm_for(x, norm_w, 1e-6, qkv_w)  # one launch: rms_norm + int8 x
    assert not isinstance(normed, type(x)), "q4 weights take int8 x"
    assert bool(xp.array_equal(ops.linear(normed, qkv_w), ops.linear(ops.rms_norm(x, norm_w, 1e-6), qkv_w)))
    assert bool(xp.array_equal(ops.swiglu_linear(ops.rms_norm_for(x, norm_w, 1e-6, gate_up), gate_up),
                               ops.swiglu_linear(ops.rms_norm(x, norm_w, 1e-6), gate_up)))
    norms = [ops.asarray((1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)) for _ in range(2)]
    inv_freq = ops.asarray((1e6 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32))
    pos = ops.asarray(rng.integers(0, 40000, rows).astype(np.int64))
    slots = ops.asarray(rng.permutation(256)[:rows].astype(np.int64))
    scales = ops.asarray(np.array([[0.5, 0.25]] * 2, np.float32)) if kv_dtype == "fp8" else None
    kv_want, kv_got = ops.alloc_kv(2, 256, nkv, hd, kv_dtype), ops.alloc_kv(2, 256, nkv, hd, kv_dtype)
    q = ops.rms_norm(xp.ascontiguousarray(qkv[:, : nh * hd].reshape(rows, nh, hd)), norms[0], 1e-6)
    k = ops.rms_norm(xp.ascontiguousarray(qkv[:, nh * hd : (nh + nkv) * hd].reshape(rows, nkv, hd)), norms[1], 1e-6)
    v = xp.ascontiguousarray(qkv[:, (nh + nkv) * hd :].reshape(rows, nkv, hd))
    ops.rope(q, pos, inv_freq, 1.0)
    ops.rope(k, pos, inv_freq, 1.0)
    ops.kv_write(kv_want, 1, k, v, slots, scales)
    got = ops.attn_inputs(qkv, *norms, 1e-6, pos, inv_freq, 1.0, kv_got, 1, slots, scales, nh)
    assert bool(xp.array_equal(got, q))
    assert bool(xp.array_equal(kv_got.view(xp.uint8), kv_want.view(xp.uint8)))


def _int8_bits(ops, rows_f32, kind):
    """quantize_rows of float32 rows on the CPU twin: (xq, xs) as NumPy."""
    from tf_async.backend.cpu import kernels as cpu

    host = ops.to_host(rows_f32)
    xq = np.empty(host.shape, np.int8)
    xs = np.empty((host.shape[0], 2 * host.shape[1] // 32), np.float32)
    cpu.quantize_rows_int8(host, kind == "q4", xq, xs)
    return xq, xs


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_attention_written_as_int8_x(ops, rng, rows, bits) -> None:
    """attention_for (the combine launch also writes the rows' int8 x) gives attention's float32
    rows and the bits of quantize_rows of them (Qwen3-8B heads, 1..300 keys a row: chunks of 32
    and 64 keys, several blocks a row; fresh inputs, poisoned outputs)."""
    from tf_async.backend.cuda_ops import Int8Rows
    from tf_async.backend.weights import quantize_affine

    nh, nkv, hd, hidden, page = 32, 8, 128, 4096, 16
    xp = ops.xp
    o_w = ops.upload_linear(quantize_affine(rng.standard_normal((hidden, nh * hd)).astype(np.float32), bits, 64))
    kind = "q4" if bits == 4 else "q8"
    kv = ops.alloc_kv(1, 64 * page * rows, nkv, hd, "bf16")
    kv[...] = xp.asarray(rng.integers(0x3C00, 0x4000, kv.shape, dtype=np.uint16))
    table = ops.asarray(np.arange(64 * rows, dtype=np.int32).reshape(rows, 64))
    pos = ops.asarray(rng.integers(0, 300, rows).astype(np.int64))
    seq = ops.asarray(np.arange(rows, dtype=np.int32))
    q = ops.asarray(rng.standard_normal((rows, nh, hd)).astype(np.float32))
    args = (q, kv, 0, None, table, seq, pos, page, hd ** -0.5)
    got = ops.attention_for(*args, o_w)
    plain = ops.attention(*args).reshape(rows, nh * hd)
    assert isinstance(got, Int8Rows) and got.kind == kind
    want_q, want_s = _int8_bits(ops, plain, kind)
    assert np.array_equal(ops.to_host(got.xq), want_q) and np.array_equal(ops.to_host(got.xs), want_s)
    assert bool(xp.array_equal(ops.linear(got, o_w), ops.linear(plain, o_w)))


def test_launches_follow_cupys_current_stream(ops, rng) -> None:
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    w = rng.standard_normal(4096).astype(np.float32)
    stream = ops.xp.cuda.Stream(non_blocking=True)
    with stream:
        x_dev = ops.asarray(x)
        out = ops.rms_norm(x_dev, ops.asarray(w), 1e-5)
        ops.synchronize()
        got = ops.to_host(out)
    assert ref.rel_err(got, ref.rms_norm_ref(x, w, 1e-5)) < ROW_BOUND


@pytest.mark.parametrize("dim", [896, 2560, 4000, 4096])
def test_held_rms_norm_bits(ops, rng, dim) -> None:
    """The rms_norm that holds a row in registers gives the general kernel's bits (real widths,
    a partly filled last slot at 4000), outputs poisoned first."""
    from cuda_kernels import launch, norm

    kernel = norm.rms_norm_kernel(dim)
    assert kernel is not norm.rms_norm
    x = ops.asarray(rng.standard_normal((9, dim)).astype(np.float32))
    w = ops.asarray(rng.standard_normal(dim).astype(np.float32))
    held, general = (ops.xp.full((9, dim), np.nan, np.float32) for _ in range(2))
    launch.rms_norm(x, w, np.float32(1e-6), held)
    norm.rms_norm[9, norm.NORM_THREADS](x, w, np.float32(1e-6), general)
    assert np.array_equal(ops.to_host(held), ops.to_host(general))


def test_rows_ops(ops, rng) -> None:
    q = rng.standard_normal((40, 32, 128)).astype(np.float32)
    pos = rng.integers(0, 40000, size=40).astype(np.int64)
    inv_freq = (1e6 ** (-np.arange(0, 128, 2) / 128)).astype(np.float32)
    q_dev = ops.asarray(q)
    ops.rope(q_dev, ops.asarray(pos), ops.asarray(inv_freq), 1.0)
    assert ref.rel_err(ops.to_host(q_dev), ref.rope_ref(q, pos, inv_freq, 1.0)) < ROW_BOUND
    gate, up = rng.standard_normal((2, 33, 12288)).astype(np.float32)
    got = ops.to_host(ops.silu_mul(ops.asarray(gate), ops.asarray(up)))
    assert ref.rel_err(got, ref.silu_mul_ref(gate, up)) < ROW_BOUND


def test_moe_against_cpu(ops, rng) -> None:
    from tf_async.backend.cpu.ops import CpuOps
    from tf_async.backend.weights import DenseWeight, quantize_affine

    cpu = CpuOps(int8_x=True)
    hidden, inter, experts = 256, 128, 8
    router = DenseWeight(rng.standard_normal((experts, hidden)).astype(np.float32))
    gate, up = (quantize_affine(rng.standard_normal((experts, inter, hidden)).astype(np.float32), 4, 64)
                for _ in range(2))
    down = quantize_affine(rng.standard_normal((experts, hidden, inter)).astype(np.float32), 4, 64)
    x = rng.standard_normal((11, hidden)).astype(np.float32)
    dev = [ops.upload_linear(w) for w in (router, gate, up, down)]
    got = ops.to_host(ops.moe(ops.asarray(x), *dev, 3, True))
    assert ref.rel_err(got, cpu.moe(x, router, gate, up, down, 3, True)) < MATMUL_BOUND
    solo = ops.to_host(ops.moe(ops.asarray(x[4:5]), *dev, 3, True))
    assert np.array_equal(solo[0], got[4])


@pytest.mark.parametrize("kind", ["f32", "q4"])
def test_moe_with_fused_gate_up_gives_the_bits_of_gate_and_up(ops, rng, kind) -> None:
    """ops.moe(..., gate_up=concat_linears([gate, up])) as the decoders call it (gate and up
    then views of the concatenation) == gate and up apart, bit for bit: 1 and 7 rows, and 200
    rows of top 3 (600 slots: the sorted path for int8-x experts)."""
    from tf_async.backend.weights import DenseWeight, quantize_affine

    hidden, inter, experts = 256, 128, 8

    def stack(*shape):
        w = rng.standard_normal(shape).astype(np.float32)
        return DenseWeight(w) if kind == "f32" else quantize_affine(w, 4, 64)

    router = ops.upload_linear(DenseWeight(rng.standard_normal((experts, hidden)).astype(np.float32)))
    gate, up, down = (ops.upload_linear(stack(experts, *shape))
                      for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
    xs = [ops.asarray(rng.standard_normal((n, hidden)).astype(np.float32)) for n in (1, 7, 200)]
    apart = [ops.to_host(ops.moe(x, router, gate, up, down, 3, True)) for x in xs]
    fused = ops.concat_linears([gate, up])
    assert fused is not None, kind
    gate_up, (gate_view, up_view) = fused[0], fused[1]
    for x, want in zip(xs, apart, strict=True):
        got = ops.to_host(ops.moe(x, router, gate_view, up_view, down, 3, True, gate_up=gate_up))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (kind, x.shape)


@pytest.mark.parametrize("rows", [1, 9])
def test_moe_route_256_experts_top_8(ops, rng, rows) -> None:
    """A 35B MoE's routing (256 experts, top 8), norm on and off: the float64 reference's ids
    (exact ties: the lower id), its weights, outputs poisoned first, and a row alone gives the
    bits it has among the others."""
    from cuda_kernels import launch

    logits = (rng.standard_normal((rows, 256)) * 2).astype(np.float32)
    logits[-1, 100:] = -np.inf  # a sparse row: only experts 0..99 can weigh anything
    logits[0, [5, 37, 90]] = 20.0  # exact ties across lanes
    for norm in (False, True):
        ids, weights = _poisoned(ops, (rows, 8), np.int32), _poisoned(ops, (rows, 8))
        _run(ops, launch.moe_route, ops.asarray(logits), 8, norm, ids, weights)
        got_ids, got_w = ops.to_host(ids), ops.to_host(weights)
        want_ids, want_w = ref.moe_route_ref(logits, 8, norm)
        assert np.array_equal(got_ids, want_ids), norm
        assert ref.rel_err(got_w, want_w) < ROW_BOUND, norm
        assert list(got_ids[0, :3]) == [5, 37, 90]
        for r in (0, rows - 1):
            solo_ids, solo_w = _poisoned(ops, (1, 8), np.int32), _poisoned(ops, (1, 8))
            _run(ops, launch.moe_route, ops.asarray(logits[r : r + 1]), 8, norm, solo_ids, solo_w)
            assert np.array_equal(ops.to_host(solo_ids)[0], got_ids[r])
            assert np.array_equal(ops.to_host(solo_w)[0].view(np.uint32), got_w[r].view(np.uint32))


@pytest.mark.parametrize("bits", [4, 8])
def test_moe_sorted_by_expert_gives_each_slot_its_bits(ops, rng, monkeypatch, bits) -> None:
    """A prompt-sized MoE launch (slots >= MOE_SORTED_MIN_SLOTS) runs sorted by expert on the
    tensor cores: every row equal to the one-slot-a-row path and to the row alone."""
    from tf_async.backend import cuda_ops
    from tf_async.backend.weights import DenseWeight, quantize_affine

    hidden, inter, experts, top_k = 512, 256, 16, 4
    router = DenseWeight(rng.standard_normal((experts, hidden)).astype(np.float32))
    gate, up = (quantize_affine(rng.standard_normal((experts, inter, hidden)).astype(np.float32), bits, 64)
                for _ in range(2))
    down = quantize_affine(rng.standard_normal((experts, hidden, inter)).astype(np.float32), bits, 64)
    x = rng.standard_normal((300, hidden)).astype(np.float32)
    dev = [ops.upload_linear(w) for w in (router, gate, up, down)]
    assert 300 * top_k >= cuda_ops.MOE_SORTED_MIN_SLOTS
    sorted_rows = ops.to_host(ops.moe(ops.asarray(x), *dev, top_k, True))
    monkeypatch.setattr(cuda_ops, "MOE_SORTED_MIN_SLOTS", 1 << 30)
    one_a_row = ops.to_host(ops.moe(ops.asarray(x), *dev, top_k, True))
    assert np.array_equal(sorted_rows, one_a_row)
    solo = ops.to_host(ops.moe(ops.asarray(x[7:8]), *dev, top_k, True))
    assert np.array_equal(solo[0], sorted_rows[7])


def test_sampling(ops, rng) -> None:
    from cuda_kernels import sampling

    rows, vocab = 6, 151936
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    got = ops.to_host(ops.argmax(ops.asarray(logits)))
    assert np.array_equal(got, logits.argmax(-1))
    temps = np.array([0.0, 0.8, 1.0, 1.3, 0.7, 1.0], np.float32)
    top_ks = np.array([0, 40, 1, 0, 20, 5], np.int32)
    top_ps = np.array([1.0, 0.95, 1.0, 0.9, 0.5, 1.0], np.float32)
    seeds = rng.integers(0, 2**63, size=rows).astype(np.uint64)
    positions = rng.integers(0, 5000, size=rows).astype(np.int64)
    args = [ops.asarray(a) for a in (logits, temps, top_ks, top_ps, seeds, positions)]
    got = ops.to_host(ops.sample(*args))
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
    for r in (1, 4, 5):
        u = sampling.uniform_host(int(seeds[r]), int(positions[r]))
        assert got[r] == ref._sample_ref(logits[r], temps[r], top_ks[r], top_ps[r], u), r
    solo = ops.to_host(ops.sample(*[a[3:4] for a in args]))
    assert solo[0] == got[3]


def test_split_argmax_at_a_248k_vocabulary(ops, rng) -> None:
    """The split argmax (argmax_parts over the row's parts, then argmax_reduce) on rows of
    248,320 logits: numpy's argmax on random rows; exact ties in two parts, on the two sides of
    a part boundary and inside one thread's ids (the lowest id wins); -inf and NaN rows as
    argmax_ref has them; the same tokens as the one-block greedy path of `sample`, for a row
    alone, and for any number of parts."""
    from cuda_kernels import launch

    vocab = 248320
    rows, parts = launch.argmax_scratch_shape(12, vocab)
    span = -(-vocab // parts)
    assert parts > 8
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    top = np.float32(100.0)
    logits[4, [span + 5, 3 * span + 7]] = top  # two parts
    logits[5, [vocab - 1, 0]] = top  # the first and the last part
    logits[6, [2 * span - 1, 2 * span]] = top  # the two sides of a boundary
    logits[7, [10, 10 + 256 * 8, parts * span - span + 3]] = top  # one thread's ids, and the last part
    logits[8, :] = -np.inf  # 0
    logits[9, ::3] = np.nan  # NaN never wins
    logits[9, vocab - 2] = np.float32(1e30)
    logits[10, :] = np.nan  # 0
    logits[11, :] = np.nan  # NaN and -inf only: the first -inf
    logits[11, [span * (parts - 1) + 4, span * (parts - 2)]] = -np.inf
    want = ref.argmax_ref(logits)
    assert np.array_equal(want[:4], logits[:4].argmax(-1))
    assert list(want[4:]) == [span + 5, 0, 2 * span - 1, 10, 0, vocab - 2, 0, span * (parts - 2)]
    dev = ops.asarray(logits)
    got = ops.to_host(ops.argmax(dev))
    assert np.array_equal(got, want), (got, want)
    greedy = ops.to_host(ops.sample(dev, *[ops.asarray(np.zeros(rows, t)) for t in
                                           (np.float32, np.int32, np.float32, np.uint64, np.int64)]))
    assert np.array_equal(greedy, want)  # the one-block kernel (_block_argmax) agrees
    for r in (0, 4, 9, 11):
        assert ops.to_host(ops.argmax(dev[r : r + 1]))[0] == want[r], r
    for n in (1, 3, 64, 200):
        values, ids, out = _poisoned(ops, (rows, n)), _poisoned(ops, (rows, n), np.int64), _poisoned(ops, rows, np.int64)
        _run(ops, launch.argmax, dev, out, part_values=ops._dev(values), part_ids=ops._dev(ids))
        assert np.array_equal(ops.to_host(out), want), n


def test_int8_rows_for_another_weight_kind_is_a_clear_error(ops, rng) -> None:
    """Int8Rows made for a 4-bit weight (q4 byte order) refused by an 8-bit one, and by a
    weight that takes float32 x (group of 16), with a clear BadInputError."""
    from tf_async.backend.weights import quantize_affine
    from tf_async.errors import BadInputError

    def weight(bits, group):
        return ops.upload_linear(quantize_affine(rng.standard_normal((64, 256)).astype(np.float32), bits, group))

    x = ops.asarray(rng.standard_normal((3, 256)).astype(np.float32))
    norm = ops.asarray(np.ones(256, np.float32))
    rows_q4 = ops.rms_norm_for(x, norm, 1e-6, weight(4, 64))
    for other in (weight(8, 64), weight(4, 16)):
        with pytest.raises(BadInputError, match="int8 rows"):
            ops.linear(rows_q4, other)
