"""The router's doors, tried as an attacker or an unlucky operator would: what a runtime
registrant may name (key variables, destinations), what reaches the log and the answers
(passwords, keys), and auth that fails closed. Real processes: the router and the
scripted engine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import (
    Server,
    free_port,
    refused_config,
    start_router,
    start_test_engine,
    wait_until,
)

pytestmark = pytest.mark.slow

TOKEN = "doors-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "main", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_TEST_ADMIN", TOKEN)
    monkeypatch.setenv("NARWHAL_TEST_ENGINE_KEY", "engine-key-1")
    monkeypatch.setenv("NARWHAL_TEST_OTHER_KEY", "engine-key-2")


@pytest.fixture
def engine() -> Iterator[Server]:
    s = start_test_engine("tests.scripted_engine")
    yield s
    s.stop()


def stats(engine: Server) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(engine.url + "/stats", timeout=5).json()
    return out


def add(router: Server, **body: Any) -> httpx.Response:
    return httpx.post(router.url + "/admin/engines", json=body, headers=ADMIN, timeout=5)


def test_a_registrant_names_only_listed_key_variables_and_allowed_destinations(
    tmp_path: Path, engine: Server
) -> None:
    router = start_router(
        tmp_path,
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2, timeout_s: 1}\n"
        "admin: {token_env: NARWHAL_TEST_ADMIN}\n"
        "engines_from: {api_key_envs: [NARWHAL_TEST_ENGINE_KEY]}\n",
        wait_ready=False,
    )
    try:
        # The admin token's variable (or any other secret's) is not a key it may ask for.
        r = add(router, name="thief", url=engine.url, api_key_env="NARWHAL_TEST_ADMIN")
        assert r.status_code == 400 and r.json()["error"]["param"] == "api_key_env", r.text
        assert "engines_from.api_key_envs" in r.json()["error"]["message"]
        # Link-local (the metadata service) and the router's own port are no engine.
        for url in (
            "http://169.254.169.254",
            "http://[fe80::1]:80",
            f"http://127.0.0.1:{router.port}",
        ):
            r = add(router, name="meta", url=url)
            assert r.status_code == 400 and r.json()["error"]["param"] == "url", (url, r.text)
        # A listed variable is fine, and its key goes to that engine alone.
        r = add(router, name="good", url=engine.url, api_key_env="NARWHAL_TEST_ENGINE_KEY")
        assert r.status_code == 201, r.text
        wait_until(lambda: httpx.get(router.url + "/ready", timeout=5).status_code == 200, 15)
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert stats(engine)["authorizations"][-1] == "Bearer engine-key-1"
        # A registered engine's probe results stay off the open routes.
        dead = f"http://127.0.0.1:{free_port()}"
        assert add(router, name="dead", url=dead).status_code == 201
        wait_until(
            lambda: "/health failed" in str(admin_reason(router, "dead")),
            10,
        )
        for route in ("/engines", "/ready"):
            shown = {e["name"]: e for e in httpx.get(router.url + route).json()["engines"]}
            assert "/health" not in str(shown["dead"]["reason"]), route
        assert TOKEN not in router.stderr()
    finally:
        router.stop()


def admin_reason(router: Server, name: str) -> object:
    r = httpx.get(router.url + "/admin/engines/" + name, headers=ADMIN, timeout=5)
    return r.json().get("reason")


def test_credentials_in_an_engine_url_go_with_every_request_and_never_to_the_log(
    tmp_path: Path, engine: Server
) -> None:
    url = engine.url.replace("http://", "http://ops:hunter2-pw@")
    router = start_router(
        tmp_path,
        f"listen: {{port: $PORT}}\nadmission: open\nengines: [{{name: s, url: '{url}'}}]\n",
    )
    try:
        assert httpx.post(router.url + "/v1/chat/completions", json=CHAT).status_code == 200
        # As the health probes send them: Basic, user and password.
        assert stats(engine)["authorizations"][-1] == "Basic b3BzOmh1bnRlcjItcHc="
        shown = httpx.get(router.url + "/engines").json()["engines"][0]["url"]
        assert "hunter2" not in shown and "ops:***@" in shown
        assert "hunter2" not in router.stderr()
        assert "ops:***@" in router.stderr()  # the start-up line names it, redacted
    finally:
        router.stop()


def test_two_engines_at_one_url_each_send_their_own_key(tmp_path: Path, engine: Server) -> None:
    router = start_router(
        tmp_path,
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2, timeout_s: 1}\n"
        "engines:\n"
        f"  - {{name: a, url: '{engine.url}', api_key_env: NARWHAL_TEST_ENGINE_KEY}}\n"
        f"  - {{name: b, url: '{engine.url}', api_key_env: NARWHAL_TEST_OTHER_KEY}}\n",
    )
    held = {**CHAT, "messages": [{"role": "user", "content": "script:held"}], "stream": True}
    threads = [
        threading.Thread(
            target=lambda: httpx.post(router.url + "/v1/chat/completions", json=held, timeout=30)
        )
        for _ in range(2)
    ]
    try:
        # Both held at once: the least-loaded pick puts one on each engine.
        threads[0].start()
        wait_until(lambda: stats(engine)["active"] == 1, 10)
        threads[1].start()
        wait_until(lambda: stats(engine)["active"] == 2, 10)
        assert sorted(stats(engine)["authorizations"]) == [
            "Bearer engine-key-1",
            "Bearer engine-key-2",
        ]
    finally:
        httpx.post(engine.url + "/release")
        for t in threads:
            t.join(30)
        router.stop()


@pytest.mark.parametrize("value", ["", " , ", ",,"])
def test_client_auth_that_yields_no_key_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_CLIENT_KEYS", value)
    stderr = refused_config(
        tmp_path,
        "auth: {api_keys_env: NARWHAL_TEST_CLIENT_KEYS}\nengines: [{name: e, url: 'http://x'}]\n",
    )
    assert "auth.api_keys_env" in stderr and "NARWHAL_TEST_CLIENT_KEYS" in stderr


def test_two_keys_of_one_tenant_that_disagree_are_refused_with_the_path(tmp_path: Path) -> None:
    stderr = refused_config(
        tmp_path,
        "auth:\n  api_keys:\n"
        "    - {key: k1, tenant: gold, priority: critical}\n"
        "    - {key: k2, tenant: gold, priority: sheddable}\n"
        "engines: [{name: e, url: 'http://x'}]\n",
    )
    assert "auth.api_keys.1: tenant 'gold' is also given by auth.api_keys.0" in stderr
    assert "k1" not in stderr and "k2" not in stderr


def test_a_non_ascii_client_key_matches_the_bytes_a_client_sends(
    tmp_path: Path, engine: Server
) -> None:
    router = start_router(
        tmp_path,
        "listen: {port: $PORT}\nadmission: open\nauth: {api_keys: ['clé-ünï']}\n"
        f"engines: [{{name: s, url: '{engine.url}'}}]\n",
    )
    try:

        def ask(key: bytes) -> int:
            headers = {"authorization": b"Bearer " + key}
            r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, headers=headers)
            return r.status_code

        assert ask("clé-ünï".encode()) == 200
        assert ask("clé-ünï".encode("latin-1")) == 401
        assert ask(b"cle-uni") == 401
    finally:
        router.stop()


def test_engine_urls_in_the_config_may_not_carry_a_key_twice(tmp_path: Path) -> None:
    stderr = refused_config(
        tmp_path,
        "engines: [{name: e, url: 'http://u:p@x', api_key_env: NARWHAL_TEST_ENGINE_KEY}]\n",
    )
    assert "engines.0: give the engine's key in `api_key_env` or in the URL, not both" in stderr
    assert os.environ["NARWHAL_TEST_ENGINE_KEY"] not in stderr
