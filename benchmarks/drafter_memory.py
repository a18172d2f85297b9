"""Per-lane drafter memory, fixed vs in the run, for the default model and a Qwen3-8B shape.

    python benchmarks/drafter_memory.py [--parallel 4] [--ctx 32768]
"""

from __future__ import annotations

import argparse

from tf_async.engine.area import lane_memory_lines
from tf_async.models.config import ModelConfig

SMOLLM2_135M = ModelConfig(arch="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, intermediate_size=1536, vocab_size=49152)
QWEN3_8B = ModelConfig(arch="qwen3", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=12288, vocab_size=151936)
QWEN3_06B = ModelConfig(arch="qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                        head_dim=128, intermediate_size=3072, vocab_size=151936)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--ctx", type=int, default=32768)
    args = p.parse_args()
    cases = [
        ("default model SmolLM2-135M (kv f32)", SMOLLM2_135M, SMOLLM2_135M, 30, "draft:self", "f32"),
        ("default model SmolLM2-135M (kv f32)", SMOLLM2_135M, SMOLLM2_135M, 1, "mtp-shaped", "f32"),
        ("Qwen3-8B shape (kv bf16)", QWEN3_8B, QWEN3_8B, 1, "mtp-shaped", "bf16"),
        ("Qwen3-8B shape (kv bf16)", QWEN3_8B, QWEN3_06B, 28, "draft:Qwen3-0.6B", "bf16"),
    ]
    for name, target, drafter, layers, drafter_name, kv_dtype in cases:
        print("\n".join(lane_memory_lines(name, target, drafter, parallel=args.parallel, ctx=args.ctx,
                                          kv_dtype=kv_dtype, drafter_layers=layers,
                                          drafter_name=drafter_name)))
        print()


if __name__ == "__main__":
    main()
