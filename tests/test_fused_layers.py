"""The decoder's fused-layer weights (CudaOps.concat_linears, decoder._fuse_layers) on NumPy
arrays: the concatenation's views equal the originals, the layer keeps only views, and
layers that cannot be fused (mixed weight kinds, some biases but not all) stay as they were.
The fused kernels themselves are checked in tests/cuda_sim_check.py and on a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from tf_async.backend.cuda_ops import CudaOps
from tf_async.backend.weights import AffineWeight, DenseWeight, quantize_affine
from tf_async.models.checkpoint import LayerWeights, ModelWeights
from tf_async.models.decoder import _fuse_layers

H = 128


class NumpyFusingOps:
    """CudaOps' concat_linears on NumPy arrays."""

    xp = np

    def concat_linears(self, ws: list[Any]) -> Any:
        return CudaOps.concat_linears(self, ws)  # type: ignore[arg-type]


def q4(rng: np.random.Generator, out_f: int) -> AffineWeight:
    return quantize_affine(rng.standard_normal((out_f, H)).astype(np.float32), 4, 64)


def layer(rng: np.random.Generator, **kw: Any) -> LayerWeights:
    norm = np.ones(H, np.float32)
    parts: dict[str, Any] = dict(input_norm=norm, post_norm=norm, q=q4(rng, 64), k=q4(rng, 32),
                                 v=q4(rng, 32), o=q4(rng, H), gate=q4(rng, 96), up=q4(rng, 96),
                                 down=q4(rng, H))
    return LayerWeights(**{**parts, **kw})


def same(a: AffineWeight, b: AffineWeight) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("codes", "scales", "biases"))


def test_layers_keep_views_of_one_concatenation_and_unfusable_layers_stay() -> None:
    rng = np.random.default_rng(0)
    bias = [rng.standard_normal(n).astype(np.float32) for n in (64, 32, 32)]
    layers = [layer(rng), layer(rng, q_bias=bias[0], k_bias=bias[1], v_bias=bias[2]),
              layer(rng, q_bias=bias[0]),  # some biases but not all
              layer(rng, k=DenseWeight(rng.standard_normal((32, H)).astype(np.float32))),  # mixed kinds
              layer(rng, gate=None, up=None)]  # no dense MLP (MoE)
    originals = [(lw.q, lw.k, lw.v, lw.gate, lw.up) for lw in layers]
    weights = ModelWeights(q4(rng, 50), q4(rng, 50), np.ones(H, np.float32), layers)
    fused = _fuse_layers(weights, NumpyFusingOps())

    assert fused[2] is None and fused[3] is None
    assert weights.layers[2] is layers[2] and weights.layers[3] is layers[3]
    for i in (0, 1, 4):
        f, lw = fused[i], weights.layers[i]
        assert f is not None
        q, k, v, gate, up = originals[i]
        assert same(lw.q, q) and same(lw.k, k) and same(lw.v, v)
        assert lw.q.codes.base is f.qkv.codes and lw.v.scales.base is f.qkv.scales  # views
        assert same(f.qkv, AffineWeight(*(np.concatenate([getattr(w, n) for w in (q, k, v)])
                                          for n in ("codes", "scales", "biases")), 4, 64))
        if gate is None:
            assert f.gate_up is None
        else:
            assert same(lw.gate, gate) and same(lw.up, up) and lw.up.codes.base is f.gate_up.codes
    assert fused[0] is not None and fused[0].qkv_bias is None
    assert fused[1] is not None and np.array_equal(fused[1].qkv_bias, np.concatenate(bias))


def test_concat_linears_refuses_mixed_kinds() -> None:
    rng = np.random.default_rng(1)
    dense = DenseWeight(rng.standard_normal((8, H)).astype(np.float32))
    ops = NumpyFusingOps()
    assert ops.concat_linears([q4(rng, 8), dense]) is None
    assert ops.concat_linears([q4(rng, 8), quantize_affine(np.ones((8, H), np.float32), 8, 64)]) is None
    whole, views = ops.concat_linears([dense, dense])
    assert whole.w.shape == (16, H) and np.array_equal(views[1].w, dense.w)


def stacked_q4(rng: np.random.Generator, experts: int, out_f: int) -> AffineWeight:
    parts = [q4(rng, out_f) for _ in range(experts)]
    return AffineWeight(*(np.stack([getattr(p, n) for p in parts]) for n in ("codes", "scales", "biases")),
                        4, 64)


def test_stacked_experts_concatenate_per_expert() -> None:
    """[gate; up] of each expert of a stack: the views are the stacks given, and expert e's
    rows of the concatenation are its gate rows, then its up rows (the swiglu epilogue's
    layout); stacks of different expert counts are not fused."""
    rng = np.random.default_rng(2)
    gate, up = stacked_q4(rng, 3, 16), stacked_q4(rng, 3, 16)
    whole, (gate_view, up_view) = NumpyFusingOps().concat_linears([gate, up])
    assert whole.codes.shape == (3, 32, gate.codes.shape[2]) and same(gate_view, gate) and same(up_view, up)
    for e in range(3):
        assert same(whole.expert(e), AffineWeight(*(np.concatenate([getattr(w.expert(e), n) for w in (gate, up)])
                                                    for n in ("codes", "scales", "biases")), 4, 64))
    assert gate_view.codes.base is whole.codes
    assert NumpyFusingOps().concat_linears([gate, stacked_q4(rng, 2, 16)]) is None
    assert NumpyFusingOps().concat_linears([gate, q4(rng, 16)]) is None


def test_hybrid_mixers_fuse_their_input_projections() -> None:
    from tf_async.models.qwen35 import DeltaNetWeights, GatedAttentionWeights, _fuse_inputs

    rng = np.random.default_rng(3)
    norm = np.ones(8, np.float32)
    parts = {"in_qkv": q4(rng, 48), "in_z": q4(rng, 32), "in_a": q4(rng, 4), "in_b": q4(rng, 4)}
    mixer = DeltaNetWeights(**parts, conv=np.ones((48, 4), np.float32), a_log=norm[:4], dt_bias=norm[:4],
                            norm=norm, out=q4(rng, H))
    _fuse_inputs(mixer, NumpyFusingOps())
    assert mixer.in_proj is not None and mixer.in_proj.out_features == 88
    for name, original in parts.items():
        assert same(getattr(mixer, name), original) and getattr(mixer, name).codes.base is mixer.in_proj.codes
    attn = GatedAttentionWeights(q=q4(rng, 64), k=q4(rng, 16), v=DenseWeight(np.ones((16, H), np.float32)),
                                 o=q4(rng, H), q_norm=norm, k_norm=norm)
    _fuse_inputs(attn, NumpyFusingOps())
    assert attn.qkv is None  # mixed kinds: three launches as before
