"""The grammar of a reply that must call tools (tool_choice "required" or a named function):
calls only, each valid against its function's parameters, in the format the model writes.

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls joined by "\\n";
- json (Llama 3.x): one `{"name": ..., "parameters": {...}}`;
- xml (Qwen3.5), as its chat template writes a call:

      <tool_call>
      <function=NAME>
      <parameter=KEY>
      VALUE
      </parameter>
      </function>
      </tool_call>

  parameters in the schema's order (the required ones always, the others may be left out).
  A string parameter's VALUE is its text (one line, no `</`; an enum's values as they are;
  with a `format`, a JSON string the parser decodes); any other VALUE is JSON.

A forced reply has at most one call per tool, and MAX_FORCED_CALLS at most (small models
repeat a call forever otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import llguidance

from ..api_types import GrammarSpec
from ..engine.grammar import JSON_STYLE, MAX_STRING_CHARS, bounded_numbers
from ..engine.schema_depth import DEF_KEYS, bounded_depth
from .tools import TOOL_CLOSE, TOOL_OPEN

MAX_FORCED_CALLS = 8
# one line of text without "</" (the lexer ends the value at the newline before </parameter>)
TEXT_LINE = r"/([^<\n]|<[^\/\n<])*/"


def tool_grammar(tools: list[dict[str, Any]], choice: str | None, *, parallel: bool, fmt: str,
                 tags: tuple[str, str]) -> GrammarSpec | None:
    """None unless the reply must call (`choice` "required" or a name). `tags`: how the
    grammar spells <tool_call> and </tool_call> (a quoted string, or `<[id]>` for a special
    token)."""
    if choice is None:
        return None
    if choice != "required":
        tools = [t for t in tools if t["function"]["name"] == choice]
    functions = [t["function"] for t in tools]
    if fmt == "json":
        return GrammarSpec("lark", f"start: %json {_calls_schema(functions, 'parameters')}", "tools")
    body = _xml_rules(functions) if fmt == "xml" else [
        f"body: %json {_calls_schema(functions, 'arguments')}"]
    max_calls = min(len(tools), MAX_FORCED_CALLS) if parallel else 1
    rules = ["start: call" + _more_calls(max_calls), f'call: {tags[0]} "\\n" body "\\n" {tags[1]}']
    return GrammarSpec("lark", "\n".join(rules + body) + "\n", "tools")


def _more_calls(max_calls: int) -> str:
    """Up to max_calls - 1 further calls."""
    return "" if max_calls <= 1 else f' ("\\n" call{_more_calls(max_calls - 1)})?'


def _calls_schema(functions: list[dict[str, Any]], key: str) -> str:
    """One schema for a call of any of the functions; their parameters' definitions move to
    its root, where their `$ref`s point."""
    root: dict[str, Any] = {"anyOf": [_call_schema(f, key) for f in functions],
                            "x-guidance": JSON_STYLE}
    for defs_key in DEF_KEYS:
        defs = {name: body for f in functions
                for name, body in (closed_parameters(f).get(defs_key) or {}).items()}
        if defs:
            root[defs_key] = defs
    return json.dumps(bounded_numbers(bounded_depth(root)))


def _call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             key: closed_parameters(function)},
            "required": ["name", key], "additionalProperties": False}


def closed_parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters schema, where each object that names its properties and
    says nothing of others gets only those (still valid: small models otherwise wander into
    keys of their own)."""
    return _closed(function.get("parameters") or {"type": "object", "properties": {}})


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) for key, value in schema.items()}
    if isinstance(out.get("properties"), dict) and not (
            {"additionalProperties", "patternProperties"} & set(out)):
        out["additionalProperties"] = False
    return out


# ---------------------------------------------------------------- xml (Qwen3.5)


def _xml_rules(functions: list[dict[str, Any]]) -> list[str]:
    rules = ["body: " + " | ".join(f"f{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        parameters = closed_parameters(function)
        required = set(parameters.get("required") or ())
        parts = []
        for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule = f"f{i}p{j}"
            parts.append(rule if key in required else f"{rule}?")
            rules.append(f'{rule}: {_lit(f"<parameter={key}>")} "\\n" {rule}v "\\n" '
                         '"</parameter>" "\\n"')
            rules += _xml_value(_with_defs(schema, parameters), f"{rule}v")
        rules.append(f'f{i}: {_lit("<function=" + function["name"] + ">")} "\\n" '
                     f'{" ".join(parts)} "</function>"')
    return rules


def _xml_value(schema: Any, rule: str) -> list[str]:
    """The rules of one parameter's value (`rule`; a terminal RULE where it is text)."""
    choices = string_choices(schema)
    if choices:
        return [f"{rule}: " + " | ".join(_lit(value) for value in choices)]
    if is_text(schema) and "format" not in schema:
        return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {_text_regex(schema)}"]
    bounded = bounded_numbers(bounded_depth({**schema, "x-guidance": JSON_STYLE}))
    return [f"{rule}: %json {json.dumps(bounded)}"]


def _text_regex(schema: dict[str, Any]) -> str:
    """A string parameter's text: one line without `</`, its length bounds, its pattern."""
    low, high = schema.get("minLength", 0), schema.get("maxLength", MAX_STRING_CHARS)
    regex = f"{TEXT_LINE} & /.{{{low},{high}}}/"
    if "pattern" not in schema:
        return regex
    pattern = schema["pattern"]  # JSON Schema: found anywhere unless anchored
    head = "" if pattern.startswith("^") else ".*"
    tail = "" if pattern.endswith("$") and not pattern.endswith("\\$") else ".*"
    inner = pattern.removeprefix("^")
    inner = llguidance.regex_to_lark(inner[: len(inner) - 1] if not tail else inner, "dw")
    return f"{regex} & /{head}({inner}){tail}/"  # "dw": \\d and \\w as JSON Schema reads them


def string_choices(schema: Any) -> list[str]:
    """An enum or const of strings only: its values (else [])."""
    if not isinstance(schema, dict):
        return []
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else []
    return values if values and all(isinstance(v, str) and v for v in values) else []


def is_text(schema: Any) -> bool:
    """Is every value of this parameter a string (the xml format writes it as text)?"""
    return isinstance(schema, dict) and (
        schema.get("type") in ("string", ["string"]) or bool(string_choices(schema)))


def text_parameters(tools: list[dict[str, Any]]) -> dict[str, frozenset[str]]:
    """Function name -> its parameters whose values the xml format writes as text."""
    return {t["function"]["name"]: frozenset(
        key for key, schema in ((t["function"].get("parameters") or {}).get("properties") or {}).items()
        if is_text(schema)) for t in tools}


def _with_defs(schema: Any, parameters: dict[str, Any]) -> Any:
    """A property's schema with the definitions its `$ref`s point to (they live at the
    parameters' root)."""
    defs = {key: parameters[key] for key in DEF_KEYS if key in parameters}
    return {**schema, **defs} if defs and isinstance(schema, dict) else schema


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tag_terms(encode: Callable[[str], list[int]], is_special: Callable[[int], bool]) -> tuple[str, str]:
    """The grammar's spelling of <tool_call> / </tool_call>: the special token where the
    vocabulary has one (Qwen), else the text."""
    terms = []
    for tag in (TOOL_OPEN, TOOL_CLOSE):
        ids = encode(tag)
        terms.append(f"<[{ids[0]}]>" if len(ids) == 1 and is_special(ids[0]) else json.dumps(tag))
    return terms[0], terms[1]
