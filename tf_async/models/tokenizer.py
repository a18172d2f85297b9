"""Tokenizer layer: a `tokenizers.Tokenizer` built from an HF folder or GGUF metadata, chat
templates rendered in a sandboxed Jinja2 environment, and a cheap streaming detokenizer.

Stop ids = tokenizer eos ∪ generation_config.json eos ∪ config.json eos (FORMATS.md §2);
GGUF: eos ∪ eot ∪ eom (§5).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from tf_async.errors import BadInputError, ModelFormatError

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's with combining marks (\p{M}) kept inside words (llama.cpp src/llama-vocab.cpp)
QWEN35_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's fallback list for pre == "default" (src/llama-vocab.cpp).
DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> regexes applied in sequence (each piece split further by the next).
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt2": (GPT2_REGEX,),
    "default": DEFAULT_REGEXES,
    "llama-bpe": (LLAMA3_REGEX,),
    "llama3": (LLAMA3_REGEX,),
    "qwen2": (QWEN2_REGEX,),
    "qwen35": (QWEN35_REGEX,),
    "smollm": (r"\p{N}", GPT2_REGEX),
}
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3"})  # llama.cpp: llama3 vocab ignores merges
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the other 68 to U+0100...."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(next_code_point)
            next_code_point += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_alphabet()
CHAR_TO_BYTE: dict[str, int] = {char: byte for byte, char in BYTE_TO_CHAR.items()}


def byte_level_token_bytes(token: str) -> bytes:
    """Bytes of one token as the ByteLevel decoder yields them: through the alphabet when every
    char is in it, else the token's own UTF-8 (added tokens such as 'a b')."""
    try:
        return bytes([CHAR_TO_BYTE[char] for char in token])
    except KeyError:
        return token.encode("utf-8")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and special ids.

    Build with `from_hf_folder` or `from_gguf_metadata`. `encode` always recognises special
    token strings (`<|im_end|>` -> its id); `encode_chat` renders the template then encodes.
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], pad_token_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None,
                 source: str = "tokenizer"):
        self._tok = hf_tokenizer
        self._source = source
        self._bos_id = bos_token_id
        self._eos_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._pad_id = pad_token_id
        self._add_bos = add_bos
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self._special_ids = frozenset(
            i for i, tok in hf_tokenizer.get_added_tokens_decoder().items() if tok.special)
        self._byte_level = isinstance(hf_tokenizer.decoder, decoders.ByteLevel)
        self._bytes_cache: dict[int, bytes] = {}

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json, config.json when present) from an HF checkpoint folder."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFormatError(f"{tok_file}: missing tokenizer.json")
        try:
            hf_tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ModelFormatError(f"{tok_file}: cannot parse tokenizer.json: {exc}") from exc
        tok_config = _read_json(folder / "tokenizer_config.json")
        bos_text = _token_content(tok_config.get("bos_token"))
        eos_text = _token_content(tok_config.get("eos_token"))
        pad_text = _token_content(tok_config.get("pad_token"))
        cfg_file = folder / "tokenizer_config.json"
        eos_ids = [_id_of(hf_tok, eos_text, cfg_file)] if eos_text else []
        for name in ("generation_config.json", "config.json"):
            eos_ids += _int_list(_read_json(folder / name).get("eos_token_id"), folder / name)
        pad_id = _id_of(hf_tok, pad_text, cfg_file) if pad_text else None
        bos_id = _id_of(hf_tok, bos_text, cfg_file) if bos_text else None
        add_bos = bool(tok_config.get("add_bos_token", False)) or _post_processor_adds_bos(
            hf_tok, bos_id)
        return cls(hf_tok, bos_token_id=bos_id, eos_token_ids=eos_ids, pad_token_id=pad_id,
                   add_bos=add_bos, chat_template=_hf_chat_template(folder, tok_config),
                   source=str(folder))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, source: str = "GGUF metadata"
                           ) -> Tokenizer:
        """Build the tokenizer from GGUF `tokenizer.*` keys (values as Python objects).

        Uses `tokenizer.huggingface.json` when present; otherwise rebuilds a byte-level BPE
        from tokens/merges/token_type and the pre-tokenizer named by `tokenizer.ggml.pre`.
        """
        model_type = _as_str(meta.get("tokenizer.ggml.model", ""))
        pre = _as_str(meta.get("tokenizer.ggml.pre", "default")) or "default"
        if "tokenizer.huggingface.json" in meta:
            try:
                hf_tok = tokenizers.Tokenizer.from_str(_as_str(meta["tokenizer.huggingface.json"]))
            except Exception as exc:
                raise ModelFormatError(f"{source}: bad tokenizer.huggingface.json: {exc}") from exc
        elif model_type != "gpt2":
            raise ModelFormatError(f"{source}: tokenizer.ggml.model {model_type!r} is not "
                                   "supported (only 'gpt2' byte-level BPE)")
        else:
            hf_tok = _gguf_bpe_tokenizer(meta, pre, source)
        eos_ids = [int(meta[f"tokenizer.ggml.{key}_token_id"]) for key in ("eos", "eot", "eom")
                   if f"tokenizer.ggml.{key}_token_id" in meta]
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        pad_id = meta.get("tokenizer.ggml.padding_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _IGNORE_MERGES_PRE))
        template = meta.get("tokenizer.chat_template")
        return cls(hf_tok, bos_token_id=None if bos_id is None else int(bos_id),
                   eos_token_ids=eos_ids, pad_token_id=None if pad_id is None else int(pad_id),
                   add_bos=add_bos, chat_template=None if template is None else _as_str(template),
                   source=source)

    # ---- properties -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Highest token id + 1 (model embeddings may be padded beyond it)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation."""
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_id

    @property
    def add_bos(self) -> bool:
        """Whether encode(add_special_tokens=True) / encode_chat put BOS first."""
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def is_byte_level(self) -> bool:
        """True when decoding is the GPT-2 byte-level map (the fast streaming path)."""
        return self._byte_level

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (offsets, pre-tokenizer inspection)."""
        return self._tok

    # ---- encode / decode --------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special token strings become their ids. With
        add_special_tokens, the post-processor runs and BOS is put first when add_bos."""
        if not isinstance(text, str):
            raise BadInputError(f"text to encode must be a string, got {type(text).__name__}",
                                param="prompt")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            ids = self._with_bos(ids)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids beyond the vocabulary decode to nothing, as in `tokenizers`."""
        try:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise BadInputError(f"token ids must be non-negative integers: {exc}",
                                param="tokens") from exc

    def token_text(self, token_id: int) -> str:
        """Text of one token alone (a partial UTF-8 byte shows as U+FFFD)."""
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token contributes to the decoded text (b'' for unknown ids)."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_token_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def stream(self, *, skip_special_tokens: bool = False) -> StreamDetokenizer:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id < 0:
            raise BadInputError(f"token id {token_id} is negative", param="tokens")
        if not self._byte_level:
            return self.decode([token_id]).encode("utf-8")
        token = self._tok.id_to_token(token_id)
        return b"" if token is None else byte_level_token_bytes(token)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self._add_bos and self._bos_id is not None and ids[:1] != [self._bos_id]:
            return [self._bos_id, *ids]
        return ids

    # ---- chat -------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render the chat template; extra kwargs (tools, enable_thinking, ...) reach it."""
        _check_messages(messages)
        template = self._template()
        context: dict[str, Any] = {
            "bos_token": self._token_str(self._bos_id),
            "eos_token": self._token_str(self._eos_ids[0] if self._eos_ids else None),
        }
        context.update(kwargs)
        context.update(messages=messages, add_generation_prompt=add_generation_prompt)
        try:
            return template.render(**context)
        except BadInputError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            raise BadInputError(f"chat template of {self._source} failed: {exc}",
                                param="messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Ids of the rendered chat; BOS is put first when add_bos and the template lacks it."""
        return self._with_bos(self.encode(self.apply_chat_template(messages, **kwargs)))

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            source = self._chat_template
            if source is None:
                if self._tok.token_to_id("<|im_start|>") is None:
                    raise BadInputError(f"{self._source} has no chat template",
                                        param="messages", code="no_chat_template")
                source = CHATML_TEMPLATE
            try:
                self._compiled = _jinja_env().from_string(source)
            except jinja2.TemplateError as exc:
                raise BadInputError(f"chat template of {self._source} is invalid: {exc}",
                                    param="messages") from exc
        return self._compiled

    def _token_str(self, token_id: int | None) -> str:
        token = None if token_id is None else self._tok.id_to_token(token_id)
        return token or ""


class StreamDetokenizer:
    """Incremental decode of one generated sequence: push() returns only complete characters,
    flush() the rest; concatenated they equal `tokenizer.decode(all_ids)`.

    Byte-level BPE: O(new tokens) per push (token bytes + an incremental UTF-8 decoder).
    Other tokenizers: vLLM-style prefix/read offsets, decoding a short window per push; exact
    unless the decoder rewrites earlier text after later tokens (e.g. ByteFallback on
    invalid UTF-8), and flush() reconciles against one full decode.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []  # generic path only
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_chars_emitted = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the newly complete text (maybe '')."""
        if self._tokenizer.is_byte_level:
            return self._push_bytes(ids)
        return self._push_generic(ids)

    def flush(self) -> str:
        """Return what is left, with U+FFFD for an incomplete UTF-8 tail."""
        if self._tokenizer.is_byte_level:
            return self._utf8.decode(b"", final=True)
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        rest = full[self._num_chars_emitted:]
        self._num_chars_emitted = len(full)
        return rest

    def _push_bytes(self, ids: Sequence[int]) -> str:
        tok = self._tokenizer
        if self._skip_special:
            data = b"".join(tok.token_bytes(i) for i in ids if not tok.is_special(i))
        else:
            data = b"".join([tok.token_bytes(i) for i in ids])
        return self._utf8.decode(data)

    def _push_generic(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        decode = self._tokenizer.decode
        skip = self._skip_special
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        window = decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        # A trailing U+FFFD may be an unfinished character: wait for more tokens.
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        text = window[len(prefix):]
        self._num_chars_emitted += len(text)
        return text


# ---- helpers ---------------------------------------------------------------------------------


def _gguf_bpe_tokenizer(meta: dict[str, Any], pre: str, source: str) -> tokenizers.Tokenizer:
    """Byte-level BPE from GGUF tokens/merges; CONTROL/USER_DEFINED become added tokens."""
    if pre not in PRE_TOKENIZER_REGEXES:
        raise ModelFormatError(f"{source}: unsupported tokenizer.ggml.pre {pre!r} "
                               f"(known: {sorted(PRE_TOKENIZER_REGEXES)})")
    tokens = [_as_str(t) for t in meta.get("tokenizer.ggml.tokens", [])]
    if not tokens:
        raise ModelFormatError(f"{source}: tokenizer.ggml.tokens is missing or empty")
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(token_types) != len(tokens):
        raise ModelFormatError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} "
                               f"entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # duplicates keep their first id
    merges = _gguf_merges(meta, source)
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    except Exception as exc:
        raise ModelFormatError(f"{source}: cannot build BPE from tokens/merges: {exc}") from exc
    hf_tok = tokenizers.Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated")
              for rx in PRE_TOKENIZER_REGEXES[pre]]
    hf_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf_tok.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(hf_tok, tokens, token_types)
    return hf_tok


def _add_gguf_added_tokens(hf_tok: tokenizers.Tokenizer, tokens: list[str],
                           token_types: list[int]) -> None:
    pairs = [(t, kind) for t, kind in zip(tokens, token_types, strict=True) if t]
    hf_tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, kind in pairs if kind == _TOKEN_CONTROL])
    hf_tok.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, kind in pairs if kind == _TOKEN_USER_DEFINED])


def _gguf_merges(meta: dict[str, Any], source: str) -> list[tuple[str, str]]:
    merges = []
    for rank, merge in enumerate(meta.get("tokenizer.ggml.merges", [])):
        parts = _as_str(merge).split(" ")
        if len(parts) != 2:
            raise ModelFormatError(f"{source}: tokenizer.ggml.merges[{rank}] = {merge!r} "
                                   "is not 'left right'")
        merges.append((parts[0], parts[1]))
    return merges


def _as_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes | bytearray) else str(value)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config tokens are a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _id_of(hf_tok: tokenizers.Tokenizer, token: str, path: Path) -> int:
    token_id = hf_tok.token_to_id(token)
    if token_id is None:
        raise ModelFormatError(f"{path}: token {token!r} is not in the vocabulary")
    return token_id


def _int_list(value: Any, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelFormatError(f"{path}: eos_token_id must be an int or a list of ints")
    return list(values)


def _post_processor_adds_bos(hf_tok: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    return bos_id is not None and hf_tok.encode("", add_special_tokens=True).ids[:1] == [bos_id]


def _hf_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config's (string or list of named templates)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadInputError("messages must be a non-empty list", param="messages")
    for pos, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadInputError(f"messages[{pos}] must be an object", param="messages")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise BadInputError(f"messages[{pos}].{key} must be a string", param="messages")


def _raise_exception(message: str) -> None:
    raise BadInputError(f"chat template: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would corrupt tool schemas.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
