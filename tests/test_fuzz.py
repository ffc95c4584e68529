"""Fuzzed request intake of both programs: whatever a client sends is a request or a 4xx in
the OpenAI envelope, never an unhandled exception (a bare 500).

In process (bounded example counts, no clock): the router's `intake.check` and the
millisecond headers; LexiEngine's chat, completion and responses intake on the real model.
Over HTTP, a smaller batch through the real router checks the envelope end to end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.errors import ApiError
from tests.support import Server, start_router

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=25,
)

CHAT_KEYS = (
    "model",
    "messages",
    "stream",
    "n",
    "best_of",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "grammar",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "stream_options",
    "chat_template_kwargs",
    "reasoning_effort",
    "audio",
    "modalities",
    "cache_prompt",
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(
            st.sampled_from(["user", "assistant", "system", "tool", "developer"]), JSON
        ),
        "content": st.one_of(
            st.text(max_size=30),
            JSON,
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.just("text"), "text": st.one_of(st.text(), JSON)}
                ),
                max_size=3,
            ),
        ),
        "tool_calls": JSON,
        "tool_call_id": JSON,
        "name": JSON,
        "reasoning_content": JSON,
    },
)


def _body(keys: tuple[str, ...], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda extra, picked: {**base, **dict(picked), **extra},
        st.dictionaries(st.sampled_from(keys), JSON, max_size=4),
        st.lists(st.tuples(st.sampled_from(keys), JSON), max_size=2),
    )


CHAT_BODIES = st.one_of(
    _body(CHAT_KEYS, {}),
    st.builds(
        lambda msgs, rest: {**rest, "messages": msgs},
        st.lists(MESSAGE, max_size=3),
        _body(CHAT_KEYS, {}),
    ),
)
# Tools whose schemas are anything JSON: the keys a schema has, with values of any shape.
SCHEMA = st.dictionaries(
    st.sampled_from(
        ["type", "properties", "required", "$defs", "anyOf", "oneOf", "items", "enum", "$ref"]
    ),
    JSON,
    max_size=4,
)
TOOL_BODIES = st.builds(
    lambda params, strict, deep: {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": "[" * deep + "]" * deep},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "strict": strict, "parameters": params}}
        ],
    },
    st.one_of(SCHEMA, st.builds(lambda p: {"type": "object", **p}, SCHEMA)),
    st.booleans(),
    st.sampled_from([0, 3, 254, 300, 1000]),
)
COMPLETION_BODIES = _body((*CHAT_KEYS, "prompt", "echo", "suffix"), {"prompt": "hi"})
RESPONSES_BODIES = _body(
    (
        "input",
        "instructions",
        "max_output_tokens",
        "stream",
        "model",
        "previous_response_id",
        "temperature",
        "text",
        "tools",
    ),
    {"input": "hi"},
)


def _refusal_or_nothing(call: Any) -> None:
    try:
        call()
    except ApiError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        env = e.envelope()["error"]
        assert set(env) == {"message", "type", "param", "code"}


# -- the router ---------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"]),
    body=st.one_of(CHAT_BODIES, COMPLETION_BODIES, RESPONSES_BODIES, JSON),
)
def test_router_intake_never_raises_anything_but_a_4xx(route: str, body: Any) -> None:
    from narwhal.router.pipeline import intake

    raw = json.dumps(body).encode()
    _refusal_or_nothing(lambda: intake.check(route, raw, "main"))


@settings(max_examples=200, deadline=None)
@given(
    raw=st.binary(max_size=200), route=st.sampled_from(["/v1/chat/completions", "/v1/responses"])
)
def test_router_intake_takes_any_bytes(raw: bytes, route: str) -> None:
    from narwhal.router.pipeline import intake

    _refusal_or_nothing(lambda: intake.check(route, raw, "main"))


@settings(max_examples=300, deadline=None)
@given(
    answer=st.one_of(
        st.binary(max_size=200),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.lists(st.one_of(JSON, st.fixed_dictionaries({"id": JSON})), max_size=8).map(
            lambda items: json.dumps({"data": items}).encode()
        ),
    )
)
def test_an_engines_model_list_is_read_or_refused_never_anything_else(answer: bytes) -> None:
    """`models: auto` reads what an engine's /v1/models says: model names it could be
    configured with, or a ValueError (the last list kept), whatever the engine sends."""
    from narwhal.router.engines import MODEL, listed_models

    try:
        names = listed_models(answer)
    except ValueError:
        return
    assert all(MODEL.fullmatch(n) for n in names)
    for said in names.values():
        assert all(isinstance(v, (str, int, float)) for v in said.values())


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.none(), st.text(max_size=200), st.binary(max_size=200)))
def test_any_request_id_is_kept_or_replaced_by_a_safe_one(value: Any) -> None:
    from narwhal import asgi

    raw = value.encode("utf-8", "replace") if isinstance(value, str) else value
    scope = {"headers": [] if raw is None else [(b"x-request-id", raw)]}
    rid = asgi.begin(scope).id
    # It goes into a header line to the engine: no spaces, no controls, bounded.
    assert 0 < len(rid) <= 128 and all(33 <= ord(c) < 127 for c in rid)


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.text(max_size=500), st.from_regex(r"-?[0-9]{1,600}", fullmatch=True)))
def test_millisecond_headers_are_a_number_or_a_400(value: str) -> None:
    from narwhal.router.pipeline.read import ms_header

    scope = {"headers": [(b"x-narwhal-timeout-ms", value.encode("utf-8", "replace"))]}
    _refusal_or_nothing(lambda: ms_header(scope, b"x-narwhal-timeout-ms"))


@pytest.fixture(scope="module")
def router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(
        tmp_path_factory.mktemp("fuzz"),
        f"""
listen: {{port: $PORT}}
admission: open
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    yield r
    r.stop()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(CHAT_BODIES, JSON), stream=st.booleans())
def test_router_over_http_answers_in_the_envelope(router: Server, body: Any, stream: bool) -> None:
    if isinstance(body, dict) and "messages" in body:
        body = {**body, "stream": stream}
    r = httpx.post(
        router.url + "/v1/chat/completions", timeout=30, content=json.dumps(body).encode()
    )
    assert r.status_code < 500 or r.status_code in (502, 503, 504), r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- LexiEngine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lexi(model_path: str) -> Any:
    from narwhal.engine.config import EngineConfig
    from narwhal.engine.model import Model

    config = EngineConfig(model=model_path, threads=1, ctx_size=2048)
    return config, Model(config)


@pytest.mark.slow
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(CHAT_BODIES, TOOL_BODIES))
def test_engine_chat_intake_never_raises_anything_but_a_4xx(lexi: Any, body: Any) -> None:
    from narwhal.engine import routes

    config, model = lexi
    _refusal_or_nothing(lambda: routes.JOBS["/v1/chat/completions"](body, config, model))


@pytest.mark.slow
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(COMPLETION_BODIES, RESPONSES_BODIES), which=st.booleans())
def test_engine_completion_and_responses_intake(lexi: Any, body: Any, which: bool) -> None:
    from narwhal.engine import routes

    config, model = lexi
    job = routes.JOBS["/v1/completions" if which else "/v1/responses"]
    _refusal_or_nothing(lambda: job(body, config, model))


@pytest.fixture(scope="module")
def lexi_server(model_path: str) -> Iterator[Server]:
    from tests.support import start_engine

    e = start_engine(model_path)
    yield e
    e.stop()


@pytest.mark.slow
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(CHAT_BODIES, TOOL_BODIES, JSON), stream=st.booleans())
def test_engine_over_http_answers_in_the_envelope(
    lexi_server: Server, body: Any, stream: bool
) -> None:
    if isinstance(body, dict) and "messages" in body:
        body = {**body, "stream": stream, "max_tokens": 4}
    r = httpx.post(
        lexi_server.url + "/v1/chat/completions", timeout=60, content=json.dumps(body).encode()
    )
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
