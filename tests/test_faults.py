"""What a misbehaving engine can do to the router: end one request, never the router.

Runs the real router in front of `tests.faulty_engine`, which breaks HTTP on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.faulty_engine import BAD_HEADS
from tests.support import Server, start_router, start_test_engine


@pytest.fixture(scope="module")
def faulty() -> Iterator[Server]:
    s = start_test_engine("tests.faulty_engine")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router(faulty: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(
        tmp_path_factory.mktemp("faults"),
        f"""
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 0.1}}
serving: {{stream_idle_timeout_s: 1}}
engines: [{{name: f, url: "{faulty.url}", dialect: openai}}]
""",
    )
    yield r
    r.stop()


def _ready(url: str) -> None:
    """A fault is a strike against the engine; the next probe brings it back."""
    for _ in range(100):
        if httpx.get(url + "/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not come back")


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("fault", [*BAD_HEADS, "ssh_banner"])
def test_a_malformed_engine_head_is_a_502_for_that_request_alone(
    router: Server, fault: str, stream: bool
) -> None:
    _ready(router.url)
    r = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": f"fault:{fault}"}], "stream": stream},
    )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "engine_failed"
    assert router.proc.poll() is None  # the router lives
    _ready(router.url)
    ok = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hello"}]},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi"


def _inflight_zero(url: str) -> bool:
    m = httpx.get(url + "/metrics").text
    lines = [
        ln for ln in m.splitlines() if ln.startswith(("narwhal_inflight{", "narwhal_retained "))
    ]
    return bool(lines) and all(ln.endswith(" 0.0") for ln in lines)


def test_an_engine_that_goes_quiet_mid_stream_ends_that_stream(router: Server) -> None:
    _ready(router.url)
    body = {"messages": [{"role": "user", "content": "fault:stall_after_first"}]}
    r = httpx.post(router.url + "/v1/chat/completions", timeout=30, json=body | {"stream": True})
    assert r.status_code == 200
    assert '"content":"hi"' in r.text  # the token it had
    assert r.text.rstrip().endswith('"code":"engine_stalled"}}')  # then the end, in an event
    _ready(router.url)
    whole = httpx.post(router.url + "/v1/chat/completions", timeout=30, json=body)
    assert whole.status_code == 502 and whole.json()["error"]["code"] == "engine_failed"
    assert _inflight_zero(router.url)
    m = httpx.get(router.url + "/metrics").text
    assert 'narwhal_stream_faults_total{engine="f",reason="engine_stalled"} 2.0' in m


@pytest.mark.parametrize("stream", [True, False])
def test_bytes_after_a_whole_answer_do_not_spoil_it(router: Server, stream: bool) -> None:
    _ready(router.url)
    r = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "fault:trailing_bytes"}], "stream": stream},
    )
    assert r.status_code == 200, r.text
    if stream:
        assert '"content":"hi"' in r.text and r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["message"]["content"] == "hi"


def test_the_worker_survived_every_fault(router: Server) -> None:
    assert router.proc.poll() is None
    said = router.stderr()  # Granian logs a worker it lost; none was lost
    assert "Unexpected exit from worker" not in said and "panicked" not in said


def test_an_engine_password_never_shows() -> None:
    from narwhal.router.config import EngineSpec
    from narwhal.router.engines import Engine

    e = Engine(
        EngineSpec("a", url="http://bob:s3cret@10.0.0.5:8000/v1"),
        "http://bob:s3cret@10.0.0.5:8000/v1",
    )
    shown = str(e.describe())
    assert "s3cret" not in shown and "bob:***@10.0.0.5:8000/v1" in shown
    assert Engine(EngineSpec("b", url="http://h:1"), "http://h:1").describe()["url"] == "http://h:1"


def test_one_fault_is_a_strike_not_an_ejection(faulty: Server, tmp_path: Path) -> None:
    r = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 3600, eject_after: 3}}
engines: [{{name: f, url: "{faulty.url}", dialect: openai}}]
""",
    )  # no probe will come to the rescue within this test

    def ask(content: str) -> httpx.Response:
        return httpx.post(
            r.url + "/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": content}]},
        )

    try:
        assert ask("fault:http2_status").status_code == 502
        assert ask("fault:ssh_banner").status_code == 502
        assert ask("hello").status_code == 200  # two faults: still placed; the streak ends
        for _ in range(3):
            assert ask("fault:two_digit_status").status_code == 502
        gone = ask("hello")  # three in a row: ejected until a probe brings it back
        assert gone.status_code == 503
        assert gone.json()["error"]["code"] == "backend_unavailable"
    finally:
        r.stop()


def _counts(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(("narwhal_finished_total{", "narwhal_offered_total ")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_request_ends_in_exactly_one_outcome(scripted: Server, tmp_path: Path) -> None:
    r = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: open
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    url = r.url + "/v1/completions"
    try:
        before = _counts(r.url)
        assert before['narwhal_finished_total{outcome="completed"}'] == 0  # exported at 0
        httpx.post(url, json={"prompt": "hi", "stream": True})  # completed
        httpx.post(url, json={"prompt": "hi"})  # completed
        httpx.post(url, json={"prompt": "script:status:422"})  # engine_error
        httpx.post(url, json={"prompt": "script:status:429"})  # rejected (engine_busy)
        httpx.post(url, json={"prompt": "script:die", "stream": True})  # stream_fault
        httpx.post(url, content=b"{nope")  # invalid
        httpx.post(url, json={"prompt": "hi", "model": "other"})  # invalid (404)
        httpx.post(
            url,
            json={"prompt": "script:hang", "stream": True},  # stream_fault
            headers={"x-narwhal-timeout-ms": "300"},
        )
        httpx.post(
            url,
            json={"prompt": "script:slow_first:2000"},  # deadline (504)
            headers={"x-narwhal-timeout-ms": "300"},
        )
        with httpx.stream(
            "POST", url, json={"prompt": "script:paced:100:50", "stream": True}
        ) as s:  # client_gone
            next(s.iter_bytes())
        after = {}
        for _ in range(50):  # the hang-up reaches the router a moment later
            after = _counts(r.url)
            offered = after["narwhal_offered_total"] - before["narwhal_offered_total"]
            finished = {
                k.split('"')[1]: v - before[k]
                for k, v in after.items()
                if k.startswith("narwhal_finished_total") and v != before[k]
            }
            if sum(finished.values()) == offered:
                break
            time.sleep(0.1)
        assert offered == 10
        assert finished == {
            "completed": 2,
            "engine_error": 1,
            "rejected": 1,
            "stream_fault": 2,
            "invalid": 2,
            "deadline": 1,
            "client_gone": 1,
        }
    finally:
        r.stop()


def test_an_engine_error_event_is_that_request_s_outcome_not_a_fault(
    scripted: Server, tmp_path: Path
) -> None:
    r = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 3600, eject_after: 3}}
engines: [{{name: s, url: "{scripted.url}", dialect: openai}}]
""",
    )
    try:
        for _ in range(4):  # more than eject_after: none of them counts against the engine
            got = httpx.post(
                r.url + "/v1/completions",
                timeout=30,
                json={"prompt": "script:error_event", "stream": True},
            ).text
            assert got.count('"error"') == 1 and '"code": "tool_call_invalid"' in got
            assert "engine_disconnected" not in got
        ok = httpx.post(r.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert ok.status_code == 200  # still placed on
        # A non-streaming client gets the engine's refusal with the status it stands for
        # (the router streams upstream, so it came as an event), not a 502.
        whole = httpx.post(
            r.url + "/v1/completions", timeout=30, json={"prompt": "script:error_event"}
        )
        assert whole.status_code == 422
        assert whole.json()["error"]["code"] == "tool_call_invalid"
        # An engine's error object reaches the client in the whole envelope, its message
        # kept, `code` a string.
        bare = httpx.post(
            r.url + "/v1/completions", timeout=30, json={"prompt": "script:error_event_bare"}
        )
        assert bare.status_code == 502
        assert bare.json() == {
            "error": {
                "message": "boom",
                "type": "InternalServerError",
                "param": None,
                "code": "engine_error",
            }
        }
        busy = httpx.post(r.url + "/v1/completions", json={"prompt": "script:status:429"})
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        m = httpx.get(r.url + "/metrics").text
        assert 'narwhal_rejected_total{model="main",reason="engine_busy"} 1.0' in m
    finally:
        r.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_s_429_is_retried_on_another_engine(
    scripted: Server, tmp_path: Path, stream: bool
) -> None:
    busy = [start_test_engine("tests.scripted_engine", "--busy") for _ in range(2)]
    routers = [
        start_router(
            tmp_path,
            f"""
listen: {{port: $PORT}}
admission: open
engines:
  - {{name: busy, url: "{busy[0].url}", dialect: openai}}
  - {{name: other, url: "{other.url}", dialect: openai}}
""",
        )
        for other in (scripted, busy[1])
    ]

    def asked() -> list[int]:
        return [httpx.get(b.url + "/stats").json()["requests"] for b in busy]

    try:
        before = asked()
        body = {"prompt": "hi", "stream": stream}
        resp = httpx.post(routers[0].url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        # The busy engine (listed first, as idle as the other) was asked first: 429.
        assert asked() == [before[0] + 1, before[1]]
        m = httpx.get(routers[0].url + "/metrics").text
        assert 'narwhal_rejected_total{model="main",reason="engine_busy"} 0.0' in m
        assert 'narwhal_finished_total{outcome="completed"} 1.0' in m

        # Every engine busy: each is asked once, then the last 429 goes to the client.
        resp = httpx.post(routers[1].url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["message"] == "engine says no"
        assert asked() == [before[0] + 2, before[1] + 1]
        m = httpx.get(routers[1].url + "/metrics").text
        assert 'narwhal_rejected_total{model="main",reason="engine_busy"} 1.0' in m
    finally:
        for s in (*routers, *busy):
            s.stop()
