"""OpenTelemetry traces (`telemetry:` in the router, `--otlp-endpoint` in LexiEngine): one
request is one trace from the client through the router into the engine, received over
OTLP/HTTP and decoded with opentelemetry-proto, as a collector would."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.otlp_receiver import Receiver, Span
from tests.support import Server, chat, start_engine, start_router, start_test_engine

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    r = Receiver()
    # The processes started in the test send their batch every 100 ms, not every 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    yield r
    r.close()


def router_config(engine: str, receiver: Receiver, extra: str = "") -> str:
    return (
        "model: main\nlisten: {port: $PORT}\nadmission: predictive\n"
        "predictive: {ttft_budget_s: 30}\nhealth: {interval_s: 0.2}\n"
        f"telemetry: {{otlp_endpoint: '{receiver.url}', service_name: front{extra}}}\n"
        f"engines:\n  - {{name: e0, url: '{engine}', dialect: lexi}}\n"
    )


def client_parent() -> tuple[str, str, str]:
    """A client's own trace and span IDs, and the `traceparent` that names them, sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def of_request(spans: list[Span], rid: str) -> list[Span]:
    """The router's spans of the request with this ID (its own span names it)."""
    roots = [s for s in spans if s.attributes.get("narwhal.request_id") == rid]
    if not roots:
        return []
    root = roots[0]
    return [root, *(s for s in spans if s.parent_id == root.span_id)]


def series(scrape: str, name: str) -> float:
    line = next(x for x in scrape.splitlines() if x.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def named(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


@pytest.mark.slow
def test_a_streamed_request_is_one_trace_through_router_and_engine(
    model_path: str, receiver: Receiver, tmp_path: Path
) -> None:
    engine = start_engine(model_path, "--alias", "main", "--otlp-endpoint", receiver.url)
    router = start_router(tmp_path, router_config(engine.url, receiver))
    try:
        # The router measures the engine before it projects a TTFT there.
        for _ in range(3):
            warm = httpx.post(
                router.url + "/v1/chat/completions", json=chat("Hi", max_tokens=8), timeout=60
            )
            assert warm.status_code == 200
        trace_id, client_span, parent = client_parent()
        with httpx.stream(
            "POST",
            router.url + "/v1/chat/completions",
            json=chat("Say hi", max_tokens=8, stream=True),
            headers={"traceparent": parent},
            timeout=60,
        ) as r:
            assert r.status_code == 200
            body = r.read()
        assert b"[DONE]" in body
        rid = r.headers["x-request-id"]

        def whole(spans: list[Span]) -> bool:
            mine = [s for s in spans if s.trace_id == trace_id]
            return {"relay", "decode"} <= {s.name for s in mine} and bool(of_request(spans, rid))

        spans = [s for s in receiver.wait_for(whole) if s.trace_id == trace_id]
        # What the dashboard draws beside them: the prompt tokens the engine's cache served
        # (the warm-ups repeat one prompt) and the budget the TTFT is held to.
        scrape = httpx.get(router.url + "/metrics", timeout=10).text
        assert series(scrape, 'narwhal_prompt_tokens_total{engine="e0",model="main"}') > 0
        assert series(scrape, 'narwhal_cached_prompt_tokens_total{engine="e0",model="main"}') > 0
        assert series(scrape, 'narwhal_target_seconds{target="ttft"}') == 30
    finally:
        router.stop()
        engine.stop()
    front = [s for s in spans if s.service == "front"]
    back = [s for s in spans if s.service == "lexi-engine"]
    # The router's span continues the client's trace; its stages are its children.
    root = named(front, "POST /v1/chat/completions")
    assert root.kind == SERVER and root.parent_id == client_span
    children = {s.name: s for s in front if s.parent_id == root.span_id}
    assert {"intake", "placement", "queue", "upstream", "relay"} <= set(children)
    a = root.attributes
    assert a["narwhal.request_id"] == rid and a["narwhal.outcome"] == "completed"
    assert a["narwhal.engine"] == "e0" and a["gen_ai.request.model"] == "main"
    assert a["narwhal.priority"] == "standard"
    assert a["narwhal.ttft.projected_ms"] > 0 and a["narwhal.ttft.measured_ms"] > 0
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
    assert "narwhal.tokens.cached" in a and root.error is None
    # What placement weighed and chose is the placement span's.
    placement = children["placement"]
    assert placement.attributes["narwhal.choice"] == "e0" and placement.attributes["narwhal.why"]
    assert [e for e, _ in placement.events] == ["candidate"]
    assert placement.events[0][1]["engine"] == "e0"
    upstream = children["upstream"]
    assert upstream.kind == CLIENT
    assert [e for e, _ in upstream.events][:1] == ["first_token"]
    # The engine's span is the upstream call's child: the router's traceparent named it.
    serve = named(back, "POST /v1/chat/completions")
    assert serve.kind == SERVER and serve.parent_id == upstream.span_id
    stages = {s.name: s for s in back if s.parent_id == serve.span_id}
    assert {"render", "queue", "prefill", "decode"} <= set(stages)
    assert stages["prefill"].end_ns <= stages["decode"].start_ns + 1_000_000
    assert serve.attributes["gen_ai.usage.output_tokens"] == a["gen_ai.usage.output_tokens"]
    assert serve.attributes["http.response.status_code"] == 200


@pytest.fixture
def scripted_router(
    receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Server, Server]]:
    engine = start_test_engine("tests.scripted_engine")
    router = start_router(
        tmp_path,
        router_config(engine.url, receiver).replace(
            "service_name: front}", "service_name: front, sample_ratio: 0}"
        ),
    )
    yield router, engine
    router.stop()
    engine.stop()


def test_a_sampled_parent_is_traced_whatever_the_ratio_and_the_call_names_its_span(
    receiver: Receiver, scripted_router: tuple[Server, Server]
) -> None:
    router, engine = scripted_router
    # Sampled at 0: a request without a parent passes an unsampled trace on, records none.
    quiet = httpx.post(router.url + "/v1/chat/completions", json=chat("a"), timeout=30)
    assert quiet.status_code == 200
    unsampled = httpx.get(engine.url + "/stats", timeout=10).json()["last_traceparent"]
    assert unsampled is not None and int(unsampled[-2:], 16) & 1 == 0  # not sampled
    trace_id, client_span, parent = client_parent()
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json=chat("b"),
        headers={"traceparent": parent},
        timeout=30,
    )
    assert r.status_code == 200
    sent = httpx.get(engine.url + "/stats", timeout=10).json()["last_traceparent"]
    rid = r.headers["x-request-id"]
    spans = receiver.wait_for(lambda s: "upstream" in {x.name for x in of_request(s, rid)})
    mine = of_request(spans, rid)
    assert mine[0].trace_id == trace_id and mine[0].parent_id == client_span
    upstream = named(mine, "upstream")
    assert sent[:-2] == f"00-{trace_id}-{upstream.span_id}-" and int(sent[-2:], 16) & 1
    # The spans come in the order requests ended: the unsampled one's would be here by now.
    assert of_request(spans, quiet.headers["x-request-id"]) == []


# What a client may send as its `traceparent` that is not one (W3C trace context).
NOT_PARENTS = [
    b"garbage",
    b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01",  # an all-zero trace ID is invalid
    b"ff-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01",  # version ff is invalid
    b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01-" + b"x" * 4000,
    "\u00e9".encode() * 64,
]


def test_a_traceparent_that_is_not_one_starts_a_trace_of_its_own(
    receiver: Receiver, tmp_path: Path
) -> None:
    engine = start_test_engine("tests.scripted_engine")
    router = start_router(tmp_path, router_config(engine.url, receiver))
    try:
        ids = []
        for parent in NOT_PARENTS:
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json=chat("c"),
                headers=[(b"traceparent", parent)],
                timeout=30,
            )
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])
        spans = receiver.wait_for(lambda s: all(of_request(s, rid) for rid in ids))
    finally:
        router.stop()
        engine.stop()
    for parent, rid in zip(NOT_PARENTS, ids, strict=True):
        root = of_request(spans, rid)[0]
        assert root.parent_id == "" and root.trace_id.encode() not in parent


@pytest.mark.slow
def test_the_engine_traces_each_tool_call_it_checks(model_path: str, receiver: Receiver) -> None:
    from tests.test_tools import ASK, CALL, TOOLS, forced

    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": 7}}</tool_call>'
    engine = start_engine(model_path, "--alias", "main", "--otlp-endpoint", receiver.url)
    try:
        trace_id, client_span, parent = client_parent()
        r = httpx.post(
            engine.url + "/v1/chat/completions",
            json={"messages": ASK, "tools": TOOLS, "grammar": forced(CALL + " " + bad)},
            headers={"traceparent": parent},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1

        def checked(spans: list[Span]) -> bool:
            mine = [s for s in spans if s.trace_id == trace_id]
            return any(s.name == "POST /v1/chat/completions" for s in mine)

        spans = [s for s in receiver.wait_for(checked) if s.trace_id == trace_id]
    finally:
        engine.stop()
    serve = named(spans, "POST /v1/chat/completions")
    assert serve.parent_id == client_span
    checks = [s for s in spans if s.name == "verify_tool_call"]
    assert all(s.parent_id == serve.span_id for s in checks)
    # The valid call names its tool; the one whose arguments break the schema failed.
    found = {(s.attributes.get("gen_ai.tool.name", ""), s.error or "") for s in checks}
    assert found == {("", "not a valid call of the offered tools"), ("get_weather", "")}
    assert len(checks) == 2


@pytest.mark.slow
def test_an_engine_the_router_launches_sends_its_spans_where_the_router_does(
    model_path: str, receiver: Receiver, tmp_path: Path
) -> None:
    router = start_router(
        tmp_path,
        "model: main\nlisten: {port: $PORT}\n"
        f"telemetry: {{otlp_endpoint: '{receiver.url}'}}\n"
        "engines:\n  - name: local\n"
        f"    launch: {{model: {model_path}, parallel: 1, args: ['--ctx-size', '512']}}\n",
    )
    try:
        r = httpx.post(
            router.url + "/v1/chat/completions", json=chat("Hi", max_tokens=4), timeout=60
        )
        assert r.status_code == 200
        rid = r.headers["x-request-id"]

        def joined(spans: list[Span]) -> bool:
            mine = of_request(spans, rid)
            calls = {s.span_id for s in mine if s.name == "upstream"}
            return any(s.service == "lexi-engine" and s.parent_id in calls for s in spans)

        receiver.wait_for(joined)
    finally:
        router.stop()
