"""Admission limits in both modes: phase concurrency, the admission queue, its wait, and a
client that leaves the queue; counters and gauges come back to zero."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import Server, chat, metric, start_router

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(scripted: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    r = start_router(
        tmp_path_factory.mktemp("a"),
        f"""
model: main
listen: {{port: $PORT}}
admission: open
queue: {{size: 1, wait_s: 0.5}}
phases: {{prefill_concurrency: 1, decode_concurrency: 4}}
serving: {{http_retention_limit: 3}}
health: {{interval_s: 0.2}}
engines:
  - {{name: s, url: '{scripted.url}', dialect: lexi}}
""",
    )
    yield r
    r.stop()


def streamed(content: str) -> dict[str, Any]:
    return chat(content, stream=True)


def engine_state(router: Server) -> dict[str, Any]:
    return httpx.get(router.url + "/ready").json()["engines"][0]


def background(router: Server, content: str, out: list[int]) -> threading.Thread:
    t = threading.Thread(
        target=lambda: out.append(
            httpx.post(
                router.url + "/v1/chat/completions", json=streamed(content), timeout=30
            ).status_code
        )
    )
    t.start()
    return t


def wait_for(cond: Any, timeout: float = 5) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.02)


def test_prefill_limit_queues_then_the_queue_wait_expires_with_504(router: Server) -> None:
    results: list[int] = []
    first = background(router, "script:slow_first:1500", results)
    wait_for(lambda: engine_state(router)["prefill"] == 1)
    # The one prefill seat is taken: this request queues, and its 0.5 s wait runs out.
    r = httpx.post(router.url + "/v1/chat/completions", json=streamed("hi"), timeout=30)
    assert r.status_code == 504
    first.join()
    assert results == [200]


def test_full_queue_is_429_and_a_queued_request_is_placed_when_room_frees(router: Server) -> None:
    results: list[int] = []
    first = background(router, "script:slow_first:400", results)
    wait_for(lambda: engine_state(router)["prefill"] == 1)
    queued = background(router, "hi", results)
    wait_for(lambda: metric(router, "narwhal_queued") == 1)
    r = httpx.post(router.url + "/v1/chat/completions", json=streamed("hi"), timeout=30)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    first.join()
    queued.join()
    assert sorted(results) == [200, 200]


def test_a_client_leaving_the_queue_frees_its_place(router: Server, scripted: Server) -> None:
    seen = httpx.get(scripted.url + "/stats").json()["requests"]
    results: list[int] = []
    first = background(router, "script:slow_first:1000", results)
    wait_for(lambda: engine_state(router)["prefill"] == 1)
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(router.url + "/v1/chat/completions", json=streamed("hi"), timeout=0.2)
    # It left while the first request still held the prefill seat ...
    wait_for(lambda: metric(router, "narwhal_queued") == 0, timeout=0.5)
    assert engine_state(router)["prefill"] == 1
    first.join()
    # ... and so never reached the engine once the seat freed. A freed seat goes to the
    # queue at once, so by the time a later request is answered it would have been sent.
    r = httpx.post(router.url + "/v1/chat/completions", json=streamed("marker"), timeout=30)
    assert r.status_code == 200
    engine = httpx.get(scripted.url + "/stats").json()
    assert engine["requests"] == seen + 2
    assert engine["last"]["messages"][-1]["content"] == "marker"
    assert results == [200]


def test_retention_limit_is_429(router: Server) -> None:
    # Two streams in decode and one request in prefill hold all three retention seats.
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", router.url + "/v1/chat/completions", json=streamed("script:hang")) as a,
        c.stream("POST", router.url + "/v1/chat/completions", json=streamed("script:hang")) as b,
    ):
        alive = [s.iter_raw() for s in (a, b)]  # a dropped iterator closes its stream
        for it in alive:
            next(it)
        results: list[int] = []
        slow = background(router, "script:slow_first:800", results)
        wait_for(lambda: engine_state(router)["prefill"] == 1)
        r = httpx.post(router.url + "/v1/chat/completions", json=streamed("hi"), timeout=30)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "retention_full"
        slow.join()
    assert results == [200]


def test_everything_returns_to_zero(router: Server) -> None:
    wait_for(
        lambda: (
            metric(router, "narwhal_retained") == 0
            and metric(router, "narwhal_queued") == 0
            and engine_state(router)["prefill"] == 0
            and engine_state(router)["decode"] == 0
        )
    )


def test_a_stopping_router_turns_its_queue_away_and_finishes_what_it_placed(
    scripted: Server, tmp_path: Path
) -> None:
    r = start_router(
        tmp_path,
        f"""
model: main
listen: {{port: $PORT}}
admission: open
queue: {{size: 4, wait_s: 60}}
phases: {{prefill_concurrency: 1}}
health: {{interval_s: 0.2}}
engines:
  - {{name: s, url: '{scripted.url}', dialect: lexi}}
""",
    )
    try:
        placed: list[int] = []
        first = background(r, "script:slow_first:4000", placed)
        wait_for(lambda: engine_state(r)["prefill"] == 1)
        queued: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: queued.append(
                httpx.post(r.url + "/v1/chat/completions", json=streamed("hi"), timeout=60)
            )
        )
        waiter.start()
        wait_for(lambda: metric(r, "narwhal_queued") == 1)
        os.kill(r.proc.pid, signal.SIGTERM)
        waiter.join(timeout=60)
        # Told to retry while the placed request is still being answered, not left to
        # wait out a queue the shutdown would cut.
        assert first.is_alive()
        (refused,) = queued
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "stopping"
        first.join()
        assert placed == [200]
    finally:
        r.stop()
