"""Tool-call parsing, verification, schema widening and strict checks (no model needed)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engine.schema_grammar import ANY, widen
from narwhal.engine.tools import CallSplitter, ToolPlan, plan_tools
from narwhal.errors import ApiError

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
LOOKUP = {
    "type": "object",
    "properties": {"code": {"type": "string"}, "count": {"type": "integer"}},
}


def tool(name: str, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params, **extra}}


def plan(**body: Any) -> ToolPlan:
    p = plan_tools(
        {"tools": [tool("get_weather", WEATHER), tool("lookup", LOOKUP)], **body},
        template_renders_tools=False,
        function_form=False,
    )
    assert p is not None
    return p


def split_all(p: ToolPlan, chunks: list[str]) -> list[tuple[str, Any]]:
    s = CallSplitter(p)
    events = [e for c in chunks for e in s.feed(c)] + s.finish()
    merged: list[tuple[str, Any]] = []
    for kind, value in events:  # adjacent text merges: splits may cut text anywhere
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + value)
        elif kind == "call":
            merged.append(("call", (value.name, orjson.loads(value.arguments))))
        else:
            merged.append((kind, value))
    return merged


TWO_CALLS = (
    'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 2}}</tool_call>\n<tool_call><function=lookup><parameter=code>\n123\n'
    "</parameter><parameter=count>123</parameter></function></tool_call>"
)


def test_both_forms_and_schema_typed_function_values() -> None:
    events = split_all(plan(), [TWO_CALLS])
    assert events == [
        ("text", "Checking. "),
        ("call", ("get_weather", {"city": "Paris", "days": 2})),
        ("call", ("lookup", {"code": "123", "count": 123})),
    ]


@pytest.mark.parametrize(
    ("param", "text", "value"),
    [
        ({"type": ["string", "null"]}, "123", "123"),
        ({"type": ["string", "null"]}, "null", "null"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "123", "123"),
        ({"oneOf": [{"$ref": "#/$defs/text"}, {"type": "null"}]}, "true", "true"),
        ({"$ref": "#/$defs/text"}, "[1]", "[1]"),
        ({"enum": ["1", "2"]}, "1", "1"),
        ({"type": ["string", "integer"]}, "123", 123),
        ({"type": ["string", "integer"]}, "1.5", "1.5"),
        ({"type": "integer"}, "123", 123),
        ({}, "[1]", [1]),
    ],
)
def test_function_form_values_are_text_where_the_schema_says_string(
    param: dict[str, Any], text: str, value: Any
) -> None:
    schema = {"type": "object", "properties": {"a": param}, "$defs": {"text": {"type": "string"}}}
    p = plan_tools(
        {"tools": [tool("note", schema)]}, template_renders_tools=False, function_form=True
    )
    assert p is not None
    markup = f"<tool_call><function=note><parameter=a>{text}</parameter></function></tool_call>"
    assert split_all(p, [markup]) == [("call", ("note", {"a": value}))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TWO_CALLS)), max_size=12))
def test_any_split_gives_the_same_calls(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TWO_CALLS)]
    chunks = [TWO_CALLS[a:b] for a, b in itertools.pairwise(bounds)]
    assert split_all(plan(), chunks) == split_all(plan(), [TWO_CALLS])


def test_no_markup_leaks_into_streamed_text() -> None:
    s = CallSplitter(plan())
    texts = []
    for ch in TWO_CALLS:  # one character at a time: every partial marker is held back
        texts += [v for k, v in s.feed(ch) if k == "text"]
    assert "".join(texts) == "Checking. "


@pytest.mark.parametrize(
    "markup",
    [
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "x", "days": 0}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        "<tool_call><function=lookup><parameter=count>many</parameter></function></tool_call>",
    ],
)
def test_look_alikes_are_not_calls(markup: str) -> None:
    assert split_all(plan(), ["Sure: " + markup]) == [("text", "Sure: "), ("bad", markup)]


def test_unfinished_call_at_the_end_is_not_a_call() -> None:
    text = '<tool_call>{"name": "get_weather", "arg'
    assert split_all(plan(), [text]) == [("bad", text)]


def test_only_one_call_without_parallel_tool_calls() -> None:
    events = split_all(plan(parallel_tool_calls=False), [TWO_CALLS])
    assert [k for k, _ in events] == ["text", "call", "bad"]


def test_a_named_choice_accepts_only_that_tool() -> None:
    p = plan(tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [k for k, _ in split_all(p, [TWO_CALLS])] == ["text", "bad", "text", "call"]
    assert p.own_prompt and p.required


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            "additionalProperties",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                "required": ["a"],
                "additionalProperties": False,
            },
            "missing: b",
        ),
        (
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["o"],
                "properties": {
                    "o": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}},
                        "required": ["x"],
                    }
                },
            },
            "o must set additionalProperties",
        ),
    ],
)
def test_strict_tools_must_be_closed(params: dict[str, Any], why: str) -> None:
    with pytest.raises(ApiError) as e:
        plan_tools({"tools": [tool("t1", params, strict=True)]}, False, False)
    assert e.value.status == 400 and "t1" in e.value.message and why in e.value.message
    assert e.value.param == "tools[0].function.parameters"


def test_a_closed_strict_tool_is_accepted() -> None:
    params = {
        "type": "object",
        "additionalProperties": False,
        "required": ["a"],
        "properties": {"a": {"type": "string"}},
    }
    assert plan_tools({"tools": [tool("t1", params, strict=True)]}, False, False) is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [tool("bad name!", {})]}, "tools[0].function.name"),
        ({"tools": [tool("t", {"type": 12})]}, "tools[0].function.parameters.type"),
        ({"tools": [tool("t", {"enum": [2**70]})]}, "tools[0].function"),
        ({"tools": [tool("t", {})], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [tool("t", {})],
                "tool_choice": {"type": "function", "function": {"name": "u"}},
            },
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool("t", {})], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        plan_tools(body, False, False)
    assert (e.value.status, e.value.param) == (400, param)


def test_tool_choice_none_parses_nothing() -> None:
    assert plan_tools({"tools": [tool("t", {})], "tool_choice": "none"}, False, False) is None


# Each widening rule of docs/TOOLS.md: what the grammar is built from.
@pytest.mark.parametrize(
    ("schema", "widened"),
    [
        ({"type": "integer", "minimum": 1, "maximum": 9, "multipleOf": 3}, {"type": "integer"}),
        ({"type": "number", "exclusiveMinimum": 0}, {"type": "number"}),
        ({"type": "string", "format": "email"}, {"type": "string"}),
        ({"type": "string", "format": "date"}, {"type": "string", "format": "date"}),
        (
            {"type": "string", "minLength": 2, "maxLength": 5},
            {"type": "string", "minLength": 2, "maxLength": 5},
        ),
        ({"type": "string", "pattern": "[0-9]+"}, {"type": "string", "pattern": "^.*[0-9]+.*$"}),
        (
            {"type": "string", "pattern": "^[0-9]+$", "maxLength": 3},
            {"type": "string", "pattern": "^[0-9]+$"},
        ),
        ({"type": "string", "default": "x", "description": "d"}, {"type": "string"}),
        (
            {"anyOf": [{"type": "string"}, {"type": "null"}]},
            {"anyOf": [{"type": "string"}, {"type": "null"}]},
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}},
            {"type": "object", "properties": {"a": {"type": "string"}}},
        ),
        (
            {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
            {"type": "object", "properties": {"a": ANY}, "additionalProperties": True},
        ),
        (
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 1},
            {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        ),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, {"type": "array"}),
        ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, ANY),
        ({"not": {"type": "string"}}, ANY),
        ({"description": "anything"}, ANY),
        (
            {"$ref": "#/$defs/p", "$defs": {"p": {"type": "integer", "minimum": 0}}},
            {"$ref": "#/$defs/p", "$defs": {"p": {"type": "integer"}}},
        ),
    ],
)
def test_widening_rules(schema: dict[str, Any], widened: dict[str, Any]) -> None:
    assert widen(schema) == widened
