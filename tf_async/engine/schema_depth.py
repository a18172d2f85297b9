"""A depth bound for recursive JSON schemas (a tree node whose children are tree nodes).

A small model under a recursive grammar can nest forever (each level opens the next before
closing anything). `bounded_depth` unrolls every recursive definition MAX_NESTING levels:

    root --$ref--> node@0 --$ref--> node@1 ... node@(MAX_NESTING-1) --$ref--> false

so the deepest copy can only end the nesting (an optional property is left out, an array
is empty). Every value the bounded schema accepts, the original accepts too. A schema that
cannot end its nesting at all becomes unsatisfiable; the caller then keeps the original.
"""

from __future__ import annotations

from typing import Any

MAX_NESTING = 4  # levels of one recursive definition inside itself
DEF_KEYS = ("$defs", "definitions")
ROOT = "#"


def bounded_depth(schema: Any) -> Any:
    """The schema with each recursive definition unrolled MAX_NESTING levels (unchanged
    when it has none)."""
    if not isinstance(schema, dict):
        return schema
    schema = _lift_root(schema)
    defs = _definitions(schema)
    recursive = {ref for ref in defs if ref in _reachable(ref, defs)}
    if not recursive:
        return schema
    copies = {_copy_name(ref, level): _rewrite(defs[ref], _level(recursive, level + 1))
              for ref in recursive for level in range(MAX_NESTING)}
    out = _rewrite({k: v for k, v in schema.items() if k not in DEF_KEYS}, _level(recursive, 0))
    for key in DEF_KEYS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _rewrite(body, _level(recursive, 0))
                        for name, body in schema[key].items()}
    out["$defs"] = {**out.get("$defs", {}), **copies}
    return out


def _definitions(schema: dict[str, Any]) -> dict[str, Any]:
    """$ref string -> the schema it names: `#/$defs/NAME`, `#/definitions/NAME`."""
    defs: dict[str, Any] = {}
    for key in DEF_KEYS:
        for name, body in (schema.get(key) or {}).items():
            defs[f"#/{key}/{_escape(name)}"] = body
    return defs


def _lift_root(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema whose parts refer to the root (`#`) as one whose root is a definition
    like the others (so it is unrolled as they are)."""
    if ROOT not in _refs(schema) and not any(ROOT in _refs(body) for key in DEF_KEYS
                                             for body in (schema.get(key) or {}).values()):
        return schema
    name = "root"
    while name in (schema.get("$defs") or {}):
        name += "_"
    ref = f"#/$defs/{name}"
    body = _rewrite({k: v for k, v in schema.items() if k not in DEF_KEYS}, {ROOT: ref})
    out = {key: {n: _rewrite(b, {ROOT: ref}) for n, b in schema[key].items()}
           for key in DEF_KEYS if isinstance(schema.get(key), dict)}
    out["$defs"] = {**out.get("$defs", {}), name: body}
    return {"$defs": out.pop("$defs"), **out, "$ref": ref}


def _reachable(start: str, defs: dict[str, Any]) -> set[str]:
    """The definitions reached from `start`'s body by one or more $refs."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for ref in _refs(defs[todo.pop()]):
            if ref in defs and ref not in seen:
                seen.add(ref)
                todo.append(ref)
    return seen


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node))
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
    return found.union(*(_refs(value) for key, value in node.items() if key not in DEF_KEYS))


def _rewrite(node: Any, refs: dict[str, str | bool]) -> Any:
    """`node` with each $ref in `refs` replaced: by another $ref, or by `false` (a schema
    nothing matches)."""
    if isinstance(node, list):
        return [_rewrite(item, refs) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in refs:
        new = refs[ref]
        if isinstance(new, bool):
            return new
        node = {**node, "$ref": new}
    return {key: value if key in DEF_KEYS or key == "$ref" else _rewrite(value, refs)
            for key, value in node.items()}


def _level(recursive: set[str], level: int) -> dict[str, str | bool]:
    """Where the recursive $refs of a copy at `level - 1` point: the copies at `level`."""
    return {ref: f"#/$defs/{_copy_name(ref, level)}" if level < MAX_NESTING else False
            for ref in recursive}


def _copy_name(ref: str, level: int) -> str:
    return f"depth{level}" + ref.removeprefix("#").replace("/", "_").replace("~", "_")


def _escape(name: str) -> str:  # a JSON pointer token
    return name.replace("~", "~0").replace("/", "~1")
