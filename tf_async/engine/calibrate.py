"""fp8 KV scales: one per layer and kind, from the K/V magnitudes of a calibration text.

scale = HEADROOM * amax / 448, so values up to HEADROOM x the calibrated peak do not saturate.
"""

from __future__ import annotations

import numpy as np

from ..models.batch_io import ForwardBatch
from ..models.checkpoint import Checkpoint
from ..models.protocol import DecoderProtocol

E4M3_MAX = 448.0
HEADROOM = 4.0
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers "
    "that changed physics. def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Question: What is the capital of France? Answer: Paris. 12345 + 67890 = 80235. "
    "Les élèves étudient à l'école; 東京は日本の首都です。"
)


def fp8_kv_scales(decoder: DecoderProtocol, token_ids: list[int] | None = None) -> np.ndarray:
    """Run the calibration tokens through an f32 scratch arena and measure |K|, |V| maxima
    (of the full-attention layers only for hybrids: `config` is their KV view)."""
    ops, cfg = decoder.ops, decoder.config
    ids = token_ids or [(7 * i + 3) % cfg.vocab_size for i in range(96)]
    rows = len(ids)
    kv = ops.alloc_kv(cfg.num_layers, rows, cfg.num_kv_heads, cfg.head_dim, "f32")
    ones = ops.asarray(np.ones((cfg.num_layers, 2), np.float32))
    pos = np.arange(rows, dtype=np.int64)
    put = ops.asarray
    batch = ForwardBatch(put(np.asarray(ids, np.int64)), put(pos), put(pos),
                         put(np.zeros(rows, np.int32)), put(np.zeros((1, 1), np.int32)),
                         put(np.asarray([rows - 1], np.int64)), rows)
    decoder.one_shot(batch, kv, ones)  # hybrids: a fresh zero state, no lane of the engine
    amax = np.abs(ops.to_host(kv)).reshape(cfg.num_layers, 2, -1).max(axis=-1)
    return (np.maximum(amax, 1e-6) * HEADROOM / E4M3_MAX).astype(np.float32)


def kv_scales_for(decoder: DecoderProtocol, ckpt: Checkpoint, kv_dtype: str) -> np.ndarray | None:
    """Per-layer fp8 K/V scales calibrated on the model, or None for f32/bf16."""
    if kv_dtype != "fp8":
        return None
    return fp8_kv_scales(decoder, ckpt.tokenizer.encode(CALIBRATION_TEXT))
