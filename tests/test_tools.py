"""LexiEngine tool calling end to end on the real SmolLM2 model.

Exact output comes from a request `grammar` (which takes precedence over the engine's tool
grammar), so parsing and verification are checked on text the model really generated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import orjson
import pytest

from tests.support import Server, frames, post, start_engine

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "description": "as the client wrote it",
    "properties": {
        "city": {"type": "string", "description": "a city"},
        "days": {"type": "integer", "minimum": 1},
    },
    "required": ["city"],
}
LOOKUP = {
    "type": "object",
    "properties": {"code": {"type": "string"}, "count": {"type": "integer"}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

HERMES = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def forced(text: str) -> str:
    return "root ::= " + orjson.dumps(text).decode()


CALL = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}</tool_call>'
)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Server]:
    s = start_engine(model_path, "--parallel", "2", "--temp", "0", "--queue-wait", "60")
    yield s
    s.stop()


def with_tools(s: Server, **body: Any) -> httpx.Response:
    return post(s, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, **body})


def streamed(s: Server, **body: Any) -> dict[str, Any]:
    """A streamed answer put back together the way an OpenAI client does it."""
    fs = [f for f in frames(with_tools(s, stream=True, **body)) if f != "[DONE]"]
    content, calls, finish = "", {}, None
    for f in fs:
        assert "error" not in f, f
        ch = f["choices"][0]
        content += ch["delta"].get("content") or ""
        for tc in ch["delta"].get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": ""})
            c["id"] += tc.get("id", "")
            c["name"] += tc.get("function", {}).get("name", "")
            c["arguments"] += tc.get("function", {}).get("arguments", "")
        finish = ch["finish_reason"] or finish
        assert "<tool_call" not in (ch["delta"].get("content") or "")
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def test_json_form_call_streaming_and_not(engine: Server) -> None:
    whole = with_tools(engine, grammar=forced(CALL)).json()["choices"][0]
    msg = whole["message"]
    assert msg["content"] == "Let me check. "
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert orjson.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris",
        "days": 3,
    }
    assert msg["tool_calls"][0]["id"].startswith("call_")
    assert whole["finish_reason"] == "tool_calls"

    s = streamed(engine, grammar=forced(CALL))
    assert s["content"] == msg["content"]
    assert [(c["name"], c["arguments"]) for c in s["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
    ]
    assert s["finish"] == "tool_calls" and s["calls"][0]["id"].startswith("call_")


def test_function_form_values_follow_the_schema_and_several_calls(engine: Server) -> None:
    text = (
        "<tool_call><function=lookup><parameter=code>123</parameter>"
        "<parameter=count>123</parameter></function></tool_call>\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    msg = with_tools(engine, grammar=forced(text)).json()["choices"][0]["message"]
    calls = [
        (c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ]
    assert calls == [("lookup", {"code": "123", "count": 123}), ("get_weather", {"city": "Rome"})]
    assert msg["content"] is None
    s = streamed(engine, grammar=forced(text))
    assert [c["name"] for c in s["calls"]] == ["lookup", "get_weather"]


NOTE_PARAMS = [
    {"type": ["string", "null"]},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {"$ref": "#/$defs/text"},
]


@pytest.mark.parametrize("param", NOTE_PARAMS)
def test_function_form_text_for_every_way_a_schema_says_string(
    engine: Server, param: dict[str, Any]
) -> None:
    schema = {
        "type": "object",
        "properties": {"a": param},
        "required": ["a"],
        "$defs": {"text": {"type": "string"}},
    }
    note = {"type": "function", "function": {"name": "note", "parameters": schema}}
    text = "<tool_call><function=note><parameter=a>123</parameter></function></tool_call>"
    r = post(
        engine,
        "/v1/chat/completions",
        {"messages": ASK, "tools": [note], "tool_choice": "required", "grammar": forced(text)},
    )
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call["name"], orjson.loads(call["arguments"])) == ("note", {"a": "123"})


@pytest.mark.parametrize(
    "markup",
    [
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": 7}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>',
    ],
)
def test_look_alikes_come_back_as_text(engine: Server, markup: str) -> None:
    ch = with_tools(engine, grammar=forced("Hmm " + markup)).json()["choices"][0]
    assert ch["message"]["content"] == "Hmm " + markup
    assert "tool_calls" not in ch["message"] and ch["finish_reason"] == "stop"


def test_required_without_a_valid_call_is_a_clean_error(engine: Server) -> None:
    bad = '<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>'
    r = with_tools(engine, grammar=forced(bad), tool_choice="required")
    assert r.status_code == 422
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("tool_call_invalid", "tool_choice")
    fs = frames(
        with_tools(engine, grammar=forced("no call here"), tool_choice="required", stream=True)
    )
    assert fs[-1]["error"]["code"] == "tool_call_invalid"
    # The engine is fine afterwards (the slot came back).
    assert with_tools(engine, grammar=forced(CALL)).status_code == 200


def test_named_tool_is_constrained_from_the_first_token(engine: Server) -> None:
    r = with_tools(
        engine,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    (call,) = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert jsonschema_rs.validator_for(WEATHER).is_valid(
        orjson.loads(call["function"]["arguments"])
    )
    assert ch["finish_reason"] == "tool_calls"


def test_grammar_enforces_what_it_can_of_the_schema(engine: Server) -> None:
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "unit": {"enum": ["celsius", "kelvin"]},
            "when": {"type": "string", "format": "date"},
        },
        "required": ["code", "unit", "when"],
    }
    tools = [{"type": "function", "function": {"name": "report", "parameters": schema}}]
    r = post(
        engine,
        "/v1/chat/completions",
        {
            "messages": ASK,
            "tools": tools,
            "max_tokens": 120,
            "tool_choice": {"type": "function", "function": {"name": "report"}},
        },
    )
    assert r.status_code == 200, r.text
    args = orjson.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(args)


def test_auto_the_model_calls_on_its_own(engine: Server) -> None:
    """No forcing: earlier turns show the model the engine's call form, it writes a call
    by itself (the lazy grammar takes over from `<tool_call>`), and the call is returned."""
    tools = TOOLS[:1]
    history: list[dict[str, Any]] = []
    for i, city in enumerate(("Paris", "Berlin", "Madrid")):
        history += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": orjson.dumps({"city": city}).decode(),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny"},
            {"role": "assistant", "content": f"It is sunny in {city}."},
        ]
    history.append({"role": "user", "content": "Weather in Rome?"})
    r = post(
        engine, "/v1/chat/completions", {"messages": history, "tools": tools, "max_tokens": 60}
    )
    ch = r.json()["choices"][0]
    (call,) = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert orjson.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert ch["finish_reason"] == "tool_calls"


def test_strict_tool_that_is_not_closed_is_refused(engine: Server) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "strict": True, "parameters": WEATHER},
        }
    ]
    r = post(engine, "/v1/chat/completions", {"messages": ASK, "tools": tools})
    assert r.status_code == 400
    assert "get_weather" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "object", "properties": [1]}, ".properties"),
        ({"type": "object", "properties": [{}]}, ".properties"),
        ({"type": "object", "properties": {}, "required": 5}, ".required"),
        ({"type": "object", "$defs": [1]}, ".$defs"),
        ({"type": "object", "anyOf": 5}, ".anyOf"),
    ],
)
@pytest.mark.parametrize("strict", [True, False])
def test_a_tool_schema_that_is_not_one_is_a_400_naming_the_place(
    engine: Server, schema: dict[str, Any], path: str, strict: bool
) -> None:
    fn = {"name": "bad", "strict": strict, "parameters": {**schema, "additionalProperties": False}}
    tools = [TOOLS[0], {"type": "function", "function": fn}]
    r = post(engine, "/v1/chat/completions", {"messages": ASK, "tools": tools})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[1].function.parameters" + path


def _nested(depth: int) -> Any:
    out: Any = []
    for _ in range(depth - 1):
        out = [out]
    return out


@pytest.mark.parametrize(
    "arguments",
    [
        '{"city": ' + "[" * 300 + "]" * 300 + "}",  # as OpenAI sends them: a string
        {"city": _nested(300)},  # an object, as some clients send them
        [1, 2],  # neither
    ],
    ids=["string", "object", "list"],
)
def test_history_arguments_too_deep_to_write_are_a_400(engine: Server, arguments: Any) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = post(engine, "/v1/chat/completions", {"messages": history, "tools": TOOLS})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_tool_choice_none_leaves_calls_as_text(engine: Server) -> None:
    msg = with_tools(engine, grammar=forced(CALL), tool_choice="none").json()["choices"][0][
        "message"
    ]
    assert msg["content"] == CALL and "tool_calls" not in msg


def test_calls_inside_reasoning_are_reasoning(engine: Server) -> None:
    text = "<think>maybe " + CALL + "</think>Done."
    msg = with_tools(engine, grammar=forced(text)).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "maybe " + CALL
    assert msg["content"] == "Done." and "tool_calls" not in msg


def test_openai_sdk_tool_call_objects(engine: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        extra_body={"grammar": forced(CALL)},
    )
    call = out.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert orjson.loads(call.function.arguments)["city"] == "Paris"  # type: ignore[union-attr]
    assert out.choices[0].finish_reason == "tool_calls"
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        stream=True,  # type: ignore[arg-type]
        extra_body={"grammar": forced(CALL)},
    )
    names = [
        tc.function.name
        for chunk in stream
        for tc in (chunk.choices[0].delta.tool_calls or [])
        if tc.function.name
    ]
    assert names == ["get_weather"]


def test_history_and_tools_reach_a_template_that_renders_them(
    model_path: str, tmp_path: Path
) -> None:
    from llama_cpp import Llama

    tpl = tmp_path / "hermes.jinja"
    tpl.write_text(HERMES)
    s = start_engine(model_path, "--chat-template-file", str(tpl), "--temp", "0")
    try:
        history = [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        ]
        r = post(
            s,
            "/v1/chat/completions",
            {"messages": history, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True},
        )
        assert r.status_code == 200, r.text
        vocab = Llama(model_path, vocab_only=True, verbose=False)
        prompt = vocab.detokenize(r.json()["prompt_token_ids"], special=True).decode()
        # The schema exactly as the client wrote it, the call's arguments as an object.
        assert orjson.dumps(TOOLS[0]).decode() in prompt
        assert '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}' in prompt
        assert "<tool_response>sunny</tool_response>" in prompt
        assert "You can call functions" not in prompt  # not the engine's own prompt
        named = post(
            s,
            "/v1/chat/completions",
            {
                "messages": ASK,
                "tools": TOOLS,
                "max_tokens": 150,
                "return_token_ids": True,
                "tool_choice": {"type": "function", "function": {"name": "lookup"}},
            },
        )
        assert named.status_code == 200, named.text
        text = vocab.detokenize(named.json()["prompt_token_ids"], special=True).decode()
        assert "You must call lookup." in text  # a forced tool gets the engine's prompt
    finally:
        s.stop()
