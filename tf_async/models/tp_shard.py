"""Tensor-parallel sharding of a dense checkpoint (docs/TENSOR_PARALLEL.md).

Rank r of N holds (Megatron / vLLM split):

    q, k, v   column-parallel by KV-head groups: q heads [r*nh/N, (r+1)*nh/N), k/v heads
              [r*nkv/N, (r+1)*nkv/N) (a q head's KV head stays on its rank: N divides nkv)
    o         row-parallel: the input columns of the rank's q heads; o_bias on rank 0 only
    gate, up  column-parallel: intermediate rows [r*I/N, (r+1)*I/N)
    down      row-parallel: the same intermediate columns
    experts   every expert on every rank, its intermediate split like a dense MLP (routing
              is the same on every rank: the router is replicated)
    embed, lm_head, norms, q_norm/k_norm, router: replicated

A row-parallel output is a partial sum: the ranks' partials are all-reduced (summed) before
they join the residual. Column-parallel parts need no sum: they are exact slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..backend.weights import AffineWeight, DenseWeight, Linear
from ..errors import BadInputError
from .checkpoint import Checkpoint, LayerWeights, ModelWeights
from .config import ModelConfig


def slice_out(w: Linear, lo: int, hi: int) -> Linear:
    """Output features [lo, hi) of w (rows of [out, in], or of each expert's [E, out, in])."""
    if isinstance(w, DenseWeight):
        return DenseWeight(np.ascontiguousarray(w.w[..., lo:hi, :]))
    return AffineWeight(np.ascontiguousarray(w.codes[..., lo:hi, :]),
                        np.ascontiguousarray(w.scales[..., lo:hi, :]),
                        np.ascontiguousarray(w.biases[..., lo:hi, :]), w.bits, w.group_size)


def slice_in(w: Linear, lo: int, hi: int) -> Linear:
    """Input features [lo, hi) of w; for affine weights lo and hi are whole groups."""
    if isinstance(w, DenseWeight):
        return DenseWeight(np.ascontiguousarray(w.w[..., lo:hi]))
    if lo % w.group_size or hi % w.group_size:
        raise BadInputError(f"tensor parallel: columns [{lo}, {hi}) cut a quantization group of "
                            f"{w.group_size}", param="tensor_parallel")
    per_word = 32 // w.bits
    g0, g1 = lo // w.group_size, hi // w.group_size
    return AffineWeight(np.ascontiguousarray(w.codes[..., lo // per_word: hi // per_word]),
                        np.ascontiguousarray(w.scales[..., g0:g1]),
                        np.ascontiguousarray(w.biases[..., g0:g1]), w.bits, w.group_size)


def concat_out(parts: list[Linear]) -> Linear:
    """Weights of the same kind side by side along their output features (one matmul)."""
    first = parts[0]
    if isinstance(first, DenseWeight):
        return DenseWeight(np.concatenate([_dense(p).w for p in parts], axis=-2))
    affine = [_affine(p) for p in parts]
    return AffineWeight(np.concatenate([p.codes for p in affine], axis=-2),
                        np.concatenate([p.scales for p in affine], axis=-2),
                        np.concatenate([p.biases for p in affine], axis=-2),
                        affine[0].bits, affine[0].group_size)


def _dense(w: Linear) -> DenseWeight:
    if not isinstance(w, DenseWeight):
        raise ValueError("concat_out: parts of different kinds")
    return w


def _affine(w: Linear) -> AffineWeight:
    if not isinstance(w, AffineWeight):
        raise ValueError("concat_out: parts of different kinds")
    return w


def part(total: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank's equal share of `total` (size divides total: checked at start)."""
    share = total // size
    return rank * share, (rank + 1) * share


def _bias_part(b: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    return None if b is None else np.ascontiguousarray(b[lo:hi])


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """A rank's view of the model: its heads, KV heads and intermediate columns."""
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                   intermediate_size=cfg.intermediate_size // size,
                   moe_intermediate_size=cfg.moe_intermediate_size // size)


def shard_layer(layer: LayerWeights, cfg: ModelConfig, rank: int, size: int) -> LayerWeights:
    """Rank `rank`'s part of one layer (see the module docstring)."""
    hd = cfg.head_dim
    q0, q1 = (x * hd for x in part(cfg.num_heads, rank, size))
    k0, k1 = (x * hd for x in part(cfg.num_kv_heads, rank, size))
    out = replace(layer, q=slice_out(layer.q, q0, q1), k=slice_out(layer.k, k0, k1),
                  v=slice_out(layer.v, k0, k1), o=slice_in(layer.o, q0, q1),
                  q_bias=_bias_part(layer.q_bias, q0, q1), k_bias=_bias_part(layer.k_bias, k0, k1),
                  v_bias=_bias_part(layer.v_bias, k0, k1),
                  o_bias=layer.o_bias if rank == 0 else None)  # added once, by rank 0
    if layer.gate is not None and layer.up is not None and layer.down is not None:
        i0, i1 = part(layer.gate.out_features, rank, size)
        out = replace(out, gate=slice_out(layer.gate, i0, i1), up=slice_out(layer.up, i0, i1),
                      down=slice_in(layer.down, i0, i1))
    if layer.experts_gate is not None and layer.experts_up is not None and layer.experts_down is not None:
        e0, e1 = part(layer.experts_gate.out_features, rank, size)
        out = replace(out, experts_gate=slice_out(layer.experts_gate, e0, e1),
                      experts_up=slice_out(layer.experts_up, e0, e1),
                      experts_down=slice_in(layer.experts_down, e0, e1))
    return out


def shard_checkpoint(ckpt: Checkpoint, rank: int, size: int) -> Checkpoint:
    """Rank `rank` of `size`'s checkpoint: its config and weights (replicated ones shared)."""
    w = ckpt.weights
    layers = [shard_layer(layer, ckpt.config, rank, size) for layer in w.layers]
    weights = ModelWeights(embed=w.embed, lm_head=w.lm_head, final_norm=w.final_norm,
                           layers=layers, rope_freq_divisors=w.rope_freq_divisors)
    return replace(ckpt, config=shard_config(ckpt.config, size), weights=weights)


def check_divides(size: int, counts: dict[str, int]) -> None:
    """Refuse a TP size that does not divide one of the model's counts (named in the error)."""
    for name, count in counts.items():
        if count % size:
            raise BadInputError(f"tensor_parallel {size} does not divide the model's {name} "
                                f"({count})", param="tensor_parallel")


def check_whole_groups(size: int, row_parallel: Sequence[Linear | None]) -> None:
    """Refuse a split whose columns a rank cut the quantization groups of a row-parallel weight."""
    for w in row_parallel:
        if isinstance(w, AffineWeight) and (w.in_features // size) % w.group_size:
            raise BadInputError(f"tensor_parallel {size}: a rank's {w.in_features // size} "
                                f"columns cut the quantization groups of {w.group_size}",
                                param="tensor_parallel")


def check_tensor_parallel(ckpt: Checkpoint, size: int) -> None:
    """Refuse a TP size the model cannot be split by: it must divide the KV heads (hence the
    heads), the intermediate size and each expert's, and cut no quantization group of a
    row-parallel weight (o, down)."""
    cfg = ckpt.config
    counts = {"KV heads": cfg.num_kv_heads, "attention heads": cfg.num_heads}
    if any(layer.gate is not None for layer in ckpt.weights.layers):
        counts["intermediate size"] = cfg.intermediate_size
    if cfg.num_experts:
        counts["expert intermediate size"] = cfg.moe_intermediate_size
    check_divides(size, counts)
    check_whole_groups(size, [w for layer in ckpt.weights.layers
                              for w in (layer.o, layer.down, layer.experts_down)])
