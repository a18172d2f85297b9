"""Sanity of the float64 Qwen3.5 reference (tests/reference_qwen35.py) and of the tiny
checkpoint writers (tests/tiny_qwen35.py): the identities of MODELS.md section 9, one GDN
layer and one gated-attention token computed by hand, stepped == whole, and files that
decode to exactly the weights the reference is given."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests import reference_qwen35 as ref
from tests import tiny_qwen35 as tq
from tf_async.backend.weights import dequantize_affine
from tf_async.models.safetensors_io import load_safetensors

PROMPT = [5, 17, 200, 33, 9, 41, 300, 7, 12, 250, 3]


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model(request):
    cfg = tq.tiny_qwen35_config(moe=request.param)
    return cfg, tq.random_qwen35_weights(cfg, seed=3)


def test_chunked_delta_rule_equals_recurrent():
    rng = np.random.default_rng(0)
    T, hk, hv, dk, dv = 150, 2, 6, 8, 5  # T not a multiple of the chunk, Hv > Hk
    q = ref.l2_normalize(rng.standard_normal((T, hk, dk))) / math.sqrt(dk)
    k = ref.l2_normalize(rng.standard_normal((T, hk, dk)))
    v = rng.standard_normal((T, hv, dv))
    g, beta = -rng.uniform(0.0, 1.0, (T, hv)), rng.uniform(0.0, 1.0, (T, hv))
    state = rng.standard_normal((hv, dk, dv))
    seq_out, seq_state = ref.recurrent_delta_rule(q, k, v, g, beta, state)
    chunk_out, chunk_state = ref.chunked_delta_rule(q, k, v, g, beta, state, chunk=64)
    np.testing.assert_allclose(chunk_out, seq_out, atol=1e-10)
    np.testing.assert_allclose(chunk_state, seq_state, atol=1e-10)


def test_zero_centred_norm_is_plain_norm_with_w_plus_one():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 16)), 0.1 * rng.standard_normal(16)
    np.testing.assert_allclose(ref.zero_centred_rms_norm(x, w, 1e-6), ref.rms_norm(x, w + 1, 1e-6),
                               rtol=1e-14)


def test_one_token_gdn_layer_by_hand(model):
    """From zero state: conv sees only the last tap, S = k (beta v)^T, o = beta v (k.q)."""
    cfg, w = model
    hk, hv, dk, dv, kernel = ref.gdn_dims(cfg)
    p = tq.LM + "layers.0.linear_attn."
    a = np.random.default_rng(2).standard_normal((1, cfg["hidden_size"]))
    W = {n: w[p + n].astype(np.float64) for n in
         ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight",
          "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")}
    mixed = ref.silu(W["conv1d.weight"][:, 0, kernel - 1] * (W["in_proj_qkv.weight"] @ a[0]))
    q = mixed[:hk * dk].reshape(hk, dk)
    k = mixed[hk * dk:2 * hk * dk].reshape(hk, dk)
    v = mixed[2 * hk * dk:].reshape(hv, dv)
    beta = 1 / (1 + np.exp(-(W["in_proj_b.weight"] @ a[0])))
    z = (W["in_proj_z.weight"] @ a[0]).reshape(hv, dv)
    o = np.zeros((hv, dv))
    for h in range(hv):
        qh, kh = q[h // (hv // hk)], k[h // (hv // hk)]
        cos = qh @ kh / np.sqrt((qh @ qh + 1e-6) * (kh @ kh + 1e-6))  # eps inside each L2 norm
        o[h] = beta[h] * v[h] * cos / math.sqrt(dk)
    y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + 1e-6) * W["norm.weight"] * ref.silu(z)
    want = W["out_proj.weight"] @ y.reshape(-1)
    conv0, delta0 = np.zeros((kernel - 1, 2 * hk * dk + hv * dv)), np.zeros((hv, dk, dv))
    got, conv1, _ = ref.gated_deltanet(cfg, w, p, a, conv0, delta0)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(conv1[-1], W["in_proj_qkv.weight"] @ a[0])  # raw row kept


def test_one_token_gated_attention_by_hand(model):
    """One token attends only to itself: out = (v_{kv(j)} * sigmoid(gate_j)) @ o_proj^T,
    with query and gate interleaved per head in q_proj's rows."""
    cfg, w = model
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = tq.LM + "layers.3.self_attn."
    a = np.random.default_rng(3).standard_normal((1, cfg["hidden_size"]))
    rows = w[p + "q_proj.weight"].astype(np.float64).reshape(nh, 2, hd, -1)  # [head, q|gate, hd, H]
    gate = rows[:, 1] @ a[0]  # [nh, hd]
    v = (w[p + "v_proj.weight"].astype(np.float64) @ a[0]).reshape(nkv, hd)
    attn = np.stack([v[j // (nh // nkv)] for j in range(nh)]) * ref.sigmoid(gate)
    want = w[p + "o_proj.weight"].astype(np.float64) @ attn.reshape(-1)
    got = ref.gated_attention(cfg, w, p, a, np.array([7]), ref.KVCache())
    np.testing.assert_allclose(got[0], want, rtol=1e-10, atol=1e-12)


def test_partial_rope_leaves_tail_dims():
    x = np.random.default_rng(4).standard_normal((2, 3, 32))
    out = ref.rope_partial(x, np.array([0, 9]), 10000.0, 8)
    assert np.array_equal(out[:, :, 8:], x[:, :, 8:])
    assert np.array_equal(out[0], x[0])  # position 0: no rotation
    assert not np.allclose(out[1, :, :8], x[1, :, :8])


def test_stepped_equals_whole(model):
    cfg, w = model
    whole, whole_hidden, _ = ref.reference_forward(cfg, w, PROMPT)
    head, _, state = ref.reference_forward(cfg, w, PROMPT[:4])
    mid, _, state = ref.reference_forward(cfg, w, PROMPT[4:5], state)
    tail, tail_hidden, state = ref.reference_forward(cfg, w, PROMPT[5:], state)
    np.testing.assert_allclose(np.concatenate([head, mid, tail]), whole, atol=1e-12)
    np.testing.assert_allclose(tail_hidden, whole_hidden[5:], atol=1e-12)
    assert state.num_tokens == len(PROMPT)


def test_logits_are_sharp_and_nested_config_is_the_same_model(model):
    cfg, w = model
    logits = ref.reference_logits(cfg, w, PROMPT)
    assert logits.shape == (len(PROMPT), cfg["vocab_size"])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 0.1  # greedy choices are not coin flips
    np.testing.assert_array_equal(ref.reference_logits(tq.as_vl_config(cfg), w, PROMPT), logits)


def test_moe_fused_and_per_expert_layouts_agree():
    cfg = tq.tiny_qwen35_config(moe=True)
    w = tq.random_qwen35_weights(cfg, seed=4)
    split = tq._split_per_expert(w, "")
    assert tq.LM + "layers.0.mlp.experts.3.down_proj.weight" in split
    np.testing.assert_allclose(ref.reference_logits(cfg, split, PROMPT[:5]),
                               ref.reference_logits(cfg, w, PROMPT[:5]), atol=1e-12)


def test_mtp_drafts_follow_the_sync_slots(model):
    """d_1 is the MTP head at slot n over pairs (x_{s+1}, h_s); MTP logits of one row at
    slot 0 differ if the concat order (embedding first) is swapped."""
    cfg, w = model
    next_token, drafts = ref.reference_mtp_drafts(cfg, w, PROMPT, 3)
    logits, hidden, _ = ref.reference_forward(cfg, w, PROMPT)
    assert next_token == int(np.argmax(logits[-1])) and len(drafts) == 3
    mtp = ref.reference_mtp_logits(cfg, w, hidden, PROMPT[1:] + [next_token])
    assert drafts[0] == int(np.argmax(mtp[-1]))
    one = ref.reference_mtp_logits(cfg, w, hidden[0], PROMPT[1])
    np.testing.assert_allclose(one[0], mtp[0], atol=1e-12)  # slot 0 sees only itself
    swapped = dict(w)
    H = cfg["hidden_size"]
    swapped["mtp.fc.weight"] = np.concatenate([w["mtp.fc.weight"][:, H:], w["mtp.fc.weight"][:, :H]], 1)
    assert not np.allclose(ref.reference_mtp_logits(cfg, swapped, hidden[0], PROMPT[1]), one)


def test_hf_folder_decodes_to_the_effective_weights(tmp_path, model):
    cfg, w = model
    folder = tq.write_qwen35_hf(tmp_path / "hf", cfg, w, "bf16", per_expert_mtp=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(load_safetensors(file))
    want = tq.hf_effective_weights(tq._split_per_expert(w, "mtp."), "bf16")
    assert sorted(stored) == sorted(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(stored[name], arr, err_msg=name)
    assert stored[tq.LM + "layers.0.linear_attn.A_log"].dtype == np.float32


def _decode_mlx(stored: dict[str, np.ndarray], config: dict, name: str) -> np.ndarray:
    module = name.removesuffix(".weight")
    params = config["quantization"].get(module, config["quantization"])
    scales, biases = (stored[module + s].astype(np.float32) for s in (".scales", ".biases"))
    return dequantize_affine(stored[name], scales, biases, params["bits"], params["group_size"])


def test_mlx_folder_layout_and_values(tmp_path):
    cfg = tq.tiny_qwen35_config(moe=True)
    w = tq.random_qwen35_weights(cfg, seed=5)
    folder = tq.write_qwen35_mlx(tmp_path / "mlx", cfg, w, bits=4, group_size=32)
    stored = load_safetensors(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    eff = tq.mlx_effective_weights(w, 4, 32)
    lm = "language_model.model.layers."
    assert stored[lm + "0.linear_attn.conv1d.weight"].shape == (128, 4, 1)
    assert config["quantization"][lm + "0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert config["quantization"]["mtp.layers.0.mlp.shared_expert_gate"]["bits"] == 8
    np.testing.assert_array_equal(stored[lm + "1.linear_attn.norm.weight"],
                                  w[tq.LM + "layers.1.linear_attn.norm.weight"])  # N3: unshifted
    np.testing.assert_array_equal(stored[lm + "3.self_attn.q_norm.weight"],
                                  w[tq.LM + "layers.3.self_attn.q_norm.weight"] + np.float32(1))
    up = _decode_mlx(stored, config, lm + "2.mlp.switch_mlp.up_proj.weight")
    np.testing.assert_array_equal(up, eff[tq.LM + "layers.2.mlp.experts.gate_up_proj"][:, 32:])
    np.testing.assert_array_equal(_decode_mlx(stored, config, "language_model.lm_head.weight"),
                                  eff["lm_head.weight"])
    assert "mtp.fc.weight" in stored
    assert not any(n.startswith("mtp.") for n in tq.mlx_qwen35_tensors(w, keep_mtp=False)[0])
    quantized = ref.reference_logits(cfg, eff, PROMPT[:4])
    exact = ref.reference_logits(cfg, w, PROMPT[:4])
    assert not np.allclose(quantized, exact)  # 4-bit changes logits, but keeps their shape
    assert np.corrcoef(quantized.ravel(), exact.ravel())[0, 1] > 0.8
