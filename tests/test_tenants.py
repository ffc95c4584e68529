"""Tenants (router/tenants/): per-key limits over a sliding minute, in-process with a
clock the test holds, and end to end through the router and a scripted engine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from narwhal.router.tenants.limits import Limits, Tenant, TenantLimited
from tests.support import Server, start_router, start_test_engine


def test_requests_a_minute_refuse_until_the_oldest_leaves_the_window() -> None:
    t = Tenant("a", Limits(rpm=2))
    t.admit(10, now=100.0).end(10)
    t.admit(10, now=130.0).end(10)
    with pytest.raises(TenantLimited) as refused:
        t.admit(10, now=150.0)
    assert refused.value.reason == "rpm"
    assert refused.value.headers["retry-after"] == "10"  # the first leaves at 160
    t.admit(10, now=160.0)  # and then it fits


def test_tokens_a_minute_count_the_estimate_at_once_and_what_was_measured_at_the_end() -> None:
    t = Tenant("a", Limits(tpm=1000))
    first = t.admit(400, now=0.0)
    second = t.admit(400, now=1.0)  # both in flight: 800 reserved
    with pytest.raises(TenantLimited) as refused:
        t.admit(400, now=2.0)
    assert refused.value.reason == "tpm" and refused.value.headers["retry-after"] == "58"
    first.end(150)  # it used less than its estimate: 550 in the window
    t.admit(400, now=3.0).end(400)
    second.end(400)
    with pytest.raises(TenantLimited):
        t.admit(200, now=4.0)
    t.admit(200, now=60.0)  # the first (150) has left the window


def test_a_prompt_over_the_limit_alone_is_told_to_wait_a_whole_window() -> None:
    t = Tenant("a", Limits(tpm=100))
    with pytest.raises(TenantLimited) as refused:
        t.admit(500, now=0.0)
    assert refused.value.headers["retry-after"] == "60"


def test_requests_at_once_are_freed_when_they_end_however_they_end() -> None:
    t = Tenant("a", Limits(max_concurrent=1))
    ticket = t.admit(1, now=0.0)
    with pytest.raises(TenantLimited) as refused:
        t.admit(1, now=0.0)
    assert refused.value.reason == "concurrency"
    ticket.end(None)  # a refused or failed request measured nothing
    ticket.end(None)  # ending twice frees once
    t.admit(1, now=0.0)
    assert t.inflight == 1


KEYS = {
    "NARWHAL_TEST_KEY_A": "key-of-team-a",
    "NARWHAL_TEST_KEY_B": "key-of-team-b",
    "NARWHAL_TEST_KEY_C": "key-of-team-c",
}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    engine = start_test_engine("tests.scripted_engine")
    os.environ.update(KEYS)
    try:
        r = start_router(
            tmp_path_factory.mktemp("tenants"),
            f"""
listen: {{port: $PORT}}
admission: open
auth:
  api_keys:
    - plain-key
    - {{key_env: NARWHAL_TEST_KEY_A, tenant: team-a, rpm: 3}}
    - {{key_env: NARWHAL_TEST_KEY_B, tenant: team-b, tpm: 150}}
    - {{key_env: NARWHAL_TEST_KEY_C, tenant: team-c, max_concurrent: 1}}
engines: [{{name: s, url: '{engine.url}'}}]
""",
        )
    finally:
        for k in KEYS:
            del os.environ[k]
    yield r
    r.stop()
    engine.stop()


def ask(r: Server, key: str, content: str = "hi", **kw: object) -> httpx.Response:
    body = {"model": "main", "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(
        r.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_a_tenant_past_its_requests_a_minute_is_refused_while_others_are_served(
    router: Server,
) -> None:
    for _ in range(3):
        assert ask(router, KEYS["NARWHAL_TEST_KEY_A"]).status_code == 200
    r = ask(router, KEYS["NARWHAL_TEST_KEY_A"])
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_rate_limited"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert "team-a" in r.json()["error"]["message"]
    assert ask(router, "plain-key").status_code == 200  # a key with no tenant: no limit
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'narwhal_tenant_requests_total{result="admitted",tenant="team-a"} 3.0' in metrics
    assert 'narwhal_tenant_requests_total{result="refused_rpm",tenant="team-a"} 1.0' in metrics
    assert "key-of-team" not in metrics


def test_a_tenant_is_held_to_the_tokens_it_used(router: Server) -> None:
    key = KEYS["NARWHAL_TEST_KEY_B"]
    # 400 bytes: ~100 tokens estimated, and as many counted by the engine, plus its answer.
    long = "word " * 80
    assert ask(router, key, long).status_code == 200
    r = ask(router, key, long)
    assert r.status_code == 429 and "tokens a minute" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 60
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'narwhal_tenant_tokens_total{tenant="team-b"}' in metrics


def test_a_tenant_is_held_to_its_requests_at_once(router: Server) -> None:
    key = KEYS["NARWHAL_TEST_KEY_C"]
    stream = threading.Thread(
        target=ask, args=(router, key, "script:paced:40:50"), kwargs={"stream": True}
    )
    stream.start()
    try:
        for _ in range(100):  # until the stream holds its one seat
            r = ask(router, key)
            if r.status_code == 429:
                break
        assert r.status_code == 429 and "at once" in r.json()["error"]["message"]
    finally:
        stream.join(30)
    assert ask(router, key).status_code == 200  # its seat is free again


def test_a_tenants_key_must_be_set_at_start(tmp_path: Path) -> None:
    from tests.support import refused_config

    stderr = refused_config(
        tmp_path,
        "auth: {api_keys: [{key_env: NARWHAL_TEST_NOT_SET, tenant: t}]}\n"
        "engines: [{name: e, url: 'http://x'}]\n",
    )
    assert "auth.api_keys[t].key_env: the environment variable NARWHAL_TEST_NOT_SET" in stderr
