"""The router against a scripted engine over real HTTP/SSE: refusals, relay, assembly."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from narwhal.router.relay.relayer import WARN_AWAITED, Relayer
from tests.support import (
    ROUTER_CONFIG,
    Server,
    chat,
    leave_before_first_byte,
    refused_config,
    relayed_streams,
    sse_frames,
    start_router,
    stats,
    wait_idle,
    wait_ready,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(tmp_path_factory.mktemp("r"), ROUTER_CONFIG.replace("URL", scripted.url))
    yield r
    r.stop()


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        (b"[1,2]", 400, None, None),
        (orjson.dumps({"model": "main"}), 400, "messages", None),
        (orjson.dumps(chat("x", stream="yes")), 400, "stream", None),
        (orjson.dumps(chat("x", model="other")), 404, "model", "model_not_found"),
        (orjson.dumps(chat("x", n=2)), 400, "n", None),
        (orjson.dumps(chat("x", audio={"voice": "a"})), 400, "audio", None),
        (orjson.dumps(chat("x", modalities=["text", "audio"])), 400, "modalities", None),
        (
            orjson.dumps(chat("x", tools=[{"type": "custom", "custom": {}}])),
            400,
            "tools[0].type",
            None,
        ),
        (orjson.dumps(chat("x" * 5000)), 413, None, "request_too_large"),
        # orjson reads 1,024 levels but writes 255: this once failed after placement (500).
        (
            orjson.dumps(chat("x", extra=[1])).replace(b"[1]", b"[" * 300 + b"]" * 300),
            400,
            None,
            None,
        ),
        (orjson.dumps(chat("x")).replace(b'"x"', b"[" * 500 + b"]" * 500), 400, None, None),
    ],
)
def test_refusals_use_the_envelope_and_never_reach_the_engine(
    router: Server, scripted: Server, body: bytes, status: int, param: str | None, code: str | None
) -> None:
    before = stats(scripted)["requests"]
    r = httpx.post(router.url + "/v1/chat/completions", content=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    if code:
        assert err["code"] == code
    assert stats(scripted)["requests"] == before


@pytest.mark.parametrize("header", ["x-narwhal-timeout-ms", "x-narwhal-ttft-target-ms"])
def test_a_400_digit_millisecond_header_is_no_500(router: Server, header: str) -> None:
    r = httpx.post(
        router.url + "/v1/chat/completions", json=chat("hi"), headers={header: "9" * 400}
    )
    assert r.status_code == 200, r.text  # longer than any timeout: the configured one holds
    r = httpx.post(
        router.url + "/v1/chat/completions", json=chat("hi"), headers={header: "-" + "9" * 400}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == header


def test_content_parts_nested_deep_are_no_500(router: Server) -> None:
    part: object = "x"
    for _ in range(200):  # under the JSON depth limit, far over any real message
        part = [{"type": "text", "text": part}]
    r = httpx.post(
        router.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": part}]}
    )
    assert r.status_code < 500, r.text


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("POST", "/v1/embeddings", 404, None),  # unknown routes: 404, whatever the method
        ("POST", "/tokenize", 404, None),
        ("GET", "/nope", 404, None),
        ("POST", "/health", 405, "GET"),  # known routes, wrong method: 405 naming the right one
        ("DELETE", "/metrics", 405, "GET"),
        ("GET", "/v1/chat/completions", 405, "POST"),
    ],
)
def test_unknown_routes_are_404_and_wrong_methods_405_with_allow(
    router: Server, method: str, path: str, status: int, allow: str | None
) -> None:
    r = httpx.request(method, router.url + path)
    assert r.status_code == status
    assert r.headers.get("allow") == allow
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_every_refusal_counter_is_exported_from_the_start(tmp_path: Path, scripted: Server) -> None:
    r = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    try:
        m = httpx.get(r.url + "/metrics").text
    finally:
        r.stop()
    for series in (
        'narwhal_refused_total{model="main",reason="ttft_budget_exceeded"} 0.0',
        'narwhal_refused_total{model="main",reason="prompt_exceeds_ttft_budget"} 0.0',
        'narwhal_rejected_total{model="main",reason="queue_full"} 0.0',
        'narwhal_rejected_total{model="main",reason="retention"} 0.0',
    ):
        assert series in m


def test_assembled_usage_counts_the_engine_s_prompt_ids(router: Server) -> None:
    """No usage from the engine, but its prompt token IDs: those are the prompt's length,
    not the router's byte estimate (55 bytes: 13; the engine counted 3)."""
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": "x" * 40},
                {"role": "user", "content": "script:no_usage"},
            ]
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_best_of_is_an_invalid_sampling_width(router: Server) -> None:
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "best_of": 3})
    assert r.status_code == 400
    assert "Invalid sampling width" in r.json()["error"]["message"]


def test_streaming_strips_token_ids_unless_asked(router: Server, scripted: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("hi", stream=True))
    assert r.status_code == 200
    frames = sse_frames(r.text)
    assert frames[-1] == "[DONE]"
    assert (
        "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1]) == "w0 w1 w2 w3 "
    )
    assert "token_ids" not in r.text
    last = stats(scripted)["last"]
    assert last["return_token_ids"] is True and last["stream_interval"] == 1

    r = httpx.post(
        router.url + "/v1/chat/completions", json=chat("hi", stream=True, return_token_ids=True)
    )
    frames = sse_frames(r.text)
    assert frames[0]["prompt_token_ids"] == [0]  # "hi": the scripted engine counts 4 bytes a token
    assert [i for f in frames[1:-1] for i in f["choices"][0]["token_ids"]] == [100, 101, 102, 103]


def test_streams_are_relayed_natively_on_granian(router: Server) -> None:
    """Granian's send does its work in the call, so streams go from the engine's socket to
    the client in Rust. Were that capability missed (a Granian change, say), every stream
    would fall back to a Python send per read, and this fails."""
    before = relayed_streams(router)
    for _ in range(3):  # paced: more than the first read (which is always awaited)
        body = chat("script:paced:5:10", stream=True)
        r = httpx.post(router.url + "/v1/chat/completions", json=body)
        assert sse_frames(r.text)[-1] == "[DONE]"
    after = relayed_streams(router)
    assert after["native"] - before["native"] == 3
    assert after["awaited"] == before["awaited"]


def test_a_stream_whose_head_waited_does_not_say_the_server_cannot_relay_natively(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Granian's send waits now and then (its channel to a slow client is full), and that
    stream is relayed from Python: the warning that the server's send must always be
    awaited is for a server none of whose streams went natively (every bench router said
    it, at 6 streams of 148 awaited)."""
    counted: list[str] = []
    granian, other = Relayer(count_path=counted.append), Relayer(count_path=counted.append)
    with caplog.at_level(logging.WARNING, logger="narwhal.relay"):
        granian.count_path("native")
        for _ in range(2 * WARN_AWAITED):
            granian.warn_not_native()
            granian.count_path("awaited")
        assert not caplog.records
        for _ in range(2 * WARN_AWAITED):  # uvicorn, say: its send is a coroutine
            other.warn_not_native()
            other.count_path("awaited")
    assert ["must be awaited" in r.getMessage() for r in caplog.records] == [True]
    assert counted.count("native") == 1 and counted.count("awaited") == 4 * WARN_AWAITED


def test_usage_is_streamed_only_to_clients_that_ask(router: Server, scripted: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("hi", stream=True))
    assert '"usage"' not in r.text and sse_frames(r.text)[-1] == "[DONE]"
    # The router asked anyway: usage carries the engine's cached-prompt count.
    assert stats(scripted)["last"]["stream_options"] == {"include_usage": True}
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json=chat("hi", stream=True, stream_options={"include_usage": True}),
    )
    (usage,) = [f["usage"] for f in sse_frames(r.text)[:-1] if f.get("usage")]
    assert usage["completion_tokens"] == 4


@pytest.mark.parametrize("script", ["missing_ids", "bool_ids"])
def test_bad_token_ids_end_the_stream_with_a_visible_error(router: Server, script: str) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat(f"script:{script}", stream=True))
    frames = sse_frames(r.text)
    assert "error" in frames[-1]
    assert "[DONE]" not in frames
    metrics = httpx.get(router.url + "/metrics").text
    reason = "missing_token_ids" if script == "missing_ids" else "boolean_token_id"
    assert f'reason="{reason}"' in metrics


def test_non_streaming_assembly(router: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("script:echo:6"))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 w5 "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 6
    assert "token_ids" not in body["choices"][0]

    r = httpx.post(
        router.url + "/v1/chat/completions", json=chat("script:reasoning", return_token_ids=True)
    )
    msg = r.json()["choices"][0]
    assert msg["message"]["reasoning_content"] == "hmm"
    assert msg["message"]["content"] == "ok"
    assert msg["token_ids"] == [3, 4]
    assert r.json()["prompt_token_ids"] == [0, 1, 2, 3]  # 16 bytes


def test_non_streaming_tool_calls_and_completions(router: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("script:tools"))
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_0", "f", '{"a": 1}'),
        ("call_1", "g", '{"a": 1}'),
    ]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"

    r = httpx.post(router.url + "/v1/completions", json={"prompt": "script:echo:3"})
    assert r.json()["object"] == "text_completion"
    assert r.json()["choices"][0]["text"] == "w0 w1 w2 "


def test_unassemblable_engine_output_is_502_naming_the_field(router: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("script:audio"))
    assert r.status_code == 502
    assert r.json()["error"]["param"] == "choices[0].delta.audio"


def test_engine_refusal_is_passed_through(router: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("script:status:400"))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "engine says no"


def test_deadline_before_headers_is_504(router: Server) -> None:
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json=chat("script:slow_first:2000", stream=True),
        headers={"x-narwhal-timeout-ms": "300"},
    )
    assert r.status_code == 504
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json=chat("x"),
        headers={"x-narwhal-timeout-ms": "soon"},
    )
    assert r.status_code == 400


def test_client_disconnect_cancels_upstream(router: Server, scripted: Server) -> None:
    before = stats(scripted)["disconnects"]
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json=chat("script:hang", stream=True),
        timeout=10,
    ) as r:
        for _ in r.iter_bytes():
            break
    end = time.monotonic() + 5
    while stats(scripted)["disconnects"] == before and time.monotonic() < end:
        time.sleep(0.05)
    assert stats(scripted)["disconnects"] == before + 1
    wait_idle(router)


def test_client_gone_before_first_byte_cancels_at_once(router: Server) -> None:
    """The engine takes 8 s to its first token; the router lets go when the client does."""
    leave_before_first_byte(router.url, "script:slow_first:8000")
    wait_idle(router, within=3)


def test_upstream_connections_are_kept_alive_across_requests(
    router: Server, scripted: Server
) -> None:
    before = stats(scripted)["connections"]
    for i in range(6):
        stream = i % 2 == 0
        r = httpx.post(
            router.url + "/v1/chat/completions", json=chat("script:echo:3", stream=stream)
        )
        assert r.status_code == 200
        assert (
            ("w2 " in r.text)
            if stream
            else r.json()["choices"][0]["message"]["content"] == "w0 w1 w2 "
        )
    # Sequential requests ride one kept-alive connection (at most one new one here).
    assert stats(scripted)["connections"] - before <= 1


def test_engine_death_mid_stream_ends_with_an_error(router: Server) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("script:die", stream=True))
    frames = sse_frames(r.text)
    assert frames[-1]["error"]["code"] == "engine_disconnected"
    wait_ready(router)
    wait_idle(router)


def test_unhealthy_engine_means_503_backend_unavailable(router: Server, scripted: Server) -> None:
    httpx.post(scripted.url + "/health", json={"healthy": False})
    try:
        end = time.monotonic() + 5
        while httpx.get(router.url + "/ready").status_code != 503:
            assert time.monotonic() < end
            time.sleep(0.05)
        r = httpx.post(router.url + "/v1/chat/completions", json=chat("x"))
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "backend_unavailable"
    finally:
        httpx.post(scripted.url + "/health", json={"healthy": True})
    wait_ready(router)


def test_ready_and_models_and_counters(router: Server) -> None:
    ready = httpx.get(router.url + "/ready").json()
    assert ready["engines"][0]["token_accounting"] == "token_ids"
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "main"
    m = httpx.get(router.url + "/metrics").text
    for name in (
        "narwhal_offered_total",
        "narwhal_invalid_requests_total",
        "narwhal_time_to_first_byte_seconds",
    ):
        assert name in m


def test_openai_sdk_works_unchanged(router: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model="main", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "w0 w1 w2 w3 "
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="main", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        if c.choices
    )
    assert text == "w0 w1 w2 w3 "
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])


def test_bad_config_is_refused_with_its_path(tmp_path: Path) -> None:
    stderr = refused_config(
        tmp_path, "engines:\n  - name: a\n    url: http://x\n    dialect: nope\nqueue: {size: -1}\n"
    )
    assert "engines.0.dialect" in stderr and "queue.size" in stderr


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "engines:\n  - {name: a, url: 'http://x', launch: {model: m.gguf}}\n",
            "engines.0: give `url` (an engine to call) or `launch` (a LexiEngine to run), not both",
        ),
        ("engines:\n  - {name: a}\n", "engines.0: give `url`"),
        ("engines: [{name: a, url: 'http://x'}\nqueue: {size: 1}\n", "bad.yaml:2:"),
    ],
)
def test_config_errors_are_in_plain_words_with_the_file(
    tmp_path: Path, text: str, says: str
) -> None:
    stderr = refused_config(tmp_path, text)
    assert says in stderr, stderr
    assert "oneOf" not in stderr and "<unicode string>" not in stderr


def _cpus(pid: int) -> set[str]:
    """The CPU lists (`Cpus_allowed_list`) of every thread of `pid` and its descendants."""
    family, grew = {pid}, True
    while grew:
        grew = False
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) not in family:
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                if ppid in family:
                    family.add(int(d.name))
                    grew = True
    out = set()
    for p in family:
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                status = (t / "status").read_text()
                out.add(status.split("Cpus_allowed_list:")[1].split()[0])
        except OSError:  # a thread or process that ended meanwhile
            continue
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_router_keeps_to_one_cpu_unless_told(
    router: Server, scripted: Server, tmp_path: Path
) -> None:
    mine = os.sched_getaffinity(0)
    # Default (auto): every thread of the router, Granian's included, on one CPU.
    assert _cpus(router.proc.pid) == {str(max(mine))}
    listed = f"{min(mine)}-{max(mine)}" if len(mine) == max(mine) - min(mine) + 1 else None
    free = start_router(
        tmp_path,
        ROUTER_CONFIG.replace("URL", scripted.url).replace(
            "request_timeout_s: 30}", "request_timeout_s: 30, cpu_affinity: none}"
        ),
    )
    try:
        assert httpx.get(free.url + "/ready").status_code == 200
        if listed:
            assert _cpus(free.proc.pid) == {listed}
    finally:
        free.stop()
    chosen = start_router(
        tmp_path,
        ROUTER_CONFIG.replace("URL", scripted.url).replace(
            "request_timeout_s: 30}", f"request_timeout_s: 30, cpu_affinity: [{min(mine)}]}}"
        ),
    )
    try:
        assert _cpus(chosen.proc.pid) == {str(min(mine))}
    finally:
        chosen.stop()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("[4096]", "serving.cpu_affinity: CPU 4096 is not available"),
        ("sometimes", "serving.cpu_affinity"),
        ("[]", "serving.cpu_affinity"),
    ],
)
def test_bad_cpu_affinity_is_refused(tmp_path: Path, value: str, says: str) -> None:
    stderr = refused_config(
        tmp_path,
        f"serving: {{cpu_affinity: {value}}}\nengines:\n  - name: a\n    url: http://127.0.0.1:9\n",
    )
    assert says in stderr


def test_the_config_reference_is_in_step_with_the_schema() -> None:
    """A clone has docs/CONFIG.md for the config keys: it is what the schema generates
    (every key, with its type and default), and the README points to it."""
    from narwhal.router.config_doc import render

    root = Path(__file__).resolve().parent.parent
    assert (root / "docs" / "CONFIG.md").read_text() == render(), (
        "regenerate: python -m narwhal.router.config_doc > docs/CONFIG.md"
    )
    assert "docs/CONFIG.md" in (root / "README.md").read_text()


def test_a_model_is_retrieved_by_id(router: Server) -> None:
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=router.url + "/v1", api_key="x")
    assert client.models.retrieve("main").id == "main"
    with pytest.raises(NotFoundError):
        client.models.retrieve("other")
    r = httpx.get(router.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
