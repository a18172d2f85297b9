"""llama.cpp's Qwen3.5 / Qwen3.5-MoE GGUF files (`qwen35`, `qwen35moe`) -> the HF path's weights.

The config goes through hf_qwen35's parser (metadata rewritten as an HF text config), and the
tensors land in the same HybridWeights, in HF layout (docs/QWEN35.md "GGUF layout"). What
llama.cpp's converter changed, and what we undo here:
- V heads: grouped by K head in HF (head g*r + j), tiled in GGUF (at j*Hk + g) — in attn_qkv's
  V rows, attn_gate, ssm_beta, ssm_alpha, ssm_dt, ssm_a, ssm_conv1d's V channels and
  ssm_out's columns; we gather them back (rows of quantized blocks move whole);
- `ssm_a = -exp(A_log)`: A_log = log(-ssm_a);
- N2 norms are stored as 1 + w, the applied form HybridWeights holds (ssm_norm is plain);
- conv1d squeezed to [C, K]; experts stacked (or fused `ffn_gate_up_exps`);
- MTP: `nextn_predict_layers` blocks appended after the trunk (block_count counts them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from ..backend.weights import AffineWeight, DenseWeight, Linear
from ..errors import ModelFormatError
from .checkpoint import Checkpoint
from .gguf_io import (
    HYBRID_GGUF_ARCHS,
    GgufKeys,
    TensorTable,
    gguf_info,
    rope_scaling_of,
    special_ids,
    vocab_size_of,
)
from .hf_qwen35 import MTP_DEDICATED, MTP_NONE, MTP_OK, hybrid_config_from_hf
from .progress import LoadProgress
from .qwen35 import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    DeltaNetWeights,
    DenseFfnWeights,
    FfnWeights,
    GatedAttentionWeights,
    HybridConfig,
    HybridLayerWeights,
    HybridWeights,
    MoeFfnWeights,
    MtpWeights,
)

MTP_OWN_HEAD = "unsupported: the GGUF's MTP block has its own head (nextn.shared_head_head)"


# ---------------------------------------------------------------------------------------
# config


def _kv_heads(keys: GgufKeys, heads: int) -> int:
    """head_count_kv: a number, or a per-layer array with 0 on the recurrent layers."""
    value = keys.get("attention.head_count_kv", heads)
    if not isinstance(value, list):
        return int(value)
    counts = {int(v) for v in value if int(v) > 0}
    if len(counts) != 1:
        raise ModelFormatError(f"{keys.source}: per-layer {keys.arch}.attention.head_count_kv="
                               f"{value} is not supported")
    return counts.pop()


def _layer_types(keys: GgufKeys, num_layers: int) -> list[str]:
    interval = keys.integer("full_attention_interval", 4)  # llama.cpp's default
    if interval <= 0:
        raise ModelFormatError(f"{keys.source}: bad {keys.arch}.full_attention_interval={interval}")
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)]


def _gdn_keys(keys: GgufKeys) -> dict[str, int]:
    num_v_heads, inner = keys.integer("ssm.time_step_rank"), keys.integer("ssm.inner_size")
    if num_v_heads <= 0 or inner % num_v_heads:
        raise ModelFormatError(f"{keys.source}: {keys.arch}.ssm.inner_size={inner} is not a "
                               f"multiple of ssm.time_step_rank={num_v_heads}")
    return {"linear_num_key_heads": keys.integer("ssm.group_count"),
            "linear_num_value_heads": num_v_heads,
            "linear_key_head_dim": keys.integer("ssm.state_size"),
            "linear_value_head_dim": inner // num_v_heads,
            "linear_conv_kernel_dim": keys.integer("ssm.conv_kernel")}


def _ffn_keys(keys: GgufKeys, moe: bool) -> dict[str, int]:
    if not moe:
        return {"intermediate_size": keys.integer("feed_forward_length")}
    return {"num_experts": keys.integer("expert_count"),
            "num_experts_per_tok": keys.integer("expert_used_count"),
            "moe_intermediate_size": keys.integer("expert_feed_forward_length"),
            "shared_expert_intermediate_size": keys.integer("expert_shared_feed_forward_length")}


def hf_text_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str
                   ) -> dict[str, Any]:
    """The HF text config (config.json keys) a qwen35 / qwen35moe GGUF's metadata describes."""
    arch = str(meta.get("general.architecture"))
    keys = GgufKeys(meta, arch, source)
    nextn = keys.integer("nextn_predict_layers", 0)
    num_layers = keys.integer("block_count") - nextn  # block_count counts the MTP blocks
    hidden, heads = keys.integer("embedding_length"), keys.integer("attention.head_count")
    if hidden <= 0 or heads <= 0 or num_layers <= 0:
        raise ModelFormatError(f"{source}: bad embedding_length={hidden} / head_count={heads} / "
                               f"block_count - nextn_predict_layers={num_layers}")
    head_dim = keys.integer("attention.key_length", hidden // heads)
    rope = {"rope_type": "default", "rope_theta": float(keys.get("rope.freq_base", 10000.0)),
            "partial_rotary_factor": keys.integer("rope.dimension_count", head_dim) / head_dim}
    rope.update(rope_scaling_of(keys) or {})
    bos, eos = special_ids(meta)
    return {
        "model_type": HYBRID_GGUF_ARCHS[arch], "hidden_size": hidden,
        "num_hidden_layers": num_layers, "layer_types": _layer_types(keys, num_layers),
        "num_attention_heads": heads, "num_key_value_heads": _kv_heads(keys, heads),
        "head_dim": head_dim, "rope_parameters": rope, **_gdn_keys(keys),
        **_ffn_keys(keys, arch == "qwen35moe"),
        "rms_norm_eps": float(keys.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": keys.integer("context_length", 4096),
        "vocab_size": vocab_size_of(meta, keys, shapes),
        "tie_word_embeddings": "output.weight" not in shapes,
        "mtp_num_hidden_layers": nextn,
        "mtp_use_dedicated_embeddings": f"blk.{num_layers}.nextn.embed_tokens.weight" in shapes,
        "bos_token_id": bos, "eos_token_id": list(eos),
    }


def hybrid_config_from_gguf(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], *,
                            source: str = "gguf") -> HybridConfig:
    """HybridConfig of a qwen35 / qwen35moe GGUF (parsed as its HF text config would be)."""
    raw = hf_text_config(meta, shapes, source)
    hybrid = hybrid_config_from_hf(raw, source=source)
    rotary = GgufKeys(meta, str(meta["general.architecture"]), source).integer(
        "rope.dimension_count", hybrid.kv_config.head_dim)
    kv_config = replace(hybrid.kv_config, rotary_dim=rotary,  # exact, not head_dim * factor
                        name=str(meta.get("general.name") or Path(source).stem),
                        extra={"gguf_architecture": meta["general.architecture"]})
    return replace(hybrid, kv_config=kv_config)


# ---------------------------------------------------------------------------------------
# inverse transforms


def v_head_order(num_k_heads: int, num_v_heads: int) -> np.ndarray:
    """For each HF V head h = g*r + j (grouped by K head g), its GGUF position j*Hk + g (tiled)."""
    heads = np.arange(num_v_heads)
    per_k = num_v_heads // num_k_heads
    return (heads % per_k) * num_k_heads + heads // per_k


def head_rows(order: np.ndarray, head_dim: int) -> np.ndarray:
    """Row indices of whole heads of `head_dim` rows, taken in `order`."""
    return (order[:, None] * head_dim + np.arange(head_dim)).reshape(-1)


def take_rows(w: Linear, rows: np.ndarray) -> Linear:
    """Rows (output features) of a linear in a new order; quantized rows move whole."""
    if isinstance(w, DenseWeight):
        return DenseWeight(np.ascontiguousarray(w.w[rows]))
    return AffineWeight(np.ascontiguousarray(w.codes[rows]), np.ascontiguousarray(w.scales[rows]),
                        np.ascontiguousarray(w.biases[rows]), w.bits, w.group_size)


def take_column_heads(w: Linear, order: np.ndarray, head_dim: int) -> Linear:
    """Input columns of a linear in whole heads of `head_dim`, taken in `order`. Quantized
    groups move whole when a head is a whole number of groups; otherwise dequantized."""
    if isinstance(w, AffineWeight) and head_dim % w.group_size == 0 \
            and head_dim * w.bits % 32 == 0:
        out, heads = w.out_features, len(order)

        def gather(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a.reshape(out, heads, -1)[:, order].reshape(out, -1))

        return AffineWeight(gather(w.codes), gather(w.scales), gather(w.biases), w.bits,
                            w.group_size)
    dense = w.w if isinstance(w, DenseWeight) else w.dequantize()
    return DenseWeight(np.ascontiguousarray(dense[:, head_rows(order, head_dim)]))


def split_rows(w: Linear, at: int) -> tuple[Linear, Linear]:
    """[..., out, in] -> rows [0, at) and [at, out) (fused gate_up experts)."""
    if isinstance(w, DenseWeight):
        return DenseWeight(w.w[..., :at, :]), DenseWeight(w.w[..., at:, :])

    def half(a: np.ndarray, lower: bool) -> np.ndarray:
        return a[..., :at, :] if lower else a[..., at:, :]

    return (AffineWeight(half(w.codes, True), half(w.scales, True), half(w.biases, True),
                         w.bits, w.group_size),
            AffineWeight(half(w.codes, False), half(w.scales, False), half(w.biases, False),
                         w.bits, w.group_size))


def a_log_from_ssm_a(ssm_a: np.ndarray, name: str, source: str) -> np.ndarray:
    """A_log from llama.cpp's `ssm_a = -exp(A_log)`: of the float32 neighbours of log(-ssm_a),
    one whose (correctly rounded) exp is exactly the stored value, so the decay the kernels
    compute equals the file's."""
    if not np.all(ssm_a < 0):
        raise ModelFormatError(f"{source}: tensor {name!r} must be negative (-exp(A_log))")
    decay = -ssm_a.astype(np.float32)
    nearest = np.log(decay.astype(np.float64)).astype(np.float32)
    best = nearest.copy()
    for candidate in (np.nextafter(nearest, np.float32(-np.inf)),
                      np.nextafter(nearest, np.float32(np.inf)), nearest):
        exact = np.exp(candidate.astype(np.float64)).astype(np.float32) == decay
        best = np.where(exact, candidate, best)
    return best.astype(np.float32)


# ---------------------------------------------------------------------------------------
# tensors


class HybridGgufReader:
    """Reads a qwen35 / qwen35moe GGUF's tensors (shape checked) into HybridWeights."""

    def __init__(self, table: TensorTable, hybrid: HybridConfig, v_heads_tiled: bool):
        self.table, self.hybrid, self.cfg = table, hybrid, hybrid.kv_config
        hk, hv = hybrid.linear_num_key_heads, hybrid.linear_num_value_heads
        self.v_order = v_head_order(hk, hv) if v_heads_tiled else np.arange(hv)

    def deltanet(self, p: str) -> DeltaNetWeights:
        hyb, t, hidden, order = self.hybrid, self.table, self.cfg.hidden_size, self.v_order
        hv, dv, channels = hyb.linear_num_value_heads, hyb.linear_value_head_dim, hyb.conv_channels
        qk = 2 * hyb.linear_num_key_heads * hyb.linear_key_head_dim
        v_rows = head_rows(order, dv)
        qkv_rows = np.concatenate([np.arange(qk), qk + v_rows])
        ssm_a = t.vector(p + "ssm_a", hv)[order]
        return DeltaNetWeights(
            in_qkv=take_rows(t.linear(p + "attn_qkv.weight", (channels, hidden)), qkv_rows),
            in_z=take_rows(t.linear(p + "attn_gate.weight", (hv * dv, hidden)), v_rows),
            in_b=take_rows(t.linear(p + "ssm_beta.weight", (hv, hidden)), order),
            in_a=take_rows(t.linear(p + "ssm_alpha.weight", (hv, hidden)), order),
            conv=np.ascontiguousarray(
                t.floats(p + "ssm_conv1d.weight", (channels, hyb.linear_conv_kernel_dim))[qkv_rows]),
            a_log=a_log_from_ssm_a(ssm_a, p + "ssm_a", t.source),
            dt_bias=np.ascontiguousarray(t.vector(p + "ssm_dt.bias", hv)[order]),
            norm=t.vector(p + "ssm_norm.weight", dv),
            out=take_column_heads(t.linear(p + "ssm_out.weight", (hidden, hv * dv)), order, dv))

    def attention(self, p: str) -> GatedAttentionWeights:
        cfg, t = self.cfg, self.table
        hidden, q_size, kv_size, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
        return GatedAttentionWeights(
            q=t.linear(p + "attn_q.weight", (2 * q_size, hidden)),  # per head [query | gate]
            k=t.linear(p + "attn_k.weight", (kv_size, hidden)),
            v=t.linear(p + "attn_v.weight", (kv_size, hidden)),
            o=t.linear(p + "attn_output.weight", (hidden, q_size)),
            q_norm=t.vector(p + "attn_q_norm.weight", hd),
            k_norm=t.vector(p + "attn_k_norm.weight", hd))

    def ffn(self, p: str) -> FfnWeights:
        t, hidden = self.table, self.cfg.hidden_size
        if not self.hybrid.is_moe:
            inter = self.cfg.intermediate_size
            return DenseFfnWeights(gate=t.linear(p + "ffn_gate.weight", (inter, hidden)),
                                   up=t.linear(p + "ffn_up.weight", (inter, hidden)),
                                   down=t.linear(p + "ffn_down.weight", (hidden, inter)))
        shared = self.hybrid.shared_expert_intermediate_size
        return MoeFfnWeights(
            router=t.linear(p + "ffn_gate_inp.weight", (self.cfg.num_experts, hidden)),
            **self._experts(p),
            shared_gate=t.linear(p + "ffn_gate_shexp.weight", (shared, hidden)),
            shared_up=t.linear(p + "ffn_up_shexp.weight", (shared, hidden)),
            shared_down=t.linear(p + "ffn_down_shexp.weight", (hidden, shared)),
            shared_expert_gate=self._shared_expert_gate(p + "ffn_gate_inp_shexp.weight"))

    def _experts(self, p: str) -> dict[str, Linear]:
        t, hidden = self.table, self.cfg.hidden_size
        experts, inter = self.cfg.num_experts, self.cfg.moe_intermediate_size
        down = t.linear(p + "ffn_down_exps.weight", (experts, hidden, inter))
        if t.has(p + "ffn_gate_up_exps.weight"):  # fused, rows [0, Im) gate
            fused = t.linear(p + "ffn_gate_up_exps.weight", (experts, 2 * inter, hidden))
            gate, up = split_rows(fused, inter)
            return {"experts_gate": gate, "experts_up": up, "experts_down": down}
        return {"experts_gate": t.linear(p + "ffn_gate_exps.weight", (experts, inter, hidden)),
                "experts_up": t.linear(p + "ffn_up_exps.weight", (experts, inter, hidden)),
                "experts_down": down}

    def _shared_expert_gate(self, name: str) -> Linear:
        hidden = self.cfg.hidden_size
        if self.table.has(name) and self.table.shape(name) == (hidden,):  # stored squeezed
            return DenseWeight(self.table.vector(name, hidden)[None, :])
        return self.table.linear(name, (1, hidden))

    def layer(self, index: int, kind: str) -> HybridLayerWeights:
        p, hidden = f"blk.{index}.", self.cfg.hidden_size
        mixer = self.deltanet(p) if kind == LINEAR_ATTENTION else self.attention(p)
        return HybridLayerWeights(
            kind=kind, input_norm=self.table.vector(p + "attn_norm.weight", hidden),
            post_norm=self.table.vector(p + "post_attention_norm.weight", hidden),
            mixer=mixer, ffn=self.ffn(p))

    def mtp(self) -> tuple[MtpWeights | None, str]:
        if not self.hybrid.mtp_num_hidden_layers:
            return None, MTP_NONE
        if self.hybrid.mtp_use_dedicated_embeddings:
            return None, MTP_DEDICATED
        block, hidden, t = self.hybrid.num_trunk_layers, self.cfg.hidden_size, self.table
        p = f"blk.{block}.nextn."
        if t.has(p + "shared_head_head.weight"):
            return None, MTP_OWN_HEAD
        return MtpWeights(
            fc=t.linear(p + "eh_proj.weight", (hidden, 2 * hidden)),  # [norm(embed) | norm(h)]
            pre_fc_norm_embedding=t.vector(p + "enorm.weight", hidden),
            pre_fc_norm_hidden=t.vector(p + "hnorm.weight", hidden),
            norm=t.vector(p + "shared_head_norm.weight", hidden),
            layer=self.layer(block, FULL_ATTENTION)), MTP_OK

    def model(self) -> HybridWeights:
        cfg, t = self.cfg, self.table
        embed = t.linear("token_embd.weight", (cfg.vocab_size, cfg.hidden_size))
        lm_head = embed if cfg.tie_word_embeddings else t.linear(
            "output.weight", (cfg.vocab_size, cfg.hidden_size))
        layers = [self.layer(i, kind) for i, kind in enumerate(self.hybrid.layer_types)]
        final_norm = t.vector("output_norm.weight", cfg.hidden_size)
        mtp, status = self.mtp()
        self._check_all_used(mtp is not None)
        return HybridWeights(self.hybrid, embed, lm_head, final_norm, layers, mtp,
                             mtp_status=status)

    def _check_all_used(self, mtp_loaded: bool) -> None:
        mtp_blocks = tuple(f"blk.{self.hybrid.num_trunk_layers + i}."
                           for i in range(self.hybrid.mtp_num_hidden_layers))
        unused = [name for name in self.table.tensors if name not in self.table.used
                  and (mtp_loaded or not name.startswith(mtp_blocks))]
        if unused:
            raise ModelFormatError(f"{self.table.source}: unexpected tensor(s) for "
                                   f"{self.cfg.extra.get('gguf_architecture')}: {unused[:5]}"
                                   + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))


# ---------------------------------------------------------------------------------------
# file


def load_qwen35_gguf(reader: GGUFReader, metadata: dict[str, Any], source: str,
                     progress: LoadProgress | None = None) -> Checkpoint:
    """A qwen35 / qwen35moe GGUF (open reader + its metadata) as the Checkpoint the HF path
    makes: `config` is the KV view, the trunk is `weights.hybrid`; meta["mtp"] says whether
    the MTP block loaded."""
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}
    hybrid = hybrid_config_from_gguf(metadata, shapes, source=source)
    arch = str(metadata["general.architecture"])
    tiled = bool(metadata.get(f"{arch}.ssm.v_head_reordered", True))  # llama.cpp: always
    weights = HybridGgufReader(TensorTable(tensors, source, progress), hybrid, tiled).model()
    meta: dict[str, object] = {
        **{k: v for k, v in gguf_info(reader, metadata).items() if k != "metadata"},
        "arch": hybrid.kv_config.arch,
        "num_trunk_layers": hybrid.num_trunk_layers,
        "layer_types": list(hybrid.layer_types),
        "norms": "gguf: stored as 1 + w",
        "v_heads": "tiled in the file, regrouped at load" if tiled else "grouped",
        "mtp": weights.mtp_status,
        "mtp_num_hidden_layers": hybrid.mtp_num_hidden_layers,
    }
    from .tokenizer import Tokenizer  # lazy, as in gguf_io.py

    tokenizer = Tokenizer.from_gguf_metadata(metadata, source=source)
    return Checkpoint(config=hybrid.kv_config, weights=weights,  # type: ignore[arg-type]
                      tokenizer=tokenizer, path=source, meta=meta)
