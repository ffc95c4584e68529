"""Active routers (`ha.mode: active`): every router places and relays, and each places with
what the others placed (the picture exchange, router/peering). Real routers on a real
etcd, in front of simulated GPU engines with prefix caches (bench/fleet/server.py)."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import (
    EtcdServer,
    Server,
    metric,
    simulated_engines,
    sse_frames,
    start_engine,
    start_router,
    wait_until,
)

pytestmark = pytest.mark.slow

SECRET_ENV = "NARWHAL_TEST_PEER_SECRET"
TTL = 2
# Prompts of this many words (a token each at the simulated engine): 0.6 s of prefill, long
# enough that two sent at once are placed on two engines.
LONG = 6000


@pytest.fixture(autouse=True)
def peer_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "peer-secret-for-tests")


def config(etcd: EtcdServer, urls: list[str], key: str, extra: str = "") -> str:
    engines = "".join(
        f"  - {{name: gpu{i}, url: '{u}', dialect: vllm}}\n" for i, u in enumerate(urls)
    )
    return f"""
model: main
listen: {{port: $PORT}}
admission: predictive
predictive: {{ttft_budget_s: 5}}
health: {{interval_s: 0.2}}
ha: {{etcd: ['{etcd.url}'], key: {key}, lease_ttl_s: {TTL}, mode: active,
      peer_secret_env: {SECRET_ENV}}}
{extra}engines:
{engines}"""


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def ask(r: Server, content: str, **kw: Any) -> httpx.Response:
    body = {
        "model": "main",
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 2,
    }
    return httpx.post(r.url + "/v1/chat/completions", json=body, timeout=60, **kw)


def cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    usage = [f["usage"] for f in sse_frames(resp.text) if isinstance(f, dict) and f.get("usage")]
    return int(usage[-1]["prompt_tokens_details"]["cached_tokens"])


def leadership(r: Server) -> dict[str, Any]:
    got: dict[str, Any] = httpx.get(r.url + "/ready").json()["leadership"]
    return got


def engines_of(r: Server) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in httpx.get(r.url + "/ready").json()["engines"]}


def at_once(r: Server, prompts: list[str]) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: ask(r, p), prompts))


@contextlib.contextmanager
def routers(tmp: Path, text: str, n: int) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for _ in range(n):
            started.append(start_router(tmp, text))
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    with simulated_engines(2) as urls:
        yield urls


def reset(urls: list[str]) -> None:
    for u in urls:
        httpx.post(u + "/sim/reset")


def teach(r: Server) -> None:
    """The engines' prefill rate, measured on prompts of their own."""
    for i in range(4):
        assert ask(r, words(f"t{i}-", 2000)).status_code == 200


def test_every_router_serves_and_each_places_on_the_cache_another_filled(
    etcd: EtcdServer, engines: list[str], tmp_path: Path
) -> None:
    reset(engines)
    text = config(etcd, engines, "/act1/leader")
    with routers(tmp_path, text, 1) as (a,):
        teach(a)
        # Two long prompts at once through A: one on each engine; and enough more that A's
        # picture of the engines' caches comes in more than one piece to a router joining.
        first = [words("a", LONG), words("b", LONG)]
        assert all(cached(r) == 0 for r in at_once(a, first))
        for i in range(6):
            at_once(a, [words(f"more{i}x", LONG), words(f"more{i}y", LONG)])
        with routers(tmp_path, text, 1) as (b,):
            # B joined after A placed them: it took A's picture before its first placement.
            ra, rb = leadership(a), leadership(b)
            assert ra["role"] == rb["role"] == "active"
            assert ra["fencing_token"] != rb["fencing_token"]
            for p in first:
                assert cached(ask(b, p)) >= LONG // 2
            # Placed through A while B runs: B hears of them as they are placed.
            second = [words("c", LONG), words("d", LONG)]
            assert all(cached(r) == 0 for r in at_once(a, second))
            for p in second:
                assert cached(ask(b, p)) >= LONG // 2
            assert metric(b, "narwhal_peers") == 1
            assert metric(a, "narwhal_peer_deltas_total") > 0  # sent, acknowledged


def test_a_routers_work_holds_its_seats_at_the_others_until_it_ends_or_the_router_dies(
    etcd: EtcdServer, engines: list[str], tmp_path: Path
) -> None:
    reset(engines)
    text = config(etcd, engines, "/act2/leader")
    with routers(tmp_path, text, 2) as (a, b):
        wait_until(lambda: metric(a, "narwhal_peers") == 1 and metric(b, "narwhal_peers") == 1, 10)
        body = {
            "model": "main",
            "messages": [{"role": "user", "content": "hello"}],
            "stream": True,
            "max_tokens": 2000,
        }
        with httpx.stream("POST", a.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # held: a generator let go closes the stream
            next(lines)
            wait_until(lambda: sum(e["decode"] for e in engines_of(a).values()) == 1, 10)
            at_a = {n: e["decode"] for n, e in engines_of(a).items()}
            # A's stream holds a decode seat at B, on the same engine, as it does at A.
            wait_until(lambda: {n: e["decode"] for n, e in engines_of(b).items()} == at_a, 10)
            # A dies mid-stream: once its member key lapses, B lets its seat go.
            os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait()
        wait_until(lambda: all(e["decode"] == 0 for e in engines_of(b).values()), 3 * TTL + 5)
        assert ask(b, "still serving").status_code == 200


def test_a_tenants_requests_a_minute_hold_across_routers(
    etcd: EtcdServer, engines: list[str], tmp_path: Path
) -> None:
    reset(engines)
    extra = "auth:\n  api_keys:\n    - {key: team-key, tenant: team, rpm: 6}\n"
    text = config(etcd, engines, "/act3/leader", extra)
    with routers(tmp_path, text, 2) as (a, b):
        wait_until(lambda: metric(a, "narwhal_peers") == 1 and metric(b, "narwhal_peers") == 1, 10)
        headers = {"authorization": "Bearer team-key"}
        statuses = [ask((a, b)[i % 2], f"q{i}", headers=headers).status_code for i in range(12)]
    # Six a minute in all, not six at each router.
    assert statuses.count(200) == 6, statuses
    assert statuses.count(429) == 6, statuses


def test_the_exchange_takes_only_the_routers_secret_and_well_formed_messages(
    etcd: EtcdServer, engines: list[str], tmp_path: Path
) -> None:
    text = config(etcd, engines, "/act4/leader")
    with routers(tmp_path, text, 1) as (a,):
        url = a.url + "/internal/v1/picture"
        for r in (httpx.get(url), httpx.post(url, content=b"{}")):
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": "Bearer peer-secret-for-tests"}
        bad = httpx.post(
            url, content=b'{"from": "x", "token": 1, "seq": 1, "deltas": [["p"]]}', headers=auth
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["message"].startswith("not a picture message")
        # A batch from a router it holds nothing of: a snapshot must come first.
        early = httpx.post(
            url, content=b'{"from": "x", "token": 1, "seq": 5, "deltas": []}', headers=auth
        )
        assert early.status_code == 409
        assert httpx.get(url, headers=auth).json()["from"] == leadership(a)["key"].rsplit("/", 1)[1]


def fencing_lexi(model_path: str, etcd: EtcdServer, key: str) -> Server:
    """LexiEngine checking each router's token against its member key under `key`'s folder."""
    return start_engine(
        model_path,
        "--alias",
        "main",
        "--parallel",
        "4",
        "--fence",
        "--fence-etcd",
        etcd.url,
        "--fence-key",
        key,
    )


@contextlib.contextmanager
def fenced_pair(
    model_path: str, etcd: EtcdServer, key: str, tmp: Path
) -> Iterator[tuple[Server, Server, Server]]:
    """A fencing LexiEngine and two active routers on `key` before it, admitting everything."""
    lexi = fencing_lexi(model_path, etcd, key)
    try:
        text = (
            config(etcd, [], key)
            .replace("admission: predictive", "admission: open")
            .replace(
                "engines:\n", f"engines:\n  - {{name: lexi, url: '{lexi.url}', dialect: lexi}}\n"
            )
        )
        with routers(tmp, text, 2) as (a, b):
            yield lexi, a, b
    finally:
        lexi.stop()


def as_router(lexi: Server, token: int, name: str) -> httpx.Response:
    """A one-token completion sent straight to `lexi` as router `name` with `token`."""
    return httpx.post(
        lexi.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={"x-narwhal-fence": str(token), "x-narwhal-fence-router": name},
        timeout=60,
    )


def test_a_fencing_engine_serves_every_active_router_and_refuses_one_whose_key_went(
    etcd: EtcdServer, model_path: str, tmp_path: Path
) -> None:
    key = "/act5/leader"
    with fenced_pair(model_path, etcd, key, tmp_path) as (lexi, a, b):
        # Each router's own token: a leader's floor would refuse the older one.
        for r in (a, b, a, b):
            got = httpx.post(
                r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60
            )
            assert got.status_code == 200, got.text
        me = leadership(a)
        # A's member key goes (its lease lapsed, as for a router cut off from etcd): the
        # engine refuses A's token from then on, whatever A still believes.
        k = base64.b64encode(me["key"].encode()).decode()
        httpx.post(etcd.url + "/v3/kv/deleterange", json={"key": k})
        name = me["key"].rsplit("/", 1)[1]

        wait_until(lambda: as_router(lexi, me["fencing_token"], name).status_code == 409, 10)
        assert (
            httpx.post(
                b.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60
            ).status_code
            == 200
        )


def test_active_routers_cut_off_from_etcd_stop_placing_before_their_leases_could_lapse(
    etcd: EtcdServer, engines: list[str], tmp_path: Path
) -> None:
    reset(engines)
    text = config(etcd, engines, "/act8/leader")
    with routers(tmp_path, text, 2) as (a, b):
        assert ask(a, "before").status_code == ask(b, "before").status_code == 200
        etcd.pause()
        try:
            # Each lease lapses TTL after its last renewal at the latest: every router stops
            # placing before that, and says why.
            def answer(status: int) -> bool:
                return all(ask(r, "cut off").status_code == status for r in (a, b))

            wait_until(lambda: answer(503), TTL)
            for r in (a, b):
                assert httpx.get(r.url + "/ready").json()["reason"].startswith("fenced")
        finally:
            etcd.resume()
        wait_until(lambda: answer(200), TTL + 5)  # each takes a key of its own again


def test_an_active_router_paused_past_its_ttl_serves_nothing_on_its_lapsed_lease(
    etcd: EtcdServer, model_path: str, tmp_path: Path
) -> None:
    key = "/act9/leader"
    with fenced_pair(model_path, etcd, key, tmp_path) as (lexi, a, b):
        wait_until(lambda: metric(b, "narwhal_peers") == 1, 10)
        assert ask(a, "before").status_code == 200
        old = leadership(a)["fencing_token"]
        os.killpg(a.proc.pid, signal.SIGSTOP)  # the whole router, frozen mid-lease
        try:
            statuses: list[int] = []
            # Requests that reach the frozen router wait in its socket's backlog.
            sent = [
                threading.Thread(target=lambda: statuses.append(ask(a, "held").status_code))
                for _ in range(3)
            ]
            for t in sent:
                t.start()
            # Its key lapses: the other router sees it go.
            wait_until(lambda: metric(b, "narwhal_peers") == 0, TTL + 5)
        finally:
            os.killpg(a.proc.pid, signal.SIGCONT)
        for t in sent:
            t.join(60)
        # Woken, it either knew its lease was not proven any more (503) or served under
        # a key and token of its own again: the engine takes the lapsed token from no one.
        assert len(statuses) == 3 and set(statuses) <= {200, 503}, statuses
        wait_until(lambda: ask(a, "back").status_code == 200, TTL + 5)
        assert leadership(a)["fencing_token"] > old
        # Nothing came to the engine under the lapsed token (the router's own gate)...
        assert metric(lexi, "lexi_fenced_requests_total") == 0
        stale = as_router(lexi, old, leadership(a)["key"].rsplit("/", 1)[1])
        # ...and had it come, the engine would have refused it.
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "fenced"


def test_admin_edits_on_any_active_router_apply_on_every_router(
    etcd: EtcdServer, engines: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_ADMIN", "admin-token")
    admin = {"authorization": "Bearer admin-token"}
    text = config(
        etcd, engines[:1], "/act6/leader", "admin: {token_env: NARWHAL_TEST_ADMIN}\n"
    ).replace("admission: predictive", "admission: open")
    with routers(tmp_path, text, 2) as (a, b):
        add = {"name": "gpu1", "url": engines[1], "dialect": "vllm"}
        r = httpx.post(b.url + "/admin/engines", headers=admin, json=add, timeout=5)
        assert r.status_code == 201, r.text
        r = httpx.post(
            a.url + "/admin/maintenance", headers=admin, json={"engines": ["gpu0"]}, timeout=5
        )
        assert r.status_code == 200, r.text
        for r in (a, b):
            wait_until(lambda r=r: engines_of(r).get("gpu1", {}).get("state") == "serving", 10)
            wait_until(
                lambda r=r: httpx.get(r.url + "/ready").json()["maintenance"] == ["gpu0"], 10
            )


def test_a_router_restarted_at_its_address_replaces_its_dead_self_at_the_others(
    etcd: EtcdServer, engines: list[str], tmp_path: Path
) -> None:
    text = config(etcd, engines, "/act7/leader", "").replace("lease_ttl_s: 2", "lease_ttl_s: 30")
    with routers(tmp_path, text, 2) as (a, b):
        wait_until(lambda: metric(a, "narwhal_peers") == 1 and metric(b, "narwhal_peers") == 1, 10)
        os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait()
        # Started again at the same address, as a pod or a unit restarts: a new name, a new
        # key, while the dead one's key lives on for its TTL.
        again = Server(a.proc.args, "/ready", a.port, timeout=60)
        try:
            received = lambda: metric(again, 'narwhal_peer_snapshots_total{direction="received"}')  # noqa: E731
            name = leadership(again)["key"].rsplit("/", 1)[1]
            from_b = lambda: metric(  # noqa: E731
                again,
                f'narwhal_placements_total{{router="{leadership(b)["key"].rsplit("/", 1)[1]}"}}',
            )
            # B follows the new router's key (and lets the dead one's go)...
            wait_until(lambda: name in b.stderr(), 10)
            for i in range(6):
                assert ask((again, b)[i % 2], f"warm {i}").status_code == 200
            # ... and what B placed reached it (after the snapshot B sent it first).
            wait_until(lambda: from_b() >= 3, 10)
            before = received()
            for i in range(10):
                assert ask(b, f"q {i}").status_code == 200
            wait_until(lambda: from_b() >= 13, 10)
            # B's deltas reach the new router once, in order: no snapshot asked for (B
            # posting to that address for the dead name and the live one, each batch twice,
            # would have one copy refused and a snapshot sent after every batch).
            assert received() == before
        finally:
            again.stop()
