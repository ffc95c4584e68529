"""Tool calling: a request's tools checked at intake, the calls parsed out of the output.

`plan_tools` reads `tools`/`tool_choice`/`parallel_tool_calls` into a `ToolPlan`: each tool's
schema compiled by jsonschema-rs (the check every call must pass before a client sees it),
`strict` tools refused unless closed, and the GBNF grammar that constrains decoding (lazily
from the first `<tool_call>` for `auto`; from the first token for `required` and a named
tool). `CallSplitter` separates calls from text as the content streams, holding back a
partial `<tool_call>` marker so no markup leaks into `content`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
import orjson

from narwhal.engine.generation import held
from narwhal.engine.schema_check import check_schema
from narwhal.engine.schema_grammar import calls_grammar
from narwhal.errors import invalid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# llama.cpp's lazy grammar starts constraining where this pattern's first group matches.
TRIGGER = r"[\s\S]*?(<tool_call>)[\s\S]*"


@dataclass
class Tool:
    name: str
    function: dict[str, Any]  # as the client wrote it (what the model is shown)
    schema: dict[str, Any]
    validator: Any

    def param_value(self, key: str, text: str) -> Any:
        """A function-form parameter's value: text where the schema says string, else JSON.

        A parameter that may be a string or something else (`["string", "integer"]`) is the
        JSON value when the text parses to one of the other admitted types, text otherwise:
        `123` is the number for `["string", "integer"]` and the text for `["string", "null"]`.
        """
        props = self.schema.get("properties")
        prop = props.get(key) if isinstance(props, dict) else None
        types = admitted_types(prop, self.schema) if prop is not None else None
        if types is not None and "string" in types and types <= {"string", "null"}:
            return text
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return text
        if types is None or "string" not in types or _json_type(value) & types:
            return value
        return text


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def admitted_types(schema: Any, root: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a schema admits, following local `$ref`s, unions and `anyOf`/`oneOf`/
    `allOf`; None when it does not say (any type)."""
    if not isinstance(schema, dict) or depth > 32:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return admitted_types(_resolve(ref, root), root, depth + 1)
    if "const" in schema:
        return _json_type(schema["const"])
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return set().union(*(_json_type(v) for v in enum))
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            found = [admitted_types(b, root, depth + 1) for b in branches]
            if any(f is None for f in found):
                return None
            return set().union(*(f for f in found if f is not None))
    branches = schema.get("allOf")
    if isinstance(branches, list):
        known = [f for b in branches if (f := admitted_types(b, root, depth + 1)) is not None]
        if known:
            return set.intersection(*known)
    return None


def _resolve(ref: str, root: Any) -> Any:
    """A local JSON pointer (`#/$defs/name`); anything else resolves to nothing."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ToolPlan:
    tools: dict[str, Tool]
    choice: str  # auto | required | function
    forced: str | None  # the named function, for choice == "function"
    parallel: bool
    own_prompt: bool  # the engine's tool prompt instead of the template's
    grammar: str

    @property
    def required(self) -> bool:
        return self.choice != "auto"

    def prompt(self) -> str:
        """The engine's own tool prompt (templates without tool support, forced tools)."""
        shown = [t.function for t in self.tools.values()]
        lines = [
            "You can call functions. To call one, answer with exactly",
            '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}'
            "</tool_call>",
            "Functions:",
            *(orjson.dumps(f).decode() for f in shown),
        ]
        if self.forced:
            lines.append(f"You must call {self.forced}.")
        elif self.required:
            lines.append("You must call at least one function.")
        return "\n".join(lines)

    def verify(self, name: str, args: Any) -> Call | None:
        tool = self.tools.get(name)
        if tool is None or (self.forced and name != self.forced):
            return None
        if not isinstance(args, dict) or not tool.validator.is_valid(args):
            return None
        return Call(name, orjson.dumps(args).decode())


def _strict_problem(schema: Any, path: str) -> str | None:
    """Why a strict schema is not closed (every object: no extra keys, all keys required)."""
    if not isinstance(schema, dict):
        return None
    if schema.get("type") == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if schema.get("additionalProperties") is not False:
            return f"{path or 'parameters'} must set additionalProperties: false"
        missing = sorted(set(props) - set(schema.get("required") or []))
        if missing:
            return (
                f"{path or 'parameters'} must list every property in required "
                f"(missing: {', '.join(missing)})"
            )
    subs: list[tuple[str, Any]] = []
    for k, v in (schema.get("properties") or {}).items():
        subs.append((f"{path}.{k}" if path else k, v))
    for key in ("$defs", "definitions"):
        for k, v in (schema.get(key) or {}).items():
            subs.append((f"{key}.{k}", v))
    if isinstance(schema.get("items"), dict):
        subs.append((f"{path}[]", schema["items"]))
    for key in ("anyOf", "oneOf"):
        for i, v in enumerate(schema.get(key) or []):
            subs.append((f"{path}.{key}[{i}]", v))
    for p, s in subs:
        problem = _strict_problem(s, p)
        if problem:
            return problem
    return None


def _tool(i: int, raw: Any) -> Tool:
    p = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise invalid("each tool must be an object", p)
    if raw.get("type", "function") != "function":
        raise invalid("only function tools are supported", f"{p}.type")
    fn = raw.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise invalid("a tool needs function.name", f"{p}.function.name")
    name = fn["name"]
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise invalid(
            f"tool name '{name}' must be 1-64 letters, digits, _ . or -", f"{p}.function.name"
        )
    schema = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise invalid(
            f"tool '{name}': parameters must be a JSON Schema object", f"{p}.function.parameters"
        )
    strict = fn.get("strict", False)
    if not isinstance(strict, bool):
        raise invalid(f"tool '{name}': strict must be a boolean", f"{p}.function.strict")
    check_schema(schema, f"{p}.function.parameters")
    try:  # the tool is written into the prompt as JSON: what cannot be written is refused
        orjson.dumps(fn)
    except TypeError as e:  # orjson's JSONEncodeError: too deep, an integer over 64 bits
        raise invalid(f"tool '{name}' cannot be written as JSON: {e}", f"{p}.function") from None
    if strict:
        problem = _strict_problem(schema, "")
        if problem is None and schema.get("type") != "object":
            problem = "parameters must be an object schema"
        if problem:
            raise invalid(f"strict tool '{name}': {problem}", f"{p}.function.parameters")
    try:
        validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    except (ValueError, jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as e:
        raise invalid(
            f"tool '{name}': parameters is not a valid JSON Schema: {e}", f"{p}.function.parameters"
        ) from e
    return Tool(name, fn, schema, validator)


def plan_tools(
    body: dict[str, Any], template_renders_tools: bool, function_form: bool
) -> ToolPlan | None:
    """The request's tool plan, or None when no call is to be parsed (no tools, or `none`)."""
    raw = body.get("tools")
    if raw is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list", "tools")
    tools: dict[str, Tool] = {}
    for i, t in enumerate(raw):
        tool = _tool(i, t)
        if tool.name in tools:
            raise invalid(f"tool '{tool.name}' is declared twice", f"tools[{i}].function.name")
        tools[tool.name] = tool
    choice = body.get("tool_choice", "auto" if tools else "none")
    forced: str | None = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise invalid(
                "tool_choice must be auto, none, required or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        forced = fn["name"]
        if forced not in tools:
            raise invalid(
                f"tool_choice names '{forced}', which is not in tools", "tool_choice.function.name"
            )
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise invalid("tool_choice must be auto, none, required or a named function", "tool_choice")
    if choice == "none" or not tools:
        if choice == "required":
            raise invalid("tool_choice 'required' needs at least one tool", "tool_choice")
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    own = forced is not None or not template_renders_tools
    chosen = [tools[forced]] if forced else list(tools.values())
    grammar = (
        ""
        if function_form and not own
        else calls_grammar([(t.name, t.schema) for t in chosen], many=parallel and forced is None)
    )
    return ToolPlan(tools, choice, forced, parallel and forced is None, own, grammar)


# -- parsing -----------------------------------------------------------------------------
_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.S)
_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


def parse_call(inner: str, plan: ToolPlan) -> Call | None:
    """One call's markup (between the markers) in either form, verified; None if it is not
    a valid call."""
    m = _FUNCTION.fullmatch(inner)
    if m is not None:
        name = m.group(1)
        tool = plan.tools.get(name)
        if tool is None:
            return None
        fargs: dict[str, Any] = {}
        rest = _PARAM.sub("", m.group(2))
        if rest.strip():
            return None
        for key, value in _PARAM.findall(m.group(2)):
            value = value.removeprefix("\n").removesuffix("\n")
            fargs[key] = tool.param_value(key, value)
        return plan.verify(name, fargs)
    try:
        obj = orjson.loads(inner)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models quote the arguments object
        try:
            args = orjson.loads(args)
        except orjson.JSONDecodeError:
            return None
    return plan.verify(obj["name"], args)


class CallSplitter:
    """Streams content text, taking verified calls out of it.

    `feed` and `finish` return events: ("text", str) for content, ("call", Call) for a
    verified call, ("bad", str) for markup that only looked like a call (returned as text,
    or an error when a call was required).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buf = ""
        self.inside = False
        self.calls = 0
        self.after_call = False  # whitespace between calls is a separator, not content

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.after_call:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.after_call = False
            if not self.inside:
                at = self.buf.find(OPEN)
                if at < 0:
                    cut = len(self.buf) - held(self.buf, [OPEN])
                    emit, self.buf = self.buf[:cut], self.buf[cut:]
                    if emit:
                        out.append(("text", emit))
                    return out
                if at:
                    out.append(("text", self.buf[:at]))
                self.buf = self.buf[at:]
                self.inside = True
            end = self.buf.find(CLOSE)
            if end < 0:
                return out
            markup, self.buf = self.buf[: end + len(CLOSE)], self.buf[end + len(CLOSE) :]
            self.inside = False
            call = parse_call(markup[len(OPEN) : -len(CLOSE)], self.plan)
            if call is None or (self.calls and not self.plan.parallel):
                out.append(("bad", markup))
            else:
                self.calls += 1
                out.append(("call", call))
                self.after_call = True

    def finish(self) -> list[tuple[str, Any]]:
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        return [("bad" if self.inside else "text", rest)]
