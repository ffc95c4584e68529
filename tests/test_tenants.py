"""Tenants (router/tenants/): per-key limits over a sliding minute, in-process with a
clock the test holds, and end to end through the router and a scripted engine."""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from narwhal.etcd import _b64
from narwhal.router.pipeline.intake import check
from narwhal.router.request import CHAT
from narwhal.router.tenants.fair_queue import RANK, FairQueue
from narwhal.router.tenants.limits import WINDOW_S, Limits, Tenant, TenantLimited
from narwhal.router.tenants.reserve import CEILING, TAU_BUDGETS, CriticalReserve
from narwhal.router.tenants.shares import SATURATED_BUDGETS, Shares
from tests.support import (
    EtcdServer,
    Server,
    metric,
    start_router,
    start_test_engine,
    wait_until,
)


def test_requests_a_minute_refuse_until_the_oldest_leaves_the_window() -> None:
    t = Tenant("a", Limits(rpm=2))
    t.admit(10, now=100.0).end(10, now=101.0)
    t.admit(10, now=130.0).end(10, now=131.0)
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
    first.end(150, now=2.5)  # it used less than its estimate: 550 in the window
    t.admit(400, now=3.0).end(400, now=3.5)
    second.end(400, now=3.5)
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


ENGINE: list[Server] = []


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    engine = start_test_engine("tests.scripted_engine")
    ENGINE.append(engine)
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
    admitted = (
        'narwhal_tenant_requests_total{priority="standard",result="admitted",tenant="team-a"}'
    )
    refused = (
        'narwhal_tenant_requests_total{priority="standard",result="refused_rpm",tenant="team-a"}'
    )
    assert f"{admitted} 3.0" in metrics and f"{refused} 1.0" in metrics
    # As they ended, and how long they waited for an engine, by tenant and class.
    served = (
        'narwhal_tenant_finished_total{outcome="completed",priority="standard",reason="",'
        'tenant="team-a"}'
    )
    limited = (
        'narwhal_tenant_finished_total{outcome="rejected",priority="standard",reason="tenant",'
        'tenant="team-a"}'
    )
    queued = 'narwhal_tenant_queue_time_seconds_count{priority="standard",tenant="team-a"}'
    assert f"{served} 3.0" in metrics and f"{limited} 1.0" in metrics
    assert f"{queued} 3.0" in metrics
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
        engine = ENGINE[0]
        wait_until(lambda: httpx.get(engine.url + "/stats").json()["active"], 10)  # it runs
        r = ask(router, key)
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


def test_the_queue_serves_higher_classes_first_and_the_earliest_deadline_in_a_tenant() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("shed", RANK["sheddable"], "t", 1.0, 10)
    q.push("std-late", RANK["standard"], "t", 9.0, 10)
    q.push("std-soon", RANK["standard"], "t", 2.0, 10)
    q.push("crit", RANK["critical"], "u", 5.0, 10)
    assert [q.pop() for _ in range(4)] == ["crit", "std-soon", "std-late", "shed"]


def test_two_backlogged_tenants_take_equal_shares_of_tokens_whatever_each_sends() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(100):  # a burst ten times the other's
        q.push("heavy", 1, "heavy", float(i), 100)
    for i in range(10):
        q.push("light", 1, "light", 1000.0 + i, 100)
    served = [q.pop() for _ in range(20)]
    assert served.count("heavy") == served.count("light") == 10
    # A tenant back from idle takes its turn from now on, not for the time it was away.
    q.push("light", 1, "light", 0.0, 100)
    served = [q.pop() for _ in range(4)]
    assert served.count("light") == 1


def one_seat_router(tmp_path: Path, engine: Server, keys: list[str]) -> Server:
    """A router with one seat on `engine`, so that requests wait in its queue."""
    listed = "".join(f"    - {k}\n" for k in keys)
    return start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: open
phases: {{prefill_concurrency: 1, decode_concurrency: 1}}
queue: {{size: 64, wait_s: 60}}
auth:
  api_keys:
{listed}engines: [{{name: s, url: '{engine.url}'}}]
""",
    )


def test_two_backlogged_tenants_are_served_equal_tokens_through_the_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = start_test_engine("tests.scripted_engine")
    monkeypatch.setenv("NARWHAL_TEST_KEY_HEAVY", "key-of-heavy")
    monkeypatch.setenv("NARWHAL_TEST_KEY_LIGHT", "key-of-light")
    router = one_seat_router(
        tmp_path,
        engine,
        [
            "{key_env: NARWHAL_TEST_KEY_HEAVY, tenant: heavy}",
            "{key_env: NARWHAL_TEST_KEY_LIGHT, tenant: light}",
        ],
    )
    done: list[str] = []

    def send(tenant: str, content: str) -> None:
        r = ask(router, f"key-of-{tenant}", content)
        assert r.status_code == 200, r.text
        done.append(tenant)

    try:
        # The one seat held until every other request waits (released below, not timed).
        first = threading.Thread(target=send, args=("heavy", "script:held"))
        first.start()
        wait_until(lambda: httpx.get(engine.url + "/stats").json()["active"], 10)
        # Ten times as many from one tenant, all of the same size, all waiting.
        threads = [
            threading.Thread(target=send, args=("heavy", "script:paced:2:5")) for _ in range(20)
        ]
        threads += [
            threading.Thread(target=send, args=("light", "script:paced:2:5")) for _ in range(2)
        ]
        for i, t in enumerate(threads):
            t.start()
            wait_until(lambda i=i: metric(router, "narwhal_queued") == i + 1, 10)
        httpx.post(engine.url + "/release")
        for t in [first, *threads]:
            t.join(60)
        # While both were backlogged (until the light tenant's last was served), each was
        # served as much as the other: the light one's two came among the first four.
        assert done[0] == "heavy" and len(done) == 23
        assert sorted(done[1:5]) == ["heavy", "heavy", "light", "light"], done
    finally:
        router.stop()
        engine.stop()


def test_a_request_whose_wait_ended_does_not_use_its_tenants_turn() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a1", 1, "a", 0.0, 100)
    q.push("b1", 1, "b", 1.0, 100)
    assert q.pop(served=False) == "a1"  # gone before it was placed
    q.push("a2", 1, "a", 0.5, 100)
    assert q.pop() == "a2"  # a was not charged for a1: its turn, and the earlier deadline


def test_a_critical_request_waiting_is_placed_before_sheddable_ones_that_came_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = start_test_engine("tests.scripted_engine")
    monkeypatch.setenv("NARWHAL_TEST_KEY_OPS", "key-of-ops")
    router = one_seat_router(
        tmp_path,
        engine,
        ["plain-key", "{key_env: NARWHAL_TEST_KEY_OPS, tenant: ops, priority: critical}"],
    )
    done: list[str] = []

    def send(name: str, key: str, content: str, priority: str | None = None) -> None:
        headers = {"x-narwhal-priority": priority} if priority else {}
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "main", "messages": [{"role": "user", "content": content}]},
            headers={"authorization": f"Bearer {key}", **headers},
            timeout=60,
        )
        assert r.status_code == 200
        done.append(name)

    try:
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "main", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer plain-key", "x-narwhal-priority": "urgent"},
            timeout=10,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"
        threads = [threading.Thread(target=send, args=("first", "plain-key", "script:held"))]
        threads[0].start()
        wait_until(lambda: httpx.get(engine.url + "/stats").json()["active"], 10)
        for i in range(2):
            threads.append(
                threading.Thread(
                    target=send, args=(f"shed{i}", "plain-key", "script:paced:4:50", "sheddable")
                )
            )
            threads[-1].start()
        wait_until(lambda: metric(router, "narwhal_queued") == 2, 10)
        # Critical, from a key that may ask for it (asking without the header: its class).
        # (Each takes 0.2 s, so the order they end in is the order they were placed.)
        threads.append(
            threading.Thread(target=send, args=("ops", "key-of-ops", "script:paced:4:50"))
        )
        threads[-1].start()
        wait_until(lambda: metric(router, "narwhal_queued") == 3, 10)
        httpx.post(engine.url + "/release")
        for t in threads:
            t.join(60)
        assert done[:2] == ["first", "ops"]
    finally:
        router.stop()
        engine.stop()


def test_a_window_handed_to_another_router_keeps_its_ages_and_tokens() -> None:
    old = Tenant("a", Limits(rpm=2, tpm=1000))
    old.admit(300, now=100.0).end(300, now=101.0)
    old.admit(200, now=130.0).end(200, now=131.0)
    new = Tenant("a", Limits(rpm=2, tpm=1000))
    new.load(old.export(now=140.0), now=5000.0)  # another clock
    assert new.tokens == 500
    with pytest.raises(TenantLimited) as refused:
        new.admit(10, now=5000.0)
    assert refused.value.headers["retry-after"] == "20"  # the first is 40 s old
    new.load([[1, 2], ["x", 1, 1], [-5, 10, 1], [30, 1e300, 1], [1, 1, 0], [10.0, 50, 2]], 0.0)
    # What is not sane is dropped; a bucket of tokens and no request is a late charge.
    assert (new.tokens, new.requests) == (51, 2)
    # However many buckets etcd holds, a minute's worth is taken, one entry each.
    new.load([[i % 60, 1, 1000] for i in range(10_000)], 0.0)
    assert len(new.window) <= 61 and new.requests <= 61_000


@pytest.mark.slow
def test_a_tenants_limit_holds_across_a_failover(
    tmp_path: Path, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = start_test_engine("tests.scripted_engine")
    monkeypatch.setenv("NARWHAL_TEST_KEY_A", "key-of-team-a")
    text = f"""
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 0.2}}
ha: {{etcd: ['{etcd.url}'], key: '/tenants-{os.getpid()}/leader', lease_ttl_s: 2}}
auth:
  api_keys: [{{key_env: NARWHAL_TEST_KEY_A, tenant: team-a, rpm: 3}}]
engines: [{{name: s, url: '{engine.url}'}}]
"""
    leader = start_router(tmp_path, text)
    standby = start_router(tmp_path, text, wait_ready=False)
    try:
        for _ in range(3):
            assert ask(leader, "key-of-team-a").status_code == 200
        published = {"key": _b64(f"/tenants-{os.getpid()}/tenants".encode())}

        def counted() -> int:  # the requests in the window the leader published
            kvs = httpx.post(etcd.url + "/v3/kv/range", json=published).json().get("kvs")
            window = orjson.loads(base64.b64decode(kvs[0]["value"]))["team-a"] if kvs else []
            return sum(count for _, _, count in window)

        wait_until(lambda: counted() == 3, 10)  # published every half second
        os.killpg(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        wait_until(lambda: httpx.get(standby.url + "/ready").status_code == 200, 15)
        r = ask(standby, "key-of-team-a")
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_rate_limited"
    finally:
        leader.stop()
        standby.stop()
        engine.stop()


def test_each_class_is_admitted_against_its_share_of_the_budget() -> None:
    from narwhal.router.config import parse
    from narwhal.router.pipeline.classify import class_share

    config = parse(
        {
            "engines": [{"name": "e", "url": "http://x"}],
            "predictive": {"sheddable_headroom": 0.4, "critical_reserve": 0.25},
        }
    )
    crit, std, shed = RANK["critical"], RANK["standard"], RANK["sheddable"]
    assert [class_share(r, config, 0.25) for r in (crit, std, shed)] == [1.0, 0.75, 0.4]
    # Where no key may send critical work, nothing is reserved for it.
    assert class_share(std, config, 0.0) == 1.0
    # A reserve grown past what sheddable work is held to holds it lower still.
    assert class_share(shed, config, 0.7) == pytest.approx(0.3)


def test_the_critical_reserve_grows_while_critical_work_is_refused_and_then_decays() -> None:
    r = CriticalReserve(0.2)
    assert r.share(now=0.0) == 0.2
    for _ in range(3):
        r.refused(now=1.0)
    assert r.share(now=1.0) == pytest.approx(0.5)
    for _ in range(10):
        r.refused(now=2.0)
    assert r.share(now=2.0) == pytest.approx(CEILING)  # never past the ceiling
    tau = TAU_BUDGETS * 5.0  # its decay's time constant, in the default 5 s budgets
    assert 0.2 < r.share(now=2.0 + tau) < CEILING
    assert r.share(now=2.0 + 20 * tau) == pytest.approx(0.2)  # back to the configured share
    off = CriticalReserve(0.0)  # the operator reserves nothing: refusals change nothing
    off.refused(now=0.0)
    assert off.share(now=0.0) == 0.0
    off.configure(0.3, 5.0)  # a reload sets another share
    assert off.share(now=0.0) == 0.3
    none = CriticalReserve(0.3, critical=False)  # no key may send critical work
    none.configure(0.5, 5.0)
    assert none.share(now=0.0) == 0.0


def test_a_tenant_over_its_share_gets_less_budget_only_while_the_fleet_is_full() -> None:
    s = Shares()
    s.served("heavy", 9000, now=0.0)
    s.served("light", 1000, now=0.0)
    # Nothing refused lately: work that fits is never turned away for fairness.
    assert s.fair_share("heavy", now=1.0) == 1.0
    s.refused(now=1.0)
    assert s.fair_share("heavy", now=1.0) == pytest.approx(5000 / 9000)  # fair / share
    assert s.fair_share("light", now=1.0) == 1.0
    assert s.fair_share("heavy", now=1.0 + SATURATED_BUDGETS * s.budget_s + 0.1) == 1.0
    # Long after, what was served then no longer counts: the roles have turned.
    s.refused(now=100.0)
    s.served("light", 9000, now=100.0)
    s.served("heavy", 1000, now=100.0)
    assert s.fair_share("light", now=100.0) < 1.0 and s.fair_share("heavy", now=100.0) == 1.0
    # At a tenth of the budget, "lately" is a tenth as long: the same refusal is old news.
    quick = Shares(budget_s=0.5)
    quick.served("heavy", 9000, now=0.0)
    quick.served("light", 1000, now=0.0)
    quick.refused(now=1.0)
    assert quick.fair_share("heavy", now=1.6) == 1.0
    assert s.fair_share("light", now=100.6) < 1.0
    # A tenant alone is no one's competitor.
    s.refused(now=200.0)
    s.served("light", 10**6, now=200.0)
    assert s.fair_share("light", now=200.0) == 1.0


@pytest.mark.slow
def test_under_3x_overload_critical_work_keeps_its_budget_and_sheddable_is_refused_first(
    tmp_path: Path,
) -> None:
    from bench.fleet.replay import Result, duration_s, klass_of, offer, start_fleet, warm
    from bench.fleet.traces import Request

    # Two simulated GPU engines (bench/fleet/server.py: chunked prefill beside decoding
    # streams), every step twice as long; the replayer divides what it measures by that.
    scale, budget_s, tpot_s = 2.0, 5.0, 0.1
    # Two consecutive ports, tried again elsewhere when one was taken (a free port says
    # nothing of the one after it).
    sim, engines = start_fleet(argparse.Namespace(engines=2, time_scale=scale, sim_args=""))
    try:
        keys = ", ".join(
            f"{{key: key-{c}, tenant: {c}, priority: {c}}}"
            for c in ("critical", "standard", "sheddable")
        )
        router = start_router(
            tmp_path,
            f"""
model: main
listen: {{port: $PORT}}
admission: predictive
predictive: {{ttft_budget_s: {budget_s * scale}, tpot_target_s: {tpot_s * scale}}}
auth: {{api_keys: [{keys}]}}
queue: {{size: 4096, wait_s: 600}}
phases: {{prefill_concurrency: 64, decode_concurrency: 512}}
engines:
"""
            + "".join(
                f"  - {{name: e{i}, url: '{u}', dialect: vllm}}\n" for i, u in enumerate(engines)
            ),
        )
        try:
            asyncio.run(warm(router.url, 24, scale, keyed=True))
            # The case: interactive chat (critical: prompts of 300-1,300 tokens)
            # beside batch work (1,000-4,000 tokens), none shared, answers of 40-160 tokens;
            # 600 requests, 24 a second: about 3x what the two engines serve within both
            # targets.
            mix = [("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3)]
            trace = []
            for i in range(600):
                chat = klass_of(i, mix) == "critical"
                prompt = 300 + (i * 7919) % 1000 if chat else 1000 + (i * 7919) % 3000
                blocks = [i * 8 + k for k in range(8)]  # 512 words each
                trace.append(Request(i * 1000 / 24, prompt, 40 + (i * 104729) % 120, blocks))
            outs, span = asyncio.run(offer([router.url], trace, 1.0, scale, mix))
        finally:
            router.stop()
    finally:
        os.killpg(sim.pid, signal.SIGTERM)
        sim.wait(10)
    got = Result("narwhal", 3.0, outs, span).summary(budget_s, tpot_s, duration_s(trace, 1.0))
    by = got["by_class"]
    refused = {c: by[c]["refused"] / by[c]["offered"] for c in by}
    assert got["refused"] >= 0.5 * got["offered"], got  # overloaded, as meant
    assert by["critical"]["within_slo"] >= 0.99 * by["critical"]["offered"], by
    assert refused["sheddable"] > refused["standard"] > refused["critical"], refused


def test_a_stream_longer_than_the_window_is_charged_what_it_measured_when_it_ends() -> None:
    t = Tenant("a", Limits(tpm=60))
    ticket = t.admit(10, now=0.0)  # its prompt's estimate, charged at once
    # 80 tokens streamed over 64 s: the estimate left the window before the stream ended.
    ticket.end(80, now=64.0)
    with pytest.raises(TenantLimited) as refused:
        t.admit(5, now=64.0)
    assert refused.value.reason == "tpm"
    assert 1 <= int(refused.value.headers["retry-after"]) <= 60
    assert t.admit(5, now=64.0 + WINDOW_S).tenant is t  # a minute after it ended


def test_the_tokens_estimate_counts_all_that_becomes_prompt() -> None:
    text = "word " * 1600  # 8 KB
    in_messages = check(CHAT, orjson.dumps({"messages": [{"role": "user", "content": text}]}), "m")
    tool = {"type": "function", "function": {"name": "f", "description": text}}
    where = [
        {"tools": [tool]},
        {"response_format": {"type": "json_schema", "json_schema": {"description": text}}},
        {"chat_template_kwargs": {"context": text}},
    ]
    for extra in where:
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        req = check(CHAT, orjson.dumps(body), "m")
        assert req.estimated_prompt_tokens() >= in_messages.estimated_prompt_tokens(), extra
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}]
    history = [{"role": "assistant", "content": None, "tool_calls": calls}]
    req = check(CHAT, orjson.dumps({"messages": [*history, {"role": "user", "content": "x"}]}), "m")
    assert req.estimated_prompt_tokens() >= in_messages.estimated_prompt_tokens()
