"""A Q4_1 llama GGUF at SmolLM2-135M's layer shapes (4 layers, random weights, the tests' tiny
tokenizer), its embeddings Q8_0 and tied like the default model's: the same kernels as the
default model, for timing a GPU cold start without carrying the default model's 94 MB.

    python benchmarks/tiny_default_gguf.py /tmp/tq41.gguf
"""
import sys

from tests.tiny import random_hf_weights, tiny_config
from tests.tiny_gguf import write_gguf

cfg = tiny_config("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, num_hidden_layers=4, tie_word_embeddings=True)
weights = random_hf_weights(cfg)
weights.pop("lm_head.weight", None)
print(write_gguf(sys.argv[1], cfg, weights, qtype="Q4_1",
                 tensor_types={"token_embd.weight": "Q8_0"}))
