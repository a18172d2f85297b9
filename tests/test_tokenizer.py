"""Tokenizer layer: HF folder vs GGUF metadata, the default SmolLM2 GGUF vocabulary, chat
templates, the streaming detokenizer and bad inputs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tests.tiny import TINY_VOCAB
from tests.tiny_tokenizer import (
    tiny_gguf_tokenizer_metadata,
    tiny_tokenizer_json,
    write_tiny_tokenizer,
)
from tf_async.errors import BadInputError, ModelFormatError
from tf_async.models.default import default_model_path
from tf_async.models.tokenizer import StreamDetokenizer, Tokenizer

TEXTS = [
    "", "Hello, world!", "The capital of France is Paris.", "I'm sure they'll say we've won",
    "digits 0 12 345 6789 3.14159 1,000,000", "emoji 😀👍🏽 and 🇫🇷 flags", "中文字符 日本語 한국어",
    "tabs\tand\n\nnewlines\r\n  indented   spaces   ", "   leading and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b<|im_end|><|im_start|>",
    "Ünïcödé çàfé naïve — “quotes” … ‘x’", "code: def f(x):\n    return x ** 2  # sq",
    "mixed123abc___---===>>>", "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
]
USER_MSG = [{"role": "user", "content": "What is the capital of France?"}]


def gguf_metadata(path: Path) -> dict[str, Any]:
    """GGUF key/values as Python values (strings, ints, floats, bools, lists)."""
    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_hf_folder(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tiny_gguf() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    """Found the way the engine finds it; a missing default model fails (never skips) the tests."""
    return Path(default_model_path())


@pytest.fixture(scope="module")
def smol_meta(default_gguf: Path) -> dict[str, Any]:
    return gguf_metadata(default_gguf)


@pytest.fixture(scope="module")
def smol(smol_meta: dict[str, Any], default_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_meta, source=str(default_gguf))


# ---- tiny tokenizer: HF folder == GGUF metadata -------------------------------------------------


def test_tiny_tokenizer_has_exact_layout(tiny_hf: Tokenizer) -> None:
    vocab = tiny_tokenizer_json()["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(TINY_VOCAB))
    assert [tiny_hf.token_text(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>",
                                                         "<|im_end|>"]
    assert tiny_hf.token_bytes(3 + ord("A")) == b"A"
    assert tiny_hf.token_bytes(3 + 0xF0) == b"\xf0"
    assert tiny_hf.vocab_size == TINY_VOCAB
    assert (tiny_hf.bos_token_id, tiny_hf.eos_token_ids, tiny_hf.pad_token_id) == (1, (2,), 0)
    assert not tiny_hf.add_bos and tiny_hf.is_byte_level


def test_tiny_hf_and_gguf_give_identical_ids(tiny_hf: Tokenizer, tiny_gguf: Tokenizer) -> None:
    assert tiny_gguf.vocab_size == TINY_VOCAB
    assert (tiny_gguf.bos_token_id, tiny_gguf.eos_token_ids) == (1, (2,))
    for text in TEXTS:
        ids = tiny_hf.encode(text)
        assert tiny_gguf.encode(text) == ids, text
        assert tiny_hf.decode(ids) == text
    assert len(tiny_hf.encode("The capital of France")) < len("The capital of France")  # merges
    assert tiny_hf.encode("<|im_start|>x<|im_end|>") == [1, 3 + ord("x"), 2]


def test_tiny_chat_template_from_both_sources(tiny_hf: Tokenizer, tiny_gguf: Tokenizer) -> None:
    expected = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_hf.apply_chat_template(USER_MSG) == expected
    assert tiny_gguf.apply_chat_template(USER_MSG) == expected
    assert tiny_hf.apply_chat_template(USER_MSG, add_generation_prompt=False) == expected[:-22]
    ids = tiny_hf.encode_chat(USER_MSG)
    assert ids == tiny_hf.encode(expected) and ids[0] == 1 and ids.count(2) == 1


# ---- default model (SmolLM2 GGUF, pre 'smollm') ---------------------------------------------------


def test_default_model_round_trip_and_special_ids(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.eos_token_ids == (2,) and smol.bos_token_id == 1 and not smol.add_bos
    for text in TEXTS:
        assert smol.decode(smol.encode(text)) == text, text
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_end|>") == [2]
    assert smol.encode("Hello world") == [19556, 905]
    assert smol.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


def test_default_model_splits_digits_one_per_token(smol: Tokenizer) -> None:
    ids = smol.encode("year 2024: 1234567890")
    digit_pieces = [smol.token_text(i) for i in ids if smol.token_text(i).strip().isdigit()]
    assert digit_pieces == list("20241234567890")
    assert [smol.token_text(i) for i in smol.encode("42")] == ["4", "2"]


def test_default_model_chat_template(smol: Tokenizer) -> None:
    text = smol.apply_chat_template(USER_MSG)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *USER_MSG]
    assert smol.apply_chat_template(with_system).startswith("<|im_start|>system\nBe brief.")
    ids = smol.encode_chat(USER_MSG)
    assert ids[0] == 1 and smol.decode(ids) == text


def test_pre_tokenizers_split_as_llama_cpp_lists() -> None:
    text = "I'M 12345 abc!!\n\n  x"
    expect = {
        "gpt2": ["I", "'", "M", "Ġ12345", "Ġabc", "!!", "ĊĊĠ", "Ġx"],
        "smollm": ["I", "'", "M", "Ġ", "1", "2", "3", "4", "5", "Ġabc", "!!", "ĊĊĠ", "Ġx"],
        "qwen2": ["I", "'M", "Ġ", "1", "2", "3", "4", "5", "Ġabc", "!!ĊĊ", "Ġ", "Ġx"],
        "llama-bpe": ["I", "'M", "Ġ", "123", "45", "Ġabc", "!!ĊĊ", "Ġ", "Ġx"],
        "default": ["I", "'", "M", "Ġ", "123", "45", "Ġabc", "!!", "ĊĊĠ", "Ġx"],
    }
    for pre, pieces in expect.items():
        meta = {**tiny_gguf_tokenizer_metadata(), "tokenizer.ggml.pre": pre}
        tok = Tokenizer.from_gguf_metadata(meta)
        got = [p for p, _ in tok.hf_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        assert got == pieces, pre


def test_matches_llama_cpp_token_ids(smol: Tokenizer) -> None:
    """llama.cpp's ids for 515 texts, recorded by tests/record_llama_cpp_tokens.py."""
    from tests.record_llama_cpp_tokens import OUT, tokenizer_texts

    recorded = json.loads(OUT.read_text())
    assert recorded["texts"] == tokenizer_texts(TEXTS)  # re-record when the texts change
    for text, theirs in zip(recorded["texts"], recorded["token_ids"], strict=True):
        assert smol.encode(text) == theirs, text


# ---- streaming detokenizer ---------------------------------------------------------------------


def _stream_all(stream: StreamDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Push `ids` in random chunks (including empty ones); the last element is flush()."""
    out, pos = [], 0
    while pos < len(ids):
        step = rng.choice([0, 1, 1, 1, 2, 3, 7])
        out.append(stream.push(ids[pos:pos + step]))
        pos += step
    return [*out, stream.flush()]


def _random_ids(rng: random.Random, tok: Tokenizer, num_ids: int) -> list[int]:
    """Mostly byte tokens (so UTF-8 characters split and break), some merges and specials."""
    ids: list[int] = []
    while len(ids) < num_ids:
        roll = rng.random()
        if roll < 0.3:
            ids += tok.encode(rng.choice(["😀", "中", "é", "👍🏽", " ok", "\n"]))
        elif roll < 0.6:
            ids.append(3 + rng.randrange(256))  # any byte, also lone continuation bytes
        elif roll < 0.9:
            ids.append(rng.randrange(tok.vocab_size))
        else:
            ids.append(rng.choice([0, 1, 2, tok.vocab_size + 5]))  # specials, unknown id
    return ids


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_equals_decode_for_any_split(tiny_hf: Tokenizer, skip_special: bool) -> None:
    for seed in range(300):
        rng = random.Random(seed)
        ids = _random_ids(rng, tiny_hf, rng.randint(0, 40))
        pieces = _stream_all(tiny_hf.stream(skip_special_tokens=skip_special), ids, rng)
        assert "".join(pieces) == tiny_hf.decode(ids, skip_special_tokens=skip_special), seed


def test_stream_on_default_model_matches_decode(smol: Tokenizer) -> None:
    for seed in range(100):
        rng = random.Random(seed)
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randint(1, 60))]
        ids += smol.encode("naïve 😀👍🏽 中文")
        rng.shuffle(ids)
        assert "".join(_stream_all(smol.stream(), ids, rng)) == smol.decode(ids), seed


def test_stream_holds_back_partial_characters(tiny_hf: Tokenizer) -> None:
    stream = tiny_hf.stream()
    emoji_ids = [3 + b for b in "😀".encode()]
    assert [stream.push([i]) for i in emoji_ids] == ["", "", "", "😀"]
    assert stream.push([3 + 0xE4, 3 + 0xB8]) == ""  # first two bytes of 中
    assert stream.flush() == "\ufffd"


def _sentencepiece_like() -> Tokenizer:
    """A non-byte-level tokenizer (Metaspace + byte fallback) for the generic stream path."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab", "é", "▁c"]:
        vocab[piece] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"),
                                        ("▁", "c")], unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(hf, bos_token_id=1, eos_token_ids=[2])


def test_generic_stream_path_equals_decode() -> None:
    tok = _sentencepiece_like()
    assert not tok.is_byte_level
    words = ["ab", "a", "b", "c", "é", "😀", "中文", "abc", "👍🏽"]
    for seed in range(200):
        rng = random.Random(seed)
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text)
        assert "".join(_stream_all(tok.stream(), ids, rng)) == tok.decode(ids) == text, seed


# ---- HF folder details ---------------------------------------------------------------------------


def test_hf_folder_prefers_jinja_file_and_merges_stop_ids(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.eos_token_ids == (2, 0)
    assert tok.apply_chat_template(USER_MSG) == "<|im_start|>What is the capital of France?"


def test_hf_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ModelFormatError, match="<nope>"):
        Tokenizer.from_hf_folder(tmp_path)


def test_gguf_huggingface_json_is_used() -> None:
    meta = {"tokenizer.ggml.model": "whatever", "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.huggingface.json": json.dumps(tiny_tokenizer_json())}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("<|im_end|> the") == [2, tok.encode(" the")[0]]
    assert tok.eos_token_ids == (2,)


# ---- bad inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [
    "hi", {"role": "user", "content": "hi"}, [], [["user", "hi"]], [{"content": "hi"}],
    [{"role": "user"}], [{"role": "user", "content": None}], [{"role": 1, "content": "x"}],
])
def test_bad_messages_are_rejected(tiny_hf: Tokenizer, messages: Any) -> None:
    with pytest.raises(BadInputError) as info:
        tiny_hf.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_template_errors_become_bad_input(tiny_gguf: Tokenizer) -> None:
    meta = tiny_gguf_tokenizer_metadata()
    raising = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need system') }}{% endif %}"
    for template, pattern in [(raising, "need system"), ("{% for %}", "invalid"),
                              ("{{ messages[5]['content'] }}", "failed"),
                              ("{{ ''.__class__.__mro__ }}", "unsafe|failed")]:
        tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": template})
        with pytest.raises(BadInputError, match=pattern):
            tok.apply_chat_template(USER_MSG)


def test_missing_template_falls_back_to_chatml_only_with_im_start() -> None:
    meta = dict(tiny_gguf_tokenizer_metadata())
    del meta["tokenizer.chat_template"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.apply_chat_template(USER_MSG).endswith("<|im_end|>\n<|im_start|>assistant\n")
    meta["tokenizer.ggml.tokens"] = [t.replace("im_start", "im_begin")
                                     for t in meta["tokenizer.ggml.tokens"]]
    with pytest.raises(BadInputError, match="no chat template"):
        Tokenizer.from_gguf_metadata(meta).apply_chat_template(USER_MSG)


def test_template_kwargs_and_helpers(tiny_gguf: Tokenizer) -> None:
    template = ("{{ strftime_now('%Y') | length }}|{{ enable_thinking }}|{{ tools | tojson }}"
                "|{{ eos_token }}")
    meta = {**tiny_gguf_tokenizer_metadata(), "tokenizer.chat_template": template}
    tok = Tokenizer.from_gguf_metadata(meta)
    out = tok.apply_chat_template(USER_MSG, enable_thinking=False, tools=[{"a": "<é>"}])
    assert out == '4|False|[{"a": "<é>"}]|<|im_end|>'


def test_unknown_gguf_tokenizer_model_or_pre() -> None:
    meta = tiny_gguf_tokenizer_metadata()
    with pytest.raises(ModelFormatError, match="'llama'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelFormatError, match="'martian'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "martian"})
    with pytest.raises(ModelFormatError, match="merges"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.merges": ["a b c"]})


def test_encode_decode_reject_wrong_types(tiny_hf: Tokenizer) -> None:
    with pytest.raises(BadInputError):
        tiny_hf.encode(["not", "text"])  # type: ignore[arg-type]
    with pytest.raises(BadInputError):
        tiny_hf.decode([-1])
