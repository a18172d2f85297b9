"""CPU twins of cuda_kernels/dflash.py (the DFlash / DFlash2 drafter's own ops), with the same
signatures (outputs written into `out` arrays). They are the NumPy expressions the drafter's
forward always used, so the CPU path keeps its bits; tests/cuda_sim_check.py compares the CUDA
kernels with them and with float64 references.
"""

from __future__ import annotations

import numpy as np


def grouped_conv(x: np.ndarray, taps: np.ndarray, base: np.ndarray, group_size: int,
                 out: np.ndarray) -> None:
    """DFlash2's grouped dynamic causal convolution over a block.
    x: [B, H] f32; taps: [B, K, G] f32 (one tap a group, G = H / group_size); base: [K, H];
    out[t] = sum_o (base[o] * x[t - o] + taps[t, o] * x[t - o]), zero before the block."""
    rows, hidden = x.shape
    groups = hidden // group_size
    blocks = x.reshape(rows, groups, group_size)
    acc = np.zeros_like(blocks)
    for offset in range(base.shape[0]):
        shifted = np.zeros_like(blocks)
        shifted[offset:] = blocks[:rows - offset]
        acc = acc + base[offset].reshape(groups, group_size) * shifted
        acc = acc + taps[:, offset, :, None] * shifted
    out[...] = acc.reshape(rows, hidden)


def block_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
                    sm_scale: float, out: np.ndarray) -> None:
    """The block's queries over explicit keys. q: [B, nh, hd]; keys, values: [T, nkv, hd];
    visible: [B, T] uint8 (1: query b sees key t); out: [B, nh, hd] f32."""
    rows, num_heads, head_dim = q.shape
    num_kv = keys.shape[1]
    qg = q.reshape(rows, num_kv, num_heads // num_kv, head_dim)
    scores = np.einsum("bngd,tnd->bngt", qg, keys) * np.float32(sm_scale)
    scores = np.where(visible.astype(bool)[:, None, None, :], scores, np.float32(-np.inf))
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    out[...] = np.einsum("bngt,tnd->bngd", probs, values).reshape(rows, num_heads, head_dim)


def topk_rows(logits: np.ndarray, top_k: int, out_ids: np.ndarray, out_values: np.ndarray) -> None:
    """Each row's top_k logits, larger first, ties: lower id first.
    logits: [R, V] f32; out_ids: [R, k] int64; out_values: [R, k] f32."""
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    out_ids[...] = ids
    out_values[...] = np.take_along_axis(logits, ids, axis=-1)


def select_chain(cand_ids: np.ndarray, cand_values: np.ndarray, projected: np.ndarray,
                 predecessor: np.ndarray, successor: np.ndarray, anchor_id: int,
                 out_path: np.ndarray) -> None:
    """DFlash2's greedy selector chain: row t picks its best candidate by
    score = value + <predecessor[prev] * projected[t], successor[candidate]> (first best on
    ties), prev = the anchor, then the pick. cand_ids/cand_values: [R, k]; projected: [R, r];
    predecessor, successor: [V, r] f32; out_path: [R] int64."""
    previous = anchor_id
    for t in range(cand_ids.shape[0]):
        candidates = cand_ids[t]
        pair = successor[candidates] @ (predecessor[previous] * projected[t])
        previous = int(candidates[int(np.argmax(cand_values[t] + pair))])
        out_path[t] = previous
