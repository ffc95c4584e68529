"""LexiEngine end to end on the real SmolLM2 model over real sockets.

Exact text comes from GBNF grammars: the model is forced to emit it token by token, so the
reasoning split, stop strings and token IDs are checked deterministically.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support import BIN, Server, frames, post, start_engine

pytestmark = pytest.mark.slow

THINK = 'root ::= "<think>plan it</think>\\n\\nThe answer is 4."'
LONG = 'root ::= "' + "go " * 1500 + '"'
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Server]:
    s = start_engine(
        model_path, "--alias", "main", "--alias", "client-main", "--queue-wait", "30", "--temp", "0"
    )
    yield s
    s.stop()


def chat(content: str = "What is 2+2?", **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **kw}


def test_models_lists_aliases_and_unknown_names_are_refused(engine: Server) -> None:
    ids = [m["id"] for m in httpx.get(engine.url + "/v1/models").json()["data"]]
    assert ids == ["main", "client-main"]
    for name in ("client-main", None):
        body = chat(max_tokens=2) | ({"model": name} if name else {})
        assert post(engine, "/v1/chat/completions", body).status_code == 200
    r = post(engine, "/v1/chat/completions", chat(model="Main", max_tokens=2))
    assert r.status_code == 400
    assert "requested model is not loaded" in r.json()["error"]["message"]


def test_request_ids_and_access_lines(engine: Server) -> None:
    r = post(
        engine,
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 3},
        headers={"x-request-id": "eng-42"},
    )
    assert r.headers["x-request-id"] == "eng-42"
    for _ in range(50):
        line = next((x for x in engine.stderr().splitlines() if "request_id=eng-42" in x), None)
        if line:
            break
        time.sleep(0.05)
    assert line is not None and "lexi.access POST /v1/completions 200" in line
    assert "tokens_out=3" in line


def test_a_model_is_retrieved_by_any_of_its_names(engine: Server) -> None:
    for name in ("main", "client-main"):
        r = httpx.get(engine.url + "/v1/models/" + name)
        assert r.status_code == 200 and r.json()["id"] == name
    r = httpx.get(engine.url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(engine.url + "/v1/models/main").status_code == 405


def test_reasoning_is_separated_streaming_and_not(engine: Server) -> None:
    r = post(engine, "/v1/chat/completions", chat(grammar=THINK))
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "plan it"
    assert msg["content"] == "The answer is 4."
    assert r.json()["choices"][0]["finish_reason"] == "stop"

    r = post(engine, "/v1/chat/completions", chat(grammar=THINK, stream=True))
    fs = [f for f in frames(r) if f != "[DONE]"]
    reasoning = "".join(f["choices"][0]["delta"].get("reasoning_content", "") for f in fs)
    content = "".join(f["choices"][0]["delta"].get("content", "") for f in fs)
    assert (reasoning, content) == ("plan it", "The answer is 4.")
    assert "<think>" not in r.text and "</think>" not in r.text
    assert len([f for f in fs if f["choices"][0]["delta"]]) > 3  # really streamed


def test_unclosed_reasoning_leaves_content_empty(engine: Server) -> None:
    # Far more text than 40 tokens can hold under any tokenization, and 40 tokens hold
    # "still go" under any (at worst a byte a token).
    g = 'root ::= "<think>' + "still going " * 60 + '"'
    r = post(engine, "/v1/chat/completions", chat(grammar=g, max_tokens=40))
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == ""
    assert msg["reasoning_content"].startswith("still go")
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_completions_keep_raw_text(engine: Server) -> None:
    r = post(engine, "/v1/completions", {"prompt": "Q:", "grammar": THINK})
    assert r.json()["choices"][0]["text"] == "<think>plan it</think>\n\nThe answer is 4."


def test_token_ids_follow_the_vllm_shape(engine: Server) -> None:
    r = post(
        engine,
        "/v1/chat/completions",
        chat(
            grammar=THINK,
            return_token_ids=True,
            stream=True,
            stream_options={"include_usage": True},
        ),
    )
    fs = frames(r)
    assert fs[-1] == "[DONE]"
    assert isinstance(fs[0]["prompt_token_ids"], list) and fs[0]["prompt_token_ids"]
    assert all("prompt_token_ids" not in f for f in fs[1:-1])
    ids = [i for f in fs[1:-1] if f["choices"] for i in f["choices"][0]["token_ids"]]
    usage = fs[-2]["usage"]
    assert len(ids) == usage["completion_tokens"]
    assert len(fs[0]["prompt_token_ids"]) == usage["prompt_tokens"]

    whole = post(engine, "/v1/chat/completions", chat(grammar=THINK, return_token_ids=True))
    assert whole.json()["choices"][0]["token_ids"] == ids
    comp = post(
        engine, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "return_token_ids": True}
    )
    assert comp.json()["choices"][0]["prompt_token_ids"]
    assert len(comp.json()["choices"][0]["token_ids"]) == 3


def test_stream_interval_groups_tokens(engine: Server) -> None:
    r = post(
        engine,
        "/v1/completions",
        {
            "prompt": "Hello",
            "max_tokens": 6,
            "stream": True,
            "stream_interval": 3,
            "return_token_ids": True,
        },
    )
    groups = [
        len(f["choices"][0]["token_ids"])
        for f in frames(r)
        if f != "[DONE]" and f["choices"][0]["token_ids"]
    ]
    assert groups == [3, 3]


def test_stop_strings_seed_and_length(engine: Server) -> None:
    g = 'root ::= "alpha beta STOP gamma"'
    r = post(engine, "/v1/completions", {"prompt": "x", "grammar": g, "stop": ["STOP"]})
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"]) == ("alpha beta ", "stop")
    a = post(
        engine,
        "/v1/completions",
        {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 7},
    ).json()
    b = post(
        engine,
        "/v1/completions",
        {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 7},
    ).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["finish_reason"] == "length"
    assert a["usage"]["completion_tokens"] == 8


def test_response_format_json_and_logprobs(engine: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = post(
        engine,
        "/v1/chat/completions",
        chat(
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        ),
    )
    assert isinstance(orjson.loads(r.json()["choices"][0]["message"]["content"])["n"], int)
    r = post(engine, "/v1/chat/completions", chat(max_tokens=3, logprobs=True, top_logprobs=2))
    lp = r.json()["choices"][0]["logprobs"]["content"]
    assert len(lp) == 3 and all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in lp)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(n=2), "n"),
        (chat(grammar="root ::= undefined_rule"), "grammar"),
        # 30,000 nested groups overflowed llama.cpp's parser stack and killed the engine.
        (chat(grammar="root ::= " + "(" * 30000 + '"a"' + ")" * 30000), "grammar"),
        (chat(grammar="root ::= " + '"a" ' * 300_000), "grammar"),  # 1.2 MB of grammar
        (chat(temperature=5), "temperature"),
        # Schemas that are not JSON Schemas, or that the converter cannot take: once bare 500s.
        *(
            (
                chat(
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": schema},
                    }
                ),
                "response_format.json_schema.schema" + where,
            )
            for schema, where in (
                ({"type": "string", "pattern": "a+"}, ""),
                ({"type": 5}, ".type"),
                ({"type": "object", "properties": [1]}, ".properties"),
                ({"$defs": [1], "type": "object"}, ".$defs"),
                ({"anyOf": 5}, ".anyOf"),
            )
        ),
        (chat(reasoning_effort="extreme"), "reasoning_effort"),
        (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
        (
            {"messages": [{"role": "user", "content": "x", "reasoning_content": "no"}]},
            "messages[0].reasoning_content",
        ),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "3"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_requests_are_400_with_param(engine: Server, body: dict[str, Any], param: str) -> None:
    r = post(engine, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(engine.url + "/health").status_code == 200  # and the engine lives


def test_a_grammar_nested_a_few_hundred_deep_still_works(engine: Server) -> None:
    g = "root ::= " + "(" * 300 + '"deep"' + ")" * 300
    r = post(engine, "/v1/chat/completions", chat(grammar=g, max_tokens=8))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "deep"


def test_history_reasoning_is_accepted_and_not_replayed(engine: Server) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "SECRET-THOUGHT " * 50},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "3"},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 1,
        "return_token_ids": True,
    }
    with_rc = post(engine, "/v1/chat/completions", body).json()
    body["messages"][1].pop("reasoning_content")
    without = post(engine, "/v1/chat/completions", body).json()
    assert with_rc["prompt_token_ids"] == without["prompt_token_ids"]


def test_reasoning_effort_is_501_for_a_template_that_cannot_think(engine: Server) -> None:
    r = post(engine, "/v1/chat/completions", chat(reasoning_effort="high", max_tokens=1))
    assert r.status_code == 501
    assert (
        post(
            engine, "/v1/chat/completions", chat(reasoning_effort="none", max_tokens=1)
        ).status_code
        == 200
    )


def test_context_ceiling_is_400(engine: Server) -> None:
    r = post(engine, "/v1/completions", {"prompt": "word " * 3000, "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_two_requests_one_slot_are_both_answered(engine: Server) -> None:
    results: list[int] = []

    def go() -> None:
        results.append(
            post(engine, "/v1/completions", {"prompt": "Hi", "max_tokens": 12}).status_code
        )

    ts = [threading.Thread(target=go) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [200, 200]


def test_responses_api(engine: Server) -> None:
    r = post(engine, "/v1/responses", {"input": "What is 2+2?", "grammar": THINK})
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["reasoning", "message"]
    assert out[0]["content"][0]["text"] == "plan it"
    assert out[1]["content"][0]["text"] == "The answer is 4."
    r = post(engine, "/v1/responses", {"input": "hi", "grammar": THINK, "stream": True})
    deltas = [f["delta"] for f in frames(r) if f["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "The answer is 4."
    assert frames(r)[-1]["type"] == "response.completed"


def test_an_unknown_previous_response_is_400_not_ignored(engine: Server) -> None:
    r = post(engine, "/v1/responses", {"input": "and then?", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_a_response_cut_short_says_so_in_its_message_item(engine: Server) -> None:
    body = {"input": "hi", "grammar": 'root ::= "' + "word " * 50 + '"', "max_output_tokens": 5}
    whole = post(engine, "/v1/responses", body).json()
    assert whole["status"] == "incomplete"
    assert [o["status"] for o in whole["output"]] == ["incomplete"]
    streamed = frames(post(engine, "/v1/responses", body | {"stream": True}))
    done = [f["item"]["status"] for f in streamed if f["type"] == "response.output_item.done"]
    assert done == ["incomplete"] and streamed[-1]["type"] == "response.incomplete"


def test_openai_sdk_against_the_engine(engine: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="x")
    out = client.chat.completions.create(
        model="main", messages=[{"role": "user", "content": "hi"}], extra_body={"grammar": THINK}
    )
    assert out.choices[0].message.content == "The answer is 4."
    assert (out.choices[0].message.model_extra or {})["reasoning_content"] == "plan it"
    assert out.usage is not None and out.usage.completion_tokens > 10


def test_metrics(engine: Server) -> None:
    m = httpx.get(engine.url + "/metrics").text
    for name in (
        "lexi_requests_total",
        "lexi_output_tokens_total",
        "lexi_queue_depth",
        "lexi_slots_busy",
        "lexi_time_to_first_token_seconds",
        "lexi_time_per_output_token_seconds",
    ):
        assert name in m


@pytest.fixture(scope="module")
def busy_engine(model_path: str) -> Iterator[Server]:
    s = start_engine(
        model_path,
        "--queue-wait",
        "0",
        "--api-key",
        "k1",
        "--chat-template-file",
        str(_template_file()),
        "--reasoning-format",
        "none",
    )
    yield s
    s.stop()


def _template_file() -> Path:
    import tempfile

    p = Path(tempfile.mkdtemp()) / "think.jinja"
    p.write_text(THINK_TEMPLATE)
    return p


def test_queue_wait_zero_is_429_busy(busy_engine: Server) -> None:
    auth = {"authorization": "Bearer k1"}
    with httpx.stream(
        "POST",
        busy_engine.url + "/v1/completions",
        headers=auth,
        json={"prompt": "Hi", "max_tokens": 1500, "stream": True, "grammar": LONG},
        timeout=60,
    ) as first:
        chunks = first.iter_bytes()
        assert next(chunks)
        r = httpx.post(
            busy_engine.url + "/v1/completions",
            headers=auth,
            json={"prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "inference_busy"
    # The disconnect freed the slot (as soon as the server saw it and the decode loop's
    # next step dropped the request).
    for _ in range(100):
        r = httpx.post(
            busy_engine.url + "/v1/completions",
            headers=auth,
            json={"prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        if r.status_code == 200:
            break
        time.sleep(0.02)
    assert r.status_code == 200


def test_api_key_applies_to_every_alias_but_not_health(busy_engine: Server) -> None:
    assert httpx.get(busy_engine.url + "/health").status_code == 200
    assert httpx.get(busy_engine.url + "/v1/models").status_code == 401
    r = httpx.post(busy_engine.url + "/v1/chat/completions", json=chat(max_tokens=1))
    assert r.status_code == 401


def test_template_file_thinking_switch_and_raw_format(busy_engine: Server) -> None:
    auth = {"authorization": "Bearer k1"}
    on = post(
        busy_engine,
        "/v1/chat/completions",
        chat(reasoning_effort="high", max_tokens=1, return_token_ids=True),
        headers=auth,
    )
    off = post(
        busy_engine,
        "/v1/chat/completions",
        chat(reasoning_effort="none", max_tokens=1, return_token_ids=True),
        headers=auth,
    )
    assert on.status_code == off.status_code == 200
    assert len(off.json()["prompt_token_ids"]) > len(on.json()["prompt_token_ids"])
    raw = post(busy_engine, "/v1/chat/completions", chat(grammar=THINK), headers=auth).json()
    assert raw["choices"][0]["message"]["content"] == "<think>plan it</think>\n\nThe answer is 4."


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--temp", "3"], "--temp"),
        (["--top-k", "-1"], "--top-k"),
        (["--n-predict", "0"], "--n-predict"),
        (["--chat-template-kwargs", "{bad"], "--chat-template-kwargs"),
        (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs"),
        (["--reasoning-format", "deepseek"], "--reasoning-format"),
        (["--chat-template-file", "/nonexistent.jinja"], "--chat-template-file"),
        # A floor any client could raise: fencing needs etcd or the routers' secret.
        (["--fence"], "--fence-etcd (tokens checked against etcd) or --fence-secret"),
        (["--fence-secret", "s"], "--fence-secret: needs --fence"),
        (["--lora", "sql"], "--lora: give NAME=PATH"),
        (["--lora", "sql=/nonexistent.gguf"], "--lora: sql: no such file"),
        (["--alias", "a", "--lora", "a=/etc/hostname"], "--lora: the name 'a' is taken"),
    ],
)
def test_bad_launch_options_are_refused_before_listening(
    model_path: str, args: list[str], flag: str
) -> None:
    p = subprocess.run(
        [str(BIN / "lexi-engine"), "serve", "-m", model_path, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2
    assert flag in p.stderr


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\xfe",
        b"{% for x in %}",
        b"x" * 300_000,
        # What can never render here is refused at start, not on every request (once: 500s,
        # or a traceback at start).
        b'{% include "other.jinja" %}',
        b'{% extends "base.jinja" %}',
        b'{% import "m" as m %}',
        b"{{ 10**100000 }}",
    ],
)
def test_bad_template_files_are_refused(model_path: str, tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "t.jinja"
    f.write_bytes(content)
    p = subprocess.run(
        [str(BIN / "lexi-engine"), "serve", "-m", model_path, "--chat-template-file", str(f)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2
    assert "--chat-template-file" in p.stderr
    assert "Traceback" not in p.stderr


TRAP_TEMPLATE = (
    "{# a thought-channel template: <|channel|>analysis<|message|>...<|end|> #}"
    "{% set ns = namespace(n=0) %}"
    "{% if messages[0].content == 'slow' %}"
    "{% for i in range(100000) %}{% for j in range(8) %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[0].content == 'forever' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[0].content == 'add' %}{{ 1 + messages[0].content }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


@pytest.fixture(scope="module")
def trap_engine(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    f = tmp_path_factory.mktemp("tmpl") / "trap.jinja"
    f.write_text(TRAP_TEMPLATE)
    s = start_engine(model_path, "--chat-template-file", str(f), "--parallel", "2")
    yield s
    s.stop()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(chat_template_kwargs={"namespace": "x"}), "chat_template_kwargs.namespace"),
        (
            chat(chat_template_kwargs={"enable_thinking": "no"}),
            "chat_template_kwargs.enable_thinking",
        ),
        (chat("add"), "messages"),  # the template adds a number to the request's text
    ],
)
def test_a_render_the_request_breaks_is_400_naming_it(
    trap_engine: Server, body: dict[str, Any], param: str
) -> None:
    r = post(trap_engine, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_render_that_writes_nothing_for_ever_is_stopped(trap_engine: Server) -> None:
    """10^10 loop steps that write no output: stopped at the render budget (5 s) with a 500
    in the envelope, instead of burning a worker thread for hours."""
    r = post(trap_engine, "/v1/chat/completions", chat("forever", max_tokens=1))
    assert r.status_code == 500, r.text
    assert "ran over" in r.json()["error"]["message"]
    assert post(trap_engine, "/v1/chat/completions", chat("hi", max_tokens=1)).status_code == 200


CHANNELS = (
    'root ::= "<|channel|>analysis<|message|>thought<|end|>'
    '<|start|>assistant<|channel|>final<|message|>answer"'
)


def test_thought_channel_content_is_the_final_channel_alone(trap_engine: Server) -> None:
    body = chat(grammar=CHANNELS, max_tokens=200)
    msg = post(trap_engine, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("thought", "answer")
    r = post(trap_engine, "/v1/chat/completions", body | {"stream": True})
    deltas = [f["choices"][0]["delta"] for f in frames(r) if f != "[DONE]" and f["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "thought"
    assert "".join(d.get("content") or "" for d in deltas) == "answer"


def test_health_answers_while_a_template_renders(trap_engine: Server) -> None:
    """A render of 800,000 loop steps (seconds) runs off the event loop: /health,
    asked again and again meanwhile, keeps answering (on the loop, the first ask waited
    for the whole render and the rest came after it)."""
    import threading

    done = threading.Event()
    slow = threading.Thread(
        target=lambda: (
            post(trap_engine, "/v1/chat/completions", chat("slow", max_tokens=1)),
            done.set(),
        )
    )
    slow.start()
    answered = 0
    with httpx.Client(timeout=60) as c:
        while not done.is_set():
            assert c.get(trap_engine.url + "/health").status_code == 200
            answered += 1
    slow.join()
    assert answered >= 10


def test_version_flags() -> None:
    for exe in ("lexi-engine", "narwhal"):
        out = subprocess.run([str(BIN / exe), "--version"], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith(exe)
    assert sys.executable


def test_a_character_cut_by_the_token_limit_is_dropped(engine: Server) -> None:
    text = "😉🌱🌡"
    body = {"prompt": "x", "grammar": 'root ::= "' + text + '"', "return_token_ids": True}
    full = post(engine, "/v1/completions", body).json()["choices"][0]
    assert full["text"] == text
    for k in range(1, len(full["token_ids"])):
        part = post(engine, "/v1/completions", body | {"max_tokens": k}).json()["choices"][0]
        assert "\ufffd" not in part["text"] and text.startswith(part["text"])
    assert len(full["token_ids"]) > len(text)  # the emoji really span several tokens


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("POST", "/v1/models", 405, "GET"),
        ("GET", "/v1/chat/completions", 405, "POST"),
        ("POST", "/tokenize", 404, None),
    ],
)
def test_engine_routes_404_and_405_with_allow(
    engine: Server, method: str, path: str, status: int, allow: str | None
) -> None:
    r = httpx.request(method, engine.url + path)
    assert r.status_code == status and r.headers.get("allow") == allow
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_slot_is_free_once_an_error_ended_stream_has_ended(model_path: str) -> None:
    s = start_engine(model_path, "--parallel", "1", "--queue-wait", "0")
    try:
        for _ in range(3):
            ended = httpx.post(
                s.url + "/v1/chat/completions",
                timeout=60,
                json=chat(
                    stream=True,
                    tool_choice="required",
                    grammar='root ::= "no call"',
                    max_tokens=20,
                    tools=[
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "parameters": {"type": "object"}},
                        }
                    ],
                ),
            ).text
            assert "tool_call_invalid" in ended
            # The client has the stream's end: the one slot is free for the next request.
            after = httpx.post(
                s.url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 1}
            )
            assert after.status_code == 200, after.text
    finally:
        s.stop()


def test_no_empty_delta_for_ids_the_client_did_not_ask_for(engine: Server) -> None:
    """Output ending on text that never shows (the closing `</think>`): its token IDs were
    held back, and a client that did not ask for IDs must not get them as `delta: {}`."""
    g = 'root ::= "<think>plan it</think>"'
    r = post(engine, "/v1/chat/completions", chat(grammar=g, stream=True))
    frames = [orjson.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    empty = [
        f
        for f in frames
        if f["choices"]
        and f["choices"][0]["delta"] == {}
        and f["choices"][0]["finish_reason"] is None
    ]
    assert empty == []
    assert frames[-1]["choices"][0]["finish_reason"] == "stop"
    with_ids = post(
        engine, "/v1/chat/completions", chat(grammar=g, stream=True, return_token_ids=True)
    ).text
    ids = [
        i
        for ln in with_ids.splitlines()
        if ln.startswith("data: {")
        for i in (orjson.loads(ln[6:])["choices"] or [{}])[0].get("token_ids") or []
    ]
    whole = post(engine, "/v1/chat/completions", chat(grammar=g, return_token_ids=True))
    assert ids == whole.json()["choices"][0]["token_ids"]  # every ID, exactly once


def _greedy_ids(s: Server, **kw: Any) -> list[int]:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 24,
        "temperature": 0,
        "return_token_ids": True,
        **kw,
    }
    r = post(s, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["choices"][0]["token_ids"]
    return ids


def test_logit_bias_bans_and_forces_tokens(engine: Server) -> None:
    first = _greedy_ids(engine, max_tokens=1)[0]
    banned = _greedy_ids(engine, max_tokens=1, logit_bias={str(first): -100})
    assert banned[0] != first
    forced = first + 7
    assert _greedy_ids(engine, max_tokens=3, logit_bias={str(forced): 100}) == [forced] * 3


def test_penalties_change_what_repeats(engine: Server) -> None:
    prompt = "one one one one one one one one one one one one"
    plain = _greedy_ids(engine, prompt=prompt)
    for field in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        penalized = _greedy_ids(engine, prompt=prompt, **{field: 2})
        # Each output token already said is pushed down: fewer repeats than greedy alone.
        assert len(set(penalized)) > len(set(plain)), (field, plain, penalized)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"10": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"echo": "yes"}, "echo"),
    ],
)
def test_sampling_fields_out_of_range_are_400(
    engine: Server, body: dict[str, Any], param: str
) -> None:
    r = post(engine, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_echo_puts_the_prompt_before_the_completion(engine: Server) -> None:
    body = {"prompt": "Q: what?", "max_tokens": 4, "echo": True, "grammar": 'root ::= " A."'}
    assert post(engine, "/v1/completions", body).json()["choices"][0]["text"] == "Q: what? A."
    fs = [
        f for f in frames(post(engine, "/v1/completions", body | {"stream": True})) if f != "[DONE]"
    ]
    assert fs[0]["choices"][0]["text"] == "Q: what?"
    assert "".join(f["choices"][0]["text"] for f in fs) == "Q: what? A."


def test_llama_server_flags_and_environment_variables(model_path: str, tmp_path: Path) -> None:
    import os

    keys = tmp_path / "keys"
    keys.write_text("file-key\n")
    os.environ.update(LEXI_ARG_ALIAS="envname", LEXI_ARG_CTX_SIZE="4096")
    try:
        s = start_engine(
            model_path,
            "-c",
            "1024",
            "-np",
            "2",
            "-t",
            "1",
            "-ngl",
            "0",
            "--metrics",
            "--no-webui",
            "--api-key-file",
            str(keys),
        )
    finally:
        del os.environ["LEXI_ARG_ALIAS"], os.environ["LEXI_ARG_CTX_SIZE"]
    try:
        auth = {"authorization": "Bearer file-key"}
        models = httpx.get(s.url + "/v1/models", headers=auth).json()["data"]
        assert models[0]["id"] == "envname"  # from the environment
        assert models[0]["meta"]["n_ctx"] == 512  # -c 1024 over the environment's 4096, 2 slots
        assert httpx.get(s.url + "/v1/models").status_code == 401  # the key file's key counts
    finally:
        s.stop()


def test_a_bad_environment_value_names_its_variable(model_path: str) -> None:
    env = {**__import__("os").environ, "LEXI_ARG_PARALLEL": "many"}
    p = subprocess.run(
        [str(BIN / "lexi-engine"), "serve", "-m", model_path],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 2
    assert "LEXI_ARG_PARALLEL" in p.stderr and "Traceback" not in p.stderr
    help_text = subprocess.run(
        [str(BIN / "lexi-engine"), "serve", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "LEXI_ARG_CTX_SIZE" in help_text and "-np" in help_text
