"""Client API keys on the router, and the router's own key for an engine started with
`--api-key`; no secret shows in /ready, /engines, /metrics or the log."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import Server, refused_config, start_engine, start_router

pytestmark = pytest.mark.slow

UPSTREAM = "engine-secret-7f3a"


@pytest.fixture(scope="module")
def router(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    engine = start_engine(model_path, "--api-key", UPSTREAM, "--alias", "main")
    os.environ.update(
        NARWHAL_TEST_CLIENT_KEYS="client-key-two, client-key-three", NARWHAL_TEST_UPSTREAM=UPSTREAM
    )
    try:
        r = start_router(
            tmp_path_factory.mktemp("auth"),
            f"""
listen: {{port: $PORT}}
admission: open
auth: {{api_keys: [client-key-one], api_keys_env: NARWHAL_TEST_CLIENT_KEYS}}
engines:
  - {{name: e, url: '{engine.url}', dialect: lexi, api_key_env: NARWHAL_TEST_UPSTREAM}}
""",
        )
    finally:
        for k in ("NARWHAL_TEST_CLIENT_KEYS", "NARWHAL_TEST_UPSTREAM"):
            del os.environ[k]
    yield r
    r.stop()
    engine.stop()


def ask(r: Server, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        r.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers=headers,
        timeout=30,
    )


@pytest.mark.parametrize("key", [None, "nope", "client-key-onex", ""])
def test_a_missing_or_wrong_key_is_401_in_the_envelope(router: Server, key: str | None) -> None:
    r = ask(router, key)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(router.url + "/v1/models").status_code == 401


def test_keys_from_the_file_and_the_environment_work_and_reach_a_keyed_engine(
    router: Server,
) -> None:
    for key in ("client-key-one", "client-key-two", "client-key-three"):
        assert ask(router, key).status_code == 200  # the engine accepted the router's key
    from openai import OpenAI

    client = OpenAI(base_url=router.url + "/v1", api_key="client-key-one")
    assert client.completions.create(model="main", prompt="Hi", max_tokens=2).choices


def test_probes_stay_open_and_no_secret_shows(router: Server) -> None:
    for path in ("/health", "/ready", "/metrics", "/engines"):
        r = httpx.get(router.url + path)
        assert r.status_code == 200, path
        for secret in (UPSTREAM, "client-key-one", "client-key-two"):
            assert secret not in r.text, (path, secret)
    log = router.stderr()
    assert UPSTREAM not in log and "client-key-two" not in log


def test_an_unset_key_variable_is_refused_at_start(tmp_path: Path) -> None:
    stderr = refused_config(
        tmp_path,
        "auth: {api_keys_env: NARWHAL_TEST_NOT_SET}\nengines: [{name: e, url: 'http://x'}]\n",
    )
    assert "auth.api_keys_env: the environment variable NARWHAL_TEST_NOT_SET is not set" in stderr
