"""DFlash / DFlash2 drafters: loader, target checks, and the block forward on CpuOps against
an independent float64 NumPy reference written from the architecture (docs/DFLASH.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tiny import TINY_VOCAB, tiny_config
from tests.tiny_dflash import dflash_config, dflash_weights, write_dflash
from tests.tiny_hf import stored_value
from tf_async.backend.cpu.ops import CpuOps
from tf_async.backend.weights import DenseWeight
from tf_async.errors import BadInputError, ModelFormatError
from tf_async.models.config import config_from_hf
from tf_async.models.dflash import check_against_target, is_dflash_folder, load_dflash
from tf_async.models.dflash_model import DFlashModel

H = 64


# ---- the float64 reference ----------------------------------------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    hd = x.shape[-1]
    inv = theta ** -(np.arange(0, hd, 2) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _conv(x: np.ndarray, taps: np.ndarray, base: np.ndarray, group: int) -> np.ndarray:
    """out[t, c] = sum_o (base[o, c] + taps[t, o, c // group]) * x[t - o, c] (zero before 0)."""
    out = np.zeros_like(x)
    for o in range(base.shape[0]):
        past = np.zeros_like(x)
        past[o:] = x[: x.shape[0] - o]
        out += (base[o][None] + np.repeat(taps[:, o], group, axis=-1)) * past
    return out


class Reference:
    """The drafter computed from scratch for each block: all context rows, no ring."""

    def __init__(self, cfg: dict[str, Any], w: dict[str, np.ndarray], embed: np.ndarray,
                 head: np.ndarray):
        self.cfg, self.d = cfg, cfg["dflash_config"]
        self.w = {n: a.astype(np.float64) for n, a in w.items()}
        self.embed, self.head = embed.astype(np.float64), head.astype(np.float64)

    def attention_rule(self, layer: int) -> tuple[int | None, bool]:
        kind = (self.cfg.get("layer_types") or ["full_attention"] * 9)[layer]
        window = self.cfg["sliding_window"] if kind == "sliding_attention" else None
        causal = self.cfg.get("is_causal")
        return window, (kind == "sliding_attention") if causal is None else causal

    def sublayer_conv(self, name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        if name + ".base_kernel" not in self.w:
            return x, None
        k, g = self.d["conv_kernel_size"], self.d["conv_group_size"]
        taps = (x @ self.w[name + ".kernel_projection.weight"].T).reshape(len(x), 2, k, H // g)
        return _conv(x, taps[:, 0], self.w[name + ".base_kernel"][0], g), taps[:, 1]

    def attend(self, i: int, a: np.ndarray, ctx: np.ndarray, start: int) -> np.ndarray:
        w, c, p = self.w, self.cfg, f"layers.{i}.self_attn."
        nh, nkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
        both = np.concatenate([ctx, a])
        kpos = np.arange(len(both))
        qpos = np.arange(start, start + len(a))
        q = _rope(_rms((a @ w[p + "q_proj.weight"].T).reshape(len(a), nh, hd), w[p + "q_norm.weight"], eps), qpos, c["rope_theta"])
        k = _rope(_rms((both @ w[p + "k_proj.weight"].T).reshape(len(both), nkv, hd), w[p + "k_norm.weight"], eps), kpos, c["rope_theta"])
        v = (both @ w[p + "v_proj.weight"].T).reshape(len(both), nkv, hd)
        window, causal = self.attention_rule(i)
        out = np.empty((len(a), nh, hd))
        for r in range(len(a)):
            d = qpos[r] - kpos
            seen = np.ones(len(kpos), bool)
            if causal:
                seen &= d >= 0
            if window:
                seen &= np.abs(d) < window
            for head in range(nh):
                kv = head // (nh // nkv)
                s = k[seen, kv] @ q[r, head] / np.sqrt(hd)
                e = np.exp(s - s.max())
                out[r, head] = (e / e.sum()) @ v[seen, kv]
        return out.reshape(len(a), nh * hd) @ w[p + "o_proj.weight"].T

    def hidden(self, features: np.ndarray, ids: np.ndarray, start: int) -> np.ndarray:
        w, eps = self.w, self.cfg["rms_norm_eps"]
        ctx = _rms(features.astype(np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        x = self.embed[ids] * self.d.get("input_embedding_scale", 1.0)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            a, after = self.sublayer_conv(p + "attention_conv", _rms(x, w[p + "input_layernorm.weight"], eps))
            o = self.attend(i, a, ctx, start)
            x = x + (o if after is None else _conv(o, after, w[p + "attention_conv.base_kernel"][1], self.d["conv_group_size"]))
            m, after = self.sublayer_conv(p + "mlp_conv", _rms(x, w[p + "post_attention_layernorm.weight"], eps))
            g, u = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            f = (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
            x = x + (f if after is None else _conv(f, after, w[p + "mlp_conv.base_kernel"][1], self.d["conv_group_size"]))
        return _rms(x, w["norm.weight"], eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        out = hidden @ self.head.T * self.d.get("output_multiplier", 1.0)
        cap = self.d.get("final_logit_softcapping")
        return np.tanh(out / cap) * cap if cap else out

    def tokens(self, logits: np.ndarray, hidden: np.ndarray, anchor: int) -> np.ndarray:
        if "selector_rank" not in self.d:
            return np.argmax(logits, axis=-1)
        proj = hidden @ self.w["candidate_selector.hidden_projection.weight"].T
        pred, succ = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        out, prev = [], anchor
        for t in range(len(logits)):
            cand = np.argsort(-logits[t], kind="stable")[: self.d["selector_top_k"]]
            scores = [logits[t, c] + np.sum(pred[prev] * proj[t] * succ[c]) for c in cand]
            prev = int(cand[int(np.argmax(scores))])
            out.append(prev)
        return np.array(out)


# ---- fixtures -----------------------------------------------------------------------------
def _target_head(seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((TINY_VOCAB, H)).astype(np.float32),
            (rng.standard_normal((TINY_VOCAB, H)) / np.sqrt(H) * 4).astype(np.float32))


def _drafter(tmp_path: Path, generation: int, dtype: str = "bf16", **overrides: Any):
    cfg = dflash_config(generation, **overrides)
    weights = dflash_weights(cfg, seed=generation)
    folder = write_dflash(tmp_path / f"dflash{generation}", cfg, weights, dtype=dtype)
    stored = {n: stored_value(a, dtype) for n, a in weights.items()}
    return cfg, stored, folder


VARIANTS = [(1, {}), (2, {}), (1, {"layer_types": ["sliding_attention"] * 2, "sliding_window": 5}),
            (2, {"is_causal": True})]


# ---- loader and checks --------------------------------------------------------------------
@pytest.mark.parametrize("generation", [1, 2])
def test_loads_public_layout(tmp_path: Path, generation: int) -> None:
    cfg, stored, folder = _drafter(tmp_path, generation)
    assert is_dflash_folder(folder)
    ckpt = load_dflash(folder)
    c, w = ckpt.config, ckpt.weights
    assert (c.generation, c.block_size, c.mask_token_id, c.target_layer_ids) == (generation, 4, TINY_VOCAB - 1, (0, 1))
    np.testing.assert_array_equal(w.fc.dequantize(), stored["fc.weight"])
    np.testing.assert_array_equal(w.layers[1].down.dequantize(), stored["layers.1.mlp.down_proj.weight"])
    if generation == 1:
        assert (c.layer_windows, c.layer_causal, w.selector, w.layers[0].mlp_conv) == ((None, None), (False, False), None, None)
    else:
        assert (c.layer_windows, c.layer_causal, c.selector_top_k) == ((6, 6), (False, False), 4)
        assert (c.final_logit_softcapping, c.output_multiplier) == (20.0, 0.5)
        assert w.selector is not None and w.layers[0].attention_conv is not None
        np.testing.assert_array_equal(w.selector.successor_codebook, stored["candidate_selector.successor_codebook"])
        np.testing.assert_array_equal(w.layers[0].attention_conv.base_kernel, stored["layers.0.attention_conv.base_kernel"])


def test_target_mismatch_is_one_bad_input_error(tmp_path: Path) -> None:
    ckpt = load_dflash(_drafter(tmp_path, 2)[2])
    check_against_target(ckpt.config, config_from_hf(tiny_config("qwen3")))  # fits
    cases = {"vocab_size": tiny_config("qwen3", vocab_size=TINY_VOCAB + 64),
             "hidden_size": tiny_config("qwen3", hidden_size=96),
             "target_layer_ids": tiny_config("qwen3", num_hidden_layers=1)}
    for word, target in cases.items():
        with pytest.raises(BadInputError, match=word):
            check_against_target(ckpt.config, config_from_hf(target))


def test_malformed_folders(tmp_path: Path) -> None:
    cfg = dflash_config(1, architectures=["Qwen3ForCausalLM"])
    folder = write_dflash(tmp_path / "a", cfg, dflash_weights(cfg))
    assert not is_dflash_folder(folder)
    with pytest.raises(ModelFormatError, match="architectures"):
        load_dflash(folder)
    cfg = dflash_config(1)
    weights = dflash_weights(cfg)
    weights["fc.weight"] = weights["fc.weight"][:, :H]
    with pytest.raises(ModelFormatError, match="fc.weight"):
        load_dflash(write_dflash(tmp_path / "b", cfg, weights))


# ---- the forward against the reference ----------------------------------------------------
@pytest.mark.parametrize(("generation", "overrides"), VARIANTS)
def test_blocks_match_float64_reference(tmp_path: Path, generation: int, overrides: dict[str, Any]) -> None:
    cfg, stored, folder = _drafter(tmp_path, generation, **overrides)
    embed, head = _target_head()
    ops = CpuOps()
    model = DFlashModel(load_dflash(folder), ops, ops.upload_linear(DenseWeight(embed)),
                        ops.upload_linear(DenseWeight(head)))
    ref = Reference(cfg, stored, embed, head)
    rng = np.random.default_rng(3)
    features = rng.standard_normal((40, 2 * H)).astype(np.float32)
    capacity = 40 if model.context_rows_needed(40) == 40 else 6  # windows: a ring that wraps
    ring = model.new_ring(capacity)
    start = 0
    for num_new in (5, 3, 1, 4, 2, 4, 3, 4):  # a prompt, then accepted rows of each round
        model.write_context(ring, features[start:start + num_new], np.arange(start, start + num_new))
        start += num_new
        anchor = int(rng.integers(0, TINY_VOCAB - 1))
        ids = np.array([anchor] + [TINY_VOCAB - 1] * 3)
        want_hidden = ref.hidden(features[:start], ids, start)
        got_hidden = model.block_hidden(ring, start, ids)
        np.testing.assert_allclose(got_hidden, want_hidden, rtol=2e-4, atol=2e-4)
        want_logits = ref.logits(want_hidden[1:])
        np.testing.assert_allclose(model.logits(got_hidden[1:]), want_logits, rtol=2e-4, atol=2e-4)
        want = ref.tokens(want_logits, want_hidden[1:], anchor)
        np.testing.assert_array_equal(model.propose(ring, start, anchor), want)


def test_ring_rows_are_read(tmp_path: Path) -> None:
    """Mutation check: a block depends on the ring rows inside its window, not on the rest."""
    _, _, folder = _drafter(tmp_path, 2)
    embed, head = _target_head()
    ops = CpuOps()
    model = DFlashModel(load_dflash(folder), ops, DenseWeight(embed), DenseWeight(head))
    ring = model.new_ring(8)
    features = np.random.default_rng(5).standard_normal((12, 2 * H)).astype(np.float32)
    model.write_context(ring, features, np.arange(12))
    ids = np.array([3, TINY_VOCAB - 1, TINY_VOCAB - 1, TINY_VOCAB - 1])
    base = model.block_hidden(ring, 12, ids)
    outside = ring.copy()
    outside[:, :, 6 % 8] = 0.0  # position 6: 12 - 6 = window, seen by no query
    np.testing.assert_array_equal(model.block_hidden(outside, 12, ids), base)
    inside = ring.copy()
    inside[:, :, 11 % 8] = 0.0  # position 11: seen by every query
    assert not np.allclose(model.block_hidden(inside, 12, ids), base)
    with pytest.raises(ValueError, match="ring"):
        model.block_hidden(model.new_ring(4), 12, ids)


@pytest.mark.parametrize(("generation", "overrides"), VARIANTS)
def test_padded_ring_keys_give_the_blocks_of_unpadded_ones(tmp_path: Path, generation: int,
                                                            overrides: dict[str, Any]) -> None:
    """pad_keys (CUDA's layout: the ring's keys gathered up to a power of two, the padding
    masked) gives the blocks of the exact key count, up to summation order."""
    _, _, folder = _drafter(tmp_path, generation, **overrides)
    embed, head = _target_head()
    ops = CpuOps()
    model = DFlashModel(load_dflash(folder), ops, ops.upload_linear(DenseWeight(embed)),
                        ops.upload_linear(DenseWeight(head)))
    features = np.random.default_rng(4).standard_normal((40, 2 * H)).astype(np.float32)
    ring = model.new_ring(40)
    model.write_context(ring, features[:21], np.arange(21))
    ids = np.full(model.cfg.block_size, model.cfg.mask_token_id, np.int64)
    ids[0] = 5
    exact = model.block_hidden(ring, 21, ids)
    model.pad_keys = True
    assert model._block_inputs(ring, 21, ids)[2].shape[0] == 32  # 21 ring keys -> 32 gathered
    np.testing.assert_allclose(model.block_hidden(ring, 21, ids), exact, rtol=1e-5, atol=1e-6)
