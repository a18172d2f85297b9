"""A tiny byte-level BPE tokenizer (exactly TINY_VOCAB = 320 ids) for tests, as an HF
tokenizer.json dict, an HF folder, and the same tokenizer as GGUF metadata keys.

Ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|> (special), 3..258 the 256 byte tokens
(byte b has id 3 + b), 259..319 merges learned from SAMPLE_TEXT by a tiny BPE trainer.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import regex

from tests.tiny import TINY_VOCAB
from tf_async.models.tokenizer import BYTE_TO_CHAR, GPT2_REGEX

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTE_TOKENS = 256
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog is not there, and the fox is "
    "in the house with the other animals. There is a thing that they think of when they "
    "go to the store: it is the time of the year when the weather is nice and the sun is "
    "out. What is the capital of France? The capital of France is Paris. I would like "
    "to have some of that, and then we can talk about it in the morning. This is a test "
    "of the tokenizer, and it should be able to encode this sentence into tokens.\n"
)


def _pieces(text: str) -> Counter[tuple[str, ...]]:
    """Pre-token counts, each pre-token as a tuple of byte-level chars."""
    words = regex.findall(GPT2_REGEX, text)
    return Counter(tuple(BYTE_TO_CHAR[b] for b in word.encode("utf-8")) for word in words)


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    pos = 0
    while pos < len(word):
        if pos + 1 < len(word) and (word[pos], word[pos + 1]) == pair:
            out.append(word[pos] + word[pos + 1])
            pos += 2
        else:
            out.append(word[pos])
            pos += 1
    return tuple(out)


def _best_pair(words: Counter[tuple[str, ...]], known: set[str]) -> tuple[str, str]:
    counts: Counter[tuple[str, str]] = Counter()
    for word, freq in words.items():
        for pair in zip(word, word[1:], strict=False):
            if pair[0] + pair[1] not in known:
                counts[pair] += freq
    # Highest count, ties broken by the pair itself so the result is deterministic.
    return min(counts, key=lambda pair: (-counts[pair], pair))


@cache
def tiny_merges() -> tuple[tuple[str, str], ...]:
    """The TINY_VOCAB - 259 merges, in rank order, learned greedily from SAMPLE_TEXT."""
    words = _pieces(SAMPLE_TEXT)
    known = set(SPECIAL_TOKENS) | set(BYTE_TO_CHAR.values())
    merges: list[tuple[str, str]] = []
    while len(merges) < TINY_VOCAB - len(SPECIAL_TOKENS) - NUM_BYTE_TOKENS:
        pair = _best_pair(words, known)
        merges.append(pair)
        known.add(pair[0] + pair[1])
        words = Counter({_merge_word(w, pair): f for w, f in words.items()})
    return tuple(merges)


def tiny_tokens() -> list[str]:
    """id -> token string (byte-level alphabet), exactly TINY_VOCAB entries."""
    tokens = [*SPECIAL_TOKENS, *(BYTE_TO_CHAR[b] for b in range(NUM_BYTE_TOKENS))]
    tokens += [left + right for left, right in tiny_merges()]
    assert len(tokens) == len(set(tokens)) == TINY_VOCAB
    return tokens


def tiny_tokenizer_json() -> dict[str, Any]:
    """The tokenizer as an HF tokenizer.json dict (GPT-2 Split regex + ByteLevel)."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": GPT2_REGEX}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tiny_tokens())},
                  "merges": [list(pair) for pair in tiny_merges()]},
    }


def tiny_tokenizer_config() -> dict[str, Any]:
    return {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "add_bos_token": False, "chat_template": TINY_CHAT_TEMPLATE}


def write_tiny_tokenizer(folder: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `folder` (created if needed)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tiny_tokenizer_json(), ensure_ascii=False),
                                         encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(tiny_tokenizer_config()),
                                                encoding="utf-8")
    return path


def tiny_gguf_tokenizer_metadata() -> dict[str, Any]:
    """The same tokenizer as GGUF `tokenizer.*` keys (Python values) for a GGUF writer."""
    tokens = tiny_tokens()
    token_types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": [f"{left} {right}" for left, right in tiny_merges()],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TINY_CHAT_TEMPLATE,
    }
