"""JSON Schema -> GBNF for tool calls, widened where decoding cannot enforce the schema.

The grammar only steers decoding; the schema itself is enforced afterwards (jsonschema-rs),
so the grammar must accept every valid value: whatever llama.cpp's converter cannot enforce
is widened to the nearest thing it can, never narrowed. The one deliberate exception, as in
common practice: an object that lists `properties` and says nothing of others accepts only
the listed ones. docs/TOOLS.md lists the rules with an example for each.
"""

from __future__ import annotations

from typing import Any

import orjson
from llama_cpp.llama_grammar import SchemaConverter

# Formats the converter turns into exact rules; any other format is a plain string.
ENFORCED_FORMATS = frozenset(
    {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
)
ANY = {"type": ["object", "array", "string", "number", "boolean", "null"]}
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def _anchored(pattern: str) -> str:
    """JSON Schema patterns match anywhere in the value; the converter wants ^...$ (whole).
    With `dotall`, the added `.*` also spans newlines, so nothing valid is shut out."""
    body = pattern[1:] if pattern.startswith("^") else ".*" + pattern
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        body = body[:-1]
    else:
        body += ".*"
    return "^" + body + "$"


def widen(schema: Any, patterns: bool = True) -> dict[str, Any]:
    """The schema reduced to what the converter enforces exactly (see module doc)."""
    if not isinstance(schema, dict):
        return dict(ANY)  # true / false / junk: any value (validation decides)
    out: dict[str, Any] = {}
    for key in ("type", "enum", "const", "required", "minItems", "maxItems", "$ref"):
        if key in schema:
            out[key] = schema[key]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: widen(v, patterns) for k, v in schema[key].items()}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out[key] = [widen(v, patterns) for v in schema[key]]
    items = schema.get("items")
    if isinstance(items, dict):
        out["items"] = widen(items, patterns)
    elif "prefixItems" in schema or isinstance(items, list):
        out["type"] = "array"  # tuples: any array (the converter forbids extra items)
    add = schema.get("additionalProperties")
    if isinstance(add, dict):
        out["additionalProperties"] = widen(add, patterns)
    elif isinstance(add, bool):
        out["additionalProperties"] = add
    if "patternProperties" in schema:
        out["additionalProperties"] = True  # keys matching a pattern are allowed too
    if "allOf" in schema or "not" in schema or "if" in schema:
        return dict(ANY) if "type" not in out else {"type": out["type"]}
    if out.get("type") == "string" or "type" not in out:
        fmt = schema.get("format")
        if fmt in ENFORCED_FORMATS:
            out["format"] = fmt
        elif patterns and isinstance(schema.get("pattern"), str):
            out["pattern"] = _anchored(schema["pattern"])
        elif "pattern" not in schema:
            for key in ("minLength", "maxLength"):
                if key in schema:
                    out[key] = schema[key]
    if not any(
        k in out
        for k in (
            "type",
            "enum",
            "const",
            "$ref",
            "anyOf",
            "oneOf",
            "properties",
            "items",
            "pattern",
            "format",
        )
    ):
        return dict(ANY) | (
            {"additionalProperties": out["additionalProperties"]}
            if "additionalProperties" in out
            else {}
        )
    return out


def _converter() -> Any:
    # dotall: a `.` in a pattern (and the `.*` that unanchoring adds) may span newlines.
    return SchemaConverter(
        prop_order={},
        allow_fetch=False,  # type: ignore[no-untyped-call]
        dotall=True,
        raw_pattern=False,
    )


def _as_object(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments are always an object, whatever else the schema leaves open."""
    if schema.get("type") == ANY["type"]:
        return {**schema, "type": "object"}
    return schema


def _args_rule(conv: Any, schema: dict[str, Any], name: str, url: str) -> str:
    for patterns in (True, False):  # a pattern the converter cannot translate: plain string
        try:
            trial = _converter()
            resolved = trial.resolve_refs(_as_object(widen(schema, patterns)), url)
            trial.visit(resolved, name)
        except Exception:
            continue
        resolved = conv.resolve_refs(_as_object(widen(schema, patterns)), url)
        return str(conv.visit(resolved, name))
    return str(conv.visit({"type": "object"}, name))


def calls_grammar(tools: list[tuple[str, dict[str, Any]]], many: bool) -> str:
    """GBNF for one call (or several, `many`) of the given tools, in the JSON call form."""
    conv = _converter()
    calls = []
    for i, (name, schema) in enumerate(tools):
        args = _args_rule(conv, schema, f"tool{i}-args", f"tool{i}")
        head = conv._format_literal('{"name": ' + orjson.dumps(name).decode() + ', "arguments": ')
        calls.append(conv._add_rule(f"tool{i}-call", f'{head} {args} "}}"'))
    conv._add_rule("call", '"<tool_call>" ( ' + " | ".join(calls) + ' ) "</tool_call>"')
    conv._add_rule("root", 'call ( "\\n" call )*' if many else "call")
    return str(conv.format_grammar())
