"""Record llama.cpp's token ids for the tokenizer test texts on the default model
(tests/data/llama_cpp_tokens.json; test_tokenizer.py compares ours with them, so CI needs no
llama.cpp build). Needs llama-cpp-python:

    python -m tests.record_llama_cpp_tokens
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tf_async.models.default import default_model_path

OUT = Path(__file__).parent / "data" / "llama_cpp_tokens.json"


def tokenizer_texts(base: list[str]) -> list[str]:
    """`base` and 500 random strings (ASCII, Latin, CJK, emoji, odd spaces, specials)."""
    rng = random.Random(7)
    pools = [range(0x20, 0x7F), range(0xA0, 0x250), range(0x4E00, 0x4E80),
             range(0x1F600, 0x1F650), [0x9, 0xA, 0xD, 0x85, 0x301, 0x2009, 0x200B, 0x3000]]
    return base + ["".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(1, 30)))
                   + rng.choice(["", "", "<|im_start|>", "<|im_end|>", "<repo_name>"])
                   for _ in range(500)]


def main() -> None:
    import llama_cpp

    from tests.test_tokenizer import TEXTS

    llm = llama_cpp.Llama(model_path=default_model_path(), vocab_only=True, verbose=False)
    texts = tokenizer_texts(TEXTS)
    ids = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__,
                               "model": Path(default_model_path()).name,
                               "texts": texts, "token_ids": ids}, ensure_ascii=False) + "\n")
    print(f"{len(texts)} texts -> {OUT}")


if __name__ == "__main__":
    main()
