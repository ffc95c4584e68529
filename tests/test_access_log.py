"""Request IDs and the access log: an ID from the client (or a new one) is echoed, sent to
the engine and logged; one line per request, refusals included, as text or JSON."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support import Server, start_router, wait_until

pytestmark = pytest.mark.slow

CHAT = {"model": "main", "messages": [{"role": "user", "content": "hi"}]}


def config(scripted: Server) -> str:
    return (
        "listen: {port: $PORT}\nadmission: open\n"
        f"engines: [{{name: s, url: '{scripted.url}', dialect: lexi}}]\n"
    )


@pytest.fixture(scope="module")
def json_router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(tmp_path_factory.mktemp("j"), config(scripted), True, "--log-format", "json")
    yield r
    r.stop()


def access_lines(r: Server, request_id: str) -> list[dict[str, Any]]:
    for _ in range(50):  # the line is written as the request ends
        lines = [orjson.loads(line) for line in r.stderr().splitlines() if line.startswith("{")]
        found = [x for x in lines if x.get("request_id") == request_id]
        if found:
            return found
        time.sleep(0.05)
    return []


def test_the_client_s_request_id_is_echoed_sent_on_and_logged(
    json_router: Server, scripted: Server
) -> None:
    r = httpx.post(
        json_router.url + "/v1/chat/completions",
        json=CHAT,
        headers={"x-request-id": "trace-abc-123"},
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-abc-123"
    assert httpx.get(scripted.url + "/stats").json()["last_request_id"] == "trace-abc-123"
    (line,) = access_lines(json_router, "trace-abc-123")
    assert line["logger"] == "narwhal.access"
    assert line["msg"] == "POST /v1/chat/completions 200"
    assert line["engine"] == "s" and line["outcome"] == "completed"
    assert line["tokens_out"] == 4 and line["tokens_in"] == 1
    assert line["ms"] >= line["ttfb_ms"] >= 0


def test_a_request_without_an_id_gets_one_and_refusals_are_logged(json_router: Server) -> None:
    r = httpx.post(json_router.url + "/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    (line,) = access_lines(json_router, rid)
    assert line["msg"] == "POST /v1/chat/completions 400" and line["outcome"] == "invalid"
    bad = "x" * 200  # too long for an ID: replaced
    assert (
        httpx.post(
            json_router.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": bad}
        ).headers["x-request-id"]
        != bad
    )


def test_text_lines_carry_the_same_fields(scripted: Server, tmp_path_factory: Any) -> None:
    r = start_router(tmp_path_factory.mktemp("t"), config(scripted))
    try:
        httpx.post(r.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "t-1"})
        for _ in range(50):
            line = next((x for x in r.stderr().splitlines() if "request_id=t-1" in x), None)
            if line:
                break
            time.sleep(0.05)
        assert line is not None and "narwhal.access POST /v1/chat/completions 200" in line
        assert "engine=s" in line and "outcome=completed" in line
        # A client cannot write a line of its own: what it chose stays on its line, escaped.
        forged = "2026-12-05 10:00:00,000 INFO narwhal.access GET /admin/reload 200"
        httpx.get(
            r.url + "/x%0A" + forged.replace(" ", "%20") + "%0D%0Bz%E2%80%A8",
            headers={"x-request-id": "t-2"},
        )
        for _ in range(50):
            line = next((x for x in r.stderr().splitlines() if "request_id=t-2" in x), None)
            if line:
                break
            time.sleep(0.05)
        assert line is not None and "GET /x\\n" + forged + "\\r\\x0bz\\u2028 404" in line
        assert not any(x.startswith(forged) for x in r.stderr().splitlines())
    finally:
        r.stop()


def test_metrics_users_chart(json_router: Server) -> None:
    httpx.post(json_router.url + "/v1/chat/completions", json=CHAT)
    httpx.post(json_router.url + "/v1/chat/completions", content=b"{nope")
    m = httpx.get(json_router.url + "/metrics").text
    assert "_created" not in m
    route = 'model="main",route="/v1/chat/completions"'
    assert f'narwhal_responses_total{{code="200",{route}}}' in m
    assert f'narwhal_responses_total{{code="400",{route}}}' in m
    assert f'narwhal_request_duration_seconds_bucket{{le="600.0",{route}}}' in m
    assert 'narwhal_queue_time_seconds_count{model="main"}' in m
    assert 'narwhal_engine_healthy{engine="s"} 1.0' in m
    assert 'narwhal_info{model="main",version="' in m
    assert 'narwhal_time_to_first_byte_seconds_bucket{engine="s",le="600.0",model="main"}' in m


def test_a_json_line_stays_one_object_whatever_the_client_put_in_its_path(
    json_router: Server,
) -> None:
    httpx.get(
        json_router.url + "/x%0A%7B%22level%22:%22error%22%7D", headers={"x-request-id": "j-2"}
    )
    (line,) = access_lines(json_router, "j-2")
    assert line["msg"] == 'GET /x\n{"level":"error"} 404'
    assert not any(x.startswith('{"level":"error"}') for x in json_router.stderr().splitlines())


def test_the_line_says_what_placement_projected_beside_what_came(
    scripted: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    r = start_router(
        tmp_path_factory.mktemp("p"),
        "listen: {port: $PORT}\nadmission: predictive\npredictive: {ttft_budget_s: 2.0}\n"
        f"engines: [{{name: s, url: '{scripted.url}', dialect: lexi}}]\n",
        True,
        "--log-format",
        "json",
    )
    try:
        # The router's probe measures the engine first.
        wait_until(
            lambda: bool(
                httpx.get(r.url + "/ready").json()["engines"][0]["profile"]["prefill_tokens_per_s"]
            ),
            30,
        )
        got = httpx.post(
            r.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "why-here"}
        )
        assert got.status_code == 200
        (line,) = access_lines(r, "why-here")
        assert line["engine"] == "s" and line["due_ms"] == 2000.0
        # This engine answers at once: what matters is that the line says it was projected.
        assert line["projected_ms"] >= line["own_ms"] >= 0 and line["tokens_sized"] >= 1
        assert line["cached_expected"] == 0
    finally:
        r.stop()
