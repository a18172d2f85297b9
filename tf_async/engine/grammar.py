"""Constrained decoding: a request's grammar as a token mask per logit row (llguidance).

Why llguidance (over xgrammar and outlines-core): it installs alone (no torch, no
transformers: xgrammar needs both), builds a matcher in under a millisecond for a JSON schema
(outlines-core compiles a whole regex index over the vocabulary up front, seconds for large
schemas), covers JSON Schema, Lark and regex with one API, and computes one row's mask in
~0.1-0.3 ms on the CPU (docs/PERFORMANCE.md).

The mask of a row is a function of the request's grammar and its own tokens so far only, so
a row's token never depends on other rows (concurrent == solo), and a drafted row is
verified under the same mask the plain row would get (drafted == plain).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from ..api_types import GrammarSpec
from ..errors import BadInputError
from ..models.tokenizer import Tokenizer
from .schema_depth import bounded_depth

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
else:
    JsonCompileOptions = dict

# One separator style and no free whitespace: a small model cannot loop on blanks.
JSON_STYLE: JsonCompileOptions = {
    "item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


MAX_CACHED = 64


class Grammars:
    """Compiles grammars for one tokenizer (its llguidance tokenizer made once, lazily)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: dict[GrammarSpec, llguidance.LLMatcher] = {}  # fresh matchers, LRU

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.hf_tokenizer.to_str(), n_vocab=self.tokenizer.vocab_size,
                eos_token=list(self.tokenizer.eos_token_ids))
        return self._ll_tokenizer

    def mask_for(self, spec: GrammarSpec) -> TokenMask:
        """A fresh mask state for one request; BadInputError names what is wrong. Compiled
        grammars are kept (the last MAX_CACHED): n choices and repeated schemas copy one."""
        matcher = self._compiled.pop(spec, None) or self._compile(spec)
        self._compiled[spec] = matcher  # most recently used last
        while len(self._compiled) > MAX_CACHED:
            self._compiled.pop(next(iter(self._compiled)))
        return TokenMask(matcher.deep_copy(), self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        for text in grammar_texts(spec):  # the last one's error is the user's schema's
            matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
            if not matcher.is_error():
                return matcher
        raise BadInputError(f"invalid {spec.kind.replace('_', ' ')}: {matcher.get_error()}",
                            param=spec.param, code="invalid_grammar")


def grammar_texts(spec: GrammarSpec) -> list[str]:
    """The llguidance grammars of a spec to try in order: a JSON schema with recursive
    definitions depth-bounded first, then as given (if the bound left it unsatisfiable)."""
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            bounded = bounded_depth(schema)
            tries = [bounded, schema] if bounded != schema else [schema]
            return [llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(bounded_numbers(s)), defaults=JSON_STYLE) for s in tries]
        if spec.kind == "lark":
            return [llguidance.LLMatcher.grammar_from_lark(spec.source)]
        return [llguidance.LLMatcher.grammar_from_regex(spec.source)]
    except ValueError as exc:
        raise BadInputError(f"invalid {spec.kind.replace('_', ' ')}: {exc}", param=spec.param,
                            code="invalid_grammar") from None


class TokenMask:
    """One request's grammar state (owned by the engine thread once submitted)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = np.asarray(eos_ids, np.int64)

    def allowed(self) -> np.ndarray:
        """-> [V] bool: the tokens the grammar allows next (EOS once it is complete)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, count=self.vocab_size, bitorder="little").view(bool)
        if not allowed.any():  # a failed or finished grammar: only the end remains
            allowed[self.eos_ids] = True
        return allowed

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """logits: [V'] (V' >= V: padded rows too) -> a float32 copy with the tokens the
        grammar forbids at -inf."""
        x = np.full(len(logits), -np.inf, np.float32)
        allowed = self.allowed()
        np.copyto(x[: len(allowed)], logits[: len(allowed)], where=allowed, casting="unsafe")
        return x

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())


NUMBER_BOUNDS = {"minimum": -1e15, "maximum": 1e15}
DECIMALS = {"multipleOf": 1e-6}
MAX_STRING_CHARS = 100  # a string's length where the schema sets no limit of its own
_STRING_LIMITS = ("maxLength", "enum", "const", "pattern")
_OBJECT_SHAPES = ("properties", "additionalProperties", "patternProperties", "$ref", "anyOf",
                  "oneOf", "allOf", "enum", "const")
_SCALAR = {"anyOf": [{"type": "string", "maxLength": MAX_STRING_CHARS},
                     {"type": "number", **NUMBER_BOUNDS, **DECIMALS}, {"type": "boolean"},
                     {"type": "null"}]}
_FLAT = {"anyOf": [*_SCALAR["anyOf"], {"type": "array", "items": _SCALAR, "maxItems": 16},
                   {"type": "object", "additionalProperties": _SCALAR, "maxProperties": 16}]}
FREE_OBJECT = {"additionalProperties": _FLAT, "maxProperties": 16}


def bounded_numbers(schema: Any) -> Any:
    """The schema with numbers kept to |x| <= 1e15 and 6 decimals, and strings to
    MAX_STRING_CHARS, where it sets no bounds of its own: every value still matches the
    schema, and a small model can no longer write digits or words forever (its usual
    failure under a JSON grammar)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_numbers(value) for key, value in schema.items()}
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "number" in kinds or "integer" in kinds:
        for key, value in NUMBER_BOUNDS.items():
            if key not in out and f"exclusive{key.title()}" not in out:
                out[key] = value
    if "number" in kinds and "multipleOf" not in out:
        out |= DECIMALS
    if "string" in kinds and not any(key in out for key in _STRING_LIMITS):
        out["maxLength"] = MAX_STRING_CHARS
    if kinds == ["object"] and not any(key in out for key in _OBJECT_SHAPES):
        out |= FREE_OBJECT  # json_object: any object, two levels deep, bounded
    return out
