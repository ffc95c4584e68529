"""Engines joining and leaving a running router (router/fleet/): the admin API, etcd
registration (`narwhal register`, `lexi-engine --register-etcd`), DNS, and membership across
a failover. Real processes, real etcd, scripted engines that speak HTTP/SSE."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from narwhal.etcd import _b64
from tests.support import (
    BIN,
    ROOT,
    EtcdServer,
    Server,
    free_port,
    start_engine,
    start_router,
    start_test_engine,
    wait_http,
    wait_until,
)

TOKEN = "fleet-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
_keys = count()


@pytest.fixture(autouse=True)
def _admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_TEST_ADMIN", TOKEN)


@pytest.fixture
def engines() -> Iterator[list[Server]]:
    started = [start_test_engine("tests.scripted_engine") for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def router_config(engines: str, extra: str = "") -> str:
    return (
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2, timeout_s: 1}\n"
        "admin: {token_env: NARWHAL_TEST_ADMIN}\n" + extra + f"engines:{engines}"
    )


def listed(router: Server) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/admin/engines", headers=ADMIN, timeout=5)
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()["engines"]}


def served(engine: Server) -> int:
    return int(httpx.get(engine.url + "/stats", timeout=5).json()["requests"])


class Stream(threading.Thread):
    """One streamed chat request, read to its end in a thread: its frames."""

    def __init__(self, router: Server, script: str) -> None:
        super().__init__(daemon=True)
        self.router, self.script = router, script
        self.frames: list[Any] = []
        self.status = 0

    def run(self) -> None:
        body = {"model": "main", "stream": True, "messages": [{"role": "user", "content": ""}]}
        body["messages"][0]["content"] = self.script
        with httpx.stream(
            "POST", self.router.url + "/v1/chat/completions", json=body, timeout=60
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    self.frames.append(data if data == "[DONE]" else orjson.loads(data))

    def tokens(self) -> int:
        return sum(
            1
            for f in self.frames
            if isinstance(f, dict) and f.get("choices") and f["choices"][0]["delta"].get("content")
        )


def test_engines_are_added_and_drained_under_streaming_traffic_with_nothing_lost(
    tmp_path: Path, engines: list[Server]
) -> None:
    a, b = engines
    router = start_router(tmp_path, router_config(f"\n  - {{name: a, url: '{a.url}'}}\n"))
    try:
        r = httpx.post(
            router.url + "/admin/engines",
            headers=ADMIN,
            json={"name": "b", "url": b.url, "dialect": "lexi"},
            timeout=5,
        )
        assert r.status_code == 201, r.text
        wait_until(lambda: listed(router)["b"]["state"] == "serving", 10)
        assert listed(router)["b"]["source"] == "admin"
        # Streams of 2 s on both engines (open admission spreads them)...
        streams = [Stream(router, "script:paced:40:50") for _ in range(6)]
        for s in streams:
            s.start()
        wait_until(lambda: served(a) >= 1 and served(b) >= 1, 10)
        on_a = served(a)
        # ... and `a` drained while they run: nothing new goes there, its streams finish.
        r = httpx.delete(router.url + "/admin/engines/a", headers=ADMIN, timeout=5)
        assert r.status_code == 202 and r.json()["state"] == "draining"
        for _ in range(5):
            answer = httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": "main", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert answer.status_code == 200
        assert served(a) == on_a
        for s in streams:
            s.join(30)
            assert s.status == 200 and s.frames[-1] == "[DONE]" and s.tokens() == 40
        wait_until(lambda: "a" not in listed(router), 10)
        assert httpx.get(router.url + "/ready", timeout=5).status_code == 200
        # Bad additions are refused in the envelope, and change nothing.
        for body, status, code in (
            ({"name": "c", "url": "ftp://x"}, 400, "invalid_engine"),
            ({"name": "b", "url": a.url}, 409, "engine_exists"),
            ({"name": "bad name", "url": a.url}, 400, "invalid_engine"),
        ):
            r = httpx.post(router.url + "/admin/engines", headers=ADMIN, json=body, timeout=5)
            assert r.status_code == status and r.json()["error"]["code"] == code
        r = httpx.delete(router.url + "/admin/engines/nope", headers=ADMIN, timeout=5)
        assert r.status_code == 404 and r.json()["error"]["code"] == "engine_not_found"
        r = httpx.get(router.url + "/admin/engines", timeout=5)
        assert r.status_code == 401
        assert set(listed(router)) == {"b"}
    finally:
        router.stop()


def test_a_drain_past_its_timeout_ends_the_streams_with_an_error_event(
    tmp_path: Path, engines: list[Server]
) -> None:
    a, b = engines
    text = router_config(
        f"\n  - {{name: a, url: '{a.url}'}}\n", extra="serving: {drain_timeout_s: 0.5}\n"
    )
    router = start_router(tmp_path, text)
    try:
        long = Stream(router, "script:paced:400:50")  # 20 s
        long.start()
        wait_until(lambda: served(a) >= 1 and long.frames, 10)
        r = httpx.delete(router.url + "/admin/engines/a", headers=ADMIN, timeout=5)
        assert r.status_code == 202
        long.join(15)
        assert not long.is_alive()
        last = long.frames[-1]
        assert isinstance(last, dict) and last["error"]["code"] == "engine_removed"
        wait_until(lambda: "a" not in listed(router), 10)
        metrics = httpx.get(router.url + "/metrics", timeout=5).text
        assert 'narwhal_stream_faults_total{engine="a",reason="engine_removed"} 1.0' in metrics
        # A name drained and added again serves again (at the new URL).
        r = httpx.post(
            router.url + "/admin/engines",
            headers=ADMIN,
            json={"name": "a", "url": b.url},
            timeout=5,
        )
        assert r.status_code == 201
        wait_until(lambda: listed(router).get("a", {}).get("state") == "serving", 10)
    finally:
        router.stop()


def _register(etcd: EtcdServer, key: str, url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(str(BIN / "narwhal"), "register", "--etcd", etcd.url, "--key", key),
            *("--url", url, "--dialect", "lexi", "--ttl", "2"),
        ],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _key(etcd: EtcdServer, key: str) -> dict[str, Any] | None:
    r = httpx.post(etcd.url + "/v3/kv/range", json={"key": _b64(key.encode())}, timeout=5)
    kvs = r.json().get("kvs")
    if not kvs:
        return None
    import base64

    value: dict[str, Any] = orjson.loads(base64.b64decode(kvs[0]["value"]))
    return value


def test_registered_engines_join_and_a_dead_registrars_key_expires(
    tmp_path: Path, etcd: EtcdServer, engines: list[Server]
) -> None:
    a, b = engines
    prefix = f"/f{next(_keys)}/engines/"
    text = (
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2, timeout_s: 1}\n"
        f"engines_from: {{etcd: {{endpoints: ['{etcd.url}'], prefix: '{prefix}'}}}}\n"
    )
    router = start_router(tmp_path, text, wait_ready=False)
    sidecars = [_register(etcd, prefix + "a", a.url), _register(etcd, prefix + "b", b.url)]
    try:
        wait_until(lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 200, 15)
        wait_until(
            lambda: (
                {e["name"] for e in httpx.get(router.url + "/engines").json()["engines"]}
                == {"a", "b"}
            ),
            15,
        )
        assert _key(etcd, prefix + "b") == {"name": "b", "url": b.url, "dialect": "lexi"}
        # A registrar killed outright stops renewing: its key expires within the TTL (2 s)
        # and the router drains the engine.
        os.killpg(sidecars[0].pid, signal.SIGKILL)
        sidecars[0].wait()
        wait_until(lambda: _key(etcd, prefix + "a") is None, 10)
        wait_until(
            lambda: (
                [e["name"] for e in httpx.get(router.url + "/engines").json()["engines"]] == ["b"]
            ),
            10,
        )
        before = served(b)
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "main", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 200 and served(b) == before + 1
        # One stopped with SIGTERM deletes its key at once.
        os.killpg(sidecars[1].pid, signal.SIGTERM)
        assert sidecars[1].wait(10) == 0
        assert _key(etcd, prefix + "b") is None
        # An engine whose /health fails is withdrawn while it stays down.
        sidecars.append(_register(etcd, prefix + "b", b.url))
        wait_until(lambda: _key(etcd, prefix + "b") is not None, 10)
        httpx.post(b.url + "/health", json={"healthy": False}, timeout=5)
        try:
            wait_until(lambda: _key(etcd, prefix + "b") is None, 10)
        finally:
            httpx.post(b.url + "/health", json={"healthy": True}, timeout=5)
        wait_until(lambda: _key(etcd, prefix + "b") is not None, 10)
    finally:
        for s in sidecars:
            if s.poll() is None:
                os.killpg(s.pid, signal.SIGKILL)
                s.wait()
        router.stop()


class Dns(threading.Thread):
    """A DNS server on loopback answering A queries from `addresses` (SERVFAIL while
    `failing`)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.addresses: list[str] = []
        self.failing = False

    def run(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(512)
            except OSError:
                return
            ident, _, _, _, _, _ = struct.unpack(">HHHHHH", data[:12])
            end = data.index(b"\0", 12) + 5
            question = data[12:end]
            qtype = struct.unpack(">H", data[end - 4 : end - 2])[0]
            answers = [] if qtype != 1 else list(self.addresses)
            rcode = 2 if self.failing else 0
            head = struct.pack(">HHHHHH", ident, 0x8180 | rcode, 1, len(answers), 0, 0)
            body = b"".join(
                struct.pack(">HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(a) for a in answers
            )
            self.sock.sendto(head + question + body, peer)


def test_dns_answers_add_and_drain_engines_and_a_failed_lookup_keeps_the_last_set(
    tmp_path: Path,
) -> None:
    port = free_port()
    servers = [
        Server(
            [sys.executable, "-m", "tests.scripted_engine", "--host", host, "--port", str(port)],
            "/health",
            port,
        )
        for host in ("127.0.0.1",)
    ]
    second = subprocess.Popen(
        [sys.executable, "-m", "tests.scripted_engine", "--host", "127.0.0.2", "--port", str(port)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    dns = Dns()
    dns.addresses = ["127.0.0.1"]
    dns.start()
    text = (
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2, timeout_s: 1}\n"
        f"engines_from: {{dns: {{name: engines.test, port: {port}, every_s: 0.2, "
        f"nameserver: '127.0.0.1:{dns.port}', models: [main, main-sql]}}}}\n"
    )
    router = start_router(tmp_path, text, wait_ready=False)

    def names() -> set[str]:
        return {e["name"] for e in httpx.get(router.url + "/engines").json()["engines"]}

    try:
        wait_http(f"http://127.0.0.2:{port}/health", second, 30)
        wait_until(lambda: names() == {"engines-127.0.0.1"}, 15)
        wait_until(lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 200, 15)
        dns.addresses = ["127.0.0.1", "127.0.0.2"]
        wait_until(lambda: names() == {"engines-127.0.0.1", "engines-127.0.0.2"}, 15)
        dns.addresses = ["127.0.0.2"]
        wait_until(lambda: names() == {"engines-127.0.0.2"}, 15)
        for model in ("main", "main-sql"):  # each engine the name brings serves its models
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert r.status_code == 200
        (engine,) = httpx.get(router.url + "/engines").json()["engines"]
        assert engine["models"] == ["main", "main-sql"]
        dns.failing = True
        wait_until(
            lambda: "dns" in httpx.get(router.url + "/ready").json().get("engines_from_stale", {}),
            10,
        )
        assert names() == {"engines-127.0.0.2"}  # the last good set serves on
        assert httpx.get(router.url + "/ready", timeout=5).status_code == 200
    finally:
        router.stop()
        dns.sock.close()
        for s in servers:
            s.stop()
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()


@pytest.mark.slow
def test_membership_edits_survive_a_router_failover(
    tmp_path: Path, etcd: EtcdServer, engines: list[Server]
) -> None:
    a, b = engines
    key = f"/f{next(_keys)}/leader"
    text = (
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2}\n"
        f"ha: {{etcd: ['{etcd.url}'], key: '{key}', lease_ttl_s: 2}}\n"
        "admin: {token_env: NARWHAL_TEST_ADMIN}\n"
        f"engines:\n  - {{name: a, url: '{a.url}'}}\n"
    )
    leader = start_router(tmp_path, text)
    standby = start_router(tmp_path, text, wait_ready=False)
    try:
        add = {"name": "b", "url": b.url}
        r = httpx.post(standby.url + "/admin/engines", headers=ADMIN, json=add, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_leader"
        r = httpx.post(leader.url + "/admin/engines", headers=ADMIN, json=add, timeout=5)
        assert r.status_code == 201
        r = httpx.delete(leader.url + "/admin/engines/a", headers=ADMIN, timeout=5)
        assert r.status_code == 202
        # The standby follows the leader's edits from etcd...
        wait_until(lambda: set(listed(standby)) == {"b"}, 10)
        os.killpg(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait()
        # ... and, leading now, serves that fleet.
        wait_until(lambda: httpx.get(standby.url + "/ready", timeout=5).status_code == 200, 15)
        before = served(b)
        for _ in range(3):
            r = httpx.post(
                standby.url + "/v1/chat/completions",
                json={"model": "main", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert r.status_code == 200
        assert served(b) == before + 3
    finally:
        leader.stop()
        standby.stop()


@pytest.mark.slow
def test_lexi_engine_holds_its_key_while_it_serves_and_withdraws_it_on_stop(
    etcd: EtcdServer, model_path: str
) -> None:
    key = f"/f{next(_keys)}/engines/lexi0"
    engine = start_engine(model_path, "--register-etcd", etcd.url, "--register-key", key)
    try:
        wait_until(lambda: _key(etcd, key) is not None, 15)
        assert _key(etcd, key) == {"name": "lexi0", "url": engine.url, "dialect": "lexi"}
    finally:
        os.killpg(engine.proc.pid, signal.SIGTERM)
        engine.proc.wait(30)
    assert _key(etcd, key) is None


def test_a_reload_applies_engine_changes_and_a_bad_file_changes_nothing(
    tmp_path: Path, engines: list[Server]
) -> None:
    a, b = engines
    text = router_config(f"\n  - {{name: a, url: '{a.url}'}}\n")
    router = start_router(tmp_path, text)
    path = tmp_path / f"narwhal-{router.port}.yaml"

    def reload() -> httpx.Response:
        return httpx.post(router.url + "/admin/reload", headers=ADMIN, timeout=5)

    try:
        # SIGHUP to the main process: b added, a drained, nothing restarted.
        path.write_text(
            router_config(f"\n  - {{name: b, url: '{b.url}'}}\n").replace("$PORT", str(router.port))
        )
        os.kill(router.proc.pid, signal.SIGHUP)
        wait_until(lambda: set(listed(router)) == {"b"}, 10)
        assert listed(router)["b"]["source"] == "config"
        # A file that does not load, or changes what needs a restart: refused, kept.
        for bad, why in (
            ("engines: [", "not valid YAML"),
            (router_config("\n  - {name: b, url: 'ftp://x'}\n"), "engines.0.url"),
            (text.replace("$PORT", str(free_port())), "a change here needs a restart"),
            # Client keys are matched from a list built at start.
            (
                router_config(
                    f"\n  - {{name: b, url: '{b.url}'}}\n", "auth: {api_keys: [k]}\n"
                ).replace("$PORT", str(router.port)),
                "api_keys: a change here needs a restart",
            ),
            # What a running router does not apply is refused by name, never a silent 200.
            (
                router_config(
                    f"\n  - {{name: b, url: '{b.url}'}}\n",
                    "engines_from: {dns: {name: engines.test, port: 9}}\n",
                ).replace("$PORT", str(router.port)),
                "engines_from.dns: a change here needs a restart",
            ),
            (
                router_config(
                    f"\n  - {{name: b, url: '{b.url}'}}\n",
                    "serving: {header_timeout_s: 3, max_connections: 9}\n"
                    "prefix_cache: {tokens_per_engine: 10}\n",
                ).replace("$PORT", str(router.port)),
                "serving.header_timeout_s, serving.max_connections, "
                "prefix_cache.tokens_per_engine: a change here needs a restart",
            ),
            # A typo beside a key: the error names the path and the rule, not the key.
            (
                router_config(
                    f"\n  - {{name: b, url: '{b.url}'}}\n",
                    "auth: {api_keys: [{key: sk-live-0f9e8d, tenant: 'gold team'}]}\n",
                ).replace("$PORT", str(router.port)),
                "auth.api_keys.0: tenant: must match the pattern",
            ),
        ):
            path.write_text(bad)
            r = reload()
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_config"
            assert why in r.json()["error"]["message"]
            assert why in httpx.get(router.url + "/ready", timeout=5).json()["reload_error"]
            assert set(listed(router)) == {"b"}
        for said in (r.text, httpx.get(router.url + "/ready", timeout=5).text, router.stderr()):
            assert "sk-live-0f9e8d" not in said
        # What a reload does apply is applied (here: the probes' interval, read each round).
        path.write_text(
            router_config(f"\n  - {{name: b, url: '{b.url}'}}\n")
            .replace("interval_s: 0.2", "interval_s: 0.3")
            .replace("$PORT", str(router.port))
        )
        assert reload().status_code == 200
        path.write_text(text.replace("$PORT", str(router.port)))
        assert reload().status_code == 200
        wait_until(lambda: set(listed(router)) == {"a"}, 10)
        assert "reload_error" not in httpx.get(router.url + "/ready", timeout=5).json()
    finally:
        router.stop()


def test_an_added_engine_starts_from_the_fleets_profile_and_is_measured_at_once(
    tmp_path: Path, engines: list[Server]
) -> None:
    a, b = engines
    # No round of probes within the test, however long the machine has been up: what is
    # measured is measured because it never was (the monotonic clock counts from boot, and
    # "never" once read as recent on a machine up for less than the interval).
    text = router_config(
        f"\n  - {{name: a, url: '{a.url}'}}\n", extra="predictive: {probe_interval_s: 1000000000}\n"
    ).replace("admission: open", "admission: predictive")
    router = start_router(tmp_path, text)

    def profiles() -> dict[str, dict[str, Any]]:
        ready = httpx.get(router.url + "/ready", timeout=5).json()
        return {e["name"]: e["profile"] for e in ready["engines"]}

    try:
        wait_until(lambda: profiles()["a"]["prefill_samples"] >= 1, 15)
        r = httpx.post(
            router.url + "/admin/engines", headers=ADMIN, json={"name": "b", "url": b.url}
        )
        assert r.status_code == 201
        # Not cold (which admits everything): the fleet's figures until its own come...
        assert profiles()["b"]["prefill_tokens_per_s"] is not None
        # ... and those come from a probe now, not at the next round, 10 minutes away.
        wait_until(lambda: profiles()["b"]["prefill_samples"] >= 1, 15)
    finally:
        router.stop()
