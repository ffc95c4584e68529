"""One router for several models: each engine serves the models its spec lists, a request
goes only to engines serving its model, aliases stand for served names, `/v1/models` lists
them all, a tenant's key may be limited to some. Real processes: the router in front of
scripted engines that speak HTTP/SSE and say what they were asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import (
    Server,
    chat,
    start_engine,
    start_router,
    start_test_engine,
    stats,
    wait_until,
)

pytestmark = pytest.mark.slow

TOKEN = "models-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
SQL_KEY = {"authorization": "Bearer sql-team-key"}
ANY_KEY = {"authorization": "Bearer any-team-key"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Server]]]:
    engines = {n: start_test_engine("tests.scripted_engine") for n in ("a1", "a2", "b", "c")}
    engines["d"] = start_test_engine("tests.scripted_engine", "--models", "model-d")
    mp = pytest.MonkeyPatch()
    mp.setenv("NARWHAL_TEST_MODELS_ADMIN", TOKEN)
    # a1 serves model A and its adapter A-sql, a2 model A alone, b model B; c joins later; d
    # serves what its own /v1/models lists.
    router = start_router(
        tmp_path_factory.mktemp("models"),
        f"""
model: model-a
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 0.2, timeout_s: 1}}
admin: {{token_env: NARWHAL_TEST_MODELS_ADMIN}}
aliases: {{assistant: model-a}}
auth:
  api_keys:
    - {{key: sql-team-key, tenant: sql-team, models: [model-a-sql, assistant]}}
    - {{key: any-team-key, tenant: any-team}}
engines:
  - {{name: a1, url: '{engines["a1"].url}', dialect: vllm, models: [model-a, model-a-sql]}}
  - {{name: a2, url: '{engines["a2"].url}', dialect: vllm, models: [model-a]}}
  - {{name: b, url: '{engines["b"].url}', models: [model-b]}}
  - {{name: d, url: '{engines["d"].url}', models: auto}}
""",
    )
    mp.undo()
    yield router, engines
    router.stop()
    for e in engines.values():
        e.stop()


def ask(router: Server, model: str | None, key: dict[str, str] = ANY_KEY) -> httpx.Response:
    body: dict[str, Any] = chat("hello")
    if model is None:
        body.pop("model", None)
    else:
        body["model"] = model
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=key, timeout=30)


def listed(router: Server) -> list[str]:
    r = httpx.get(router.url + "/v1/models", headers=ANY_KEY, timeout=10)
    return [m["id"] for m in r.json()["data"]]


def served(engines: dict[str, Server]) -> dict[str, int]:
    return {n: int(stats(e)["requests"]) for n, e in engines.items()}


def test_each_model_goes_only_to_the_engines_that_serve_it(
    fleet: tuple[Server, dict[str, Server]],
) -> None:
    router, engines = fleet
    for model, where, asked in (
        ("model-a", {"a1", "a2"}, "model-a"),
        ("assistant", {"a1", "a2"}, "model-a"),  # an alias: the engine gets what it stands for
        (None, {"a1", "a2"}, "model-a"),  # no model: the router's `model`
        ("model-a-sql", {"a1"}, "model-a-sql"),
        ("model-b", {"b"}, "model-b"),
    ):
        before = served(engines)
        for _ in range(4):
            r = ask(router, model)
            assert r.status_code == 200, r.text
        after = served(engines)
        took = {n for n in engines if after[n] > before[n]}
        assert took and took <= where, (model, took)
        assert sum(after.values()) - sum(before.values()) == 4
        for name in took:
            said = stats(engines[name])["last"].get("model")
            # A request that names no model goes as it came to an engine of one model (it
            # answers with that one); one of several is told which.
            assert said == (None if model is None and name == "a2" else asked), (model, name)
    # Each model's requests are its own series: the name the client used, never an unknown.
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for model in ("model-a", "assistant", "model-a-sql", "model-b"):
        assert (
            f'narwhal_responses_total{{code="200",model="{model}",route="/v1/chat/completions"}}'
            in text
        )
    assert 'model="model-z"' not in text
    # ...and so are what each engine relayed for it.
    assert 'narwhal_completed_total{engine="b",model="model-b"}' in text
    assert 'narwhal_completed_total{engine="b",model="model-a"}' not in text


def test_models_are_listed_and_others_are_not_found(
    fleet: tuple[Server, dict[str, Server]],
) -> None:
    router, _ = fleet
    listed = httpx.get(router.url + "/v1/models", headers=ANY_KEY, timeout=10).json()["data"]
    ids = [m["id"] for m in listed]
    assert ids == ["model-a", "model-a-sql", "model-b", "model-d", "assistant"]
    assert next(m for m in listed if m["id"] == "assistant")["root"] == "model-a"
    one = httpx.get(router.url + "/v1/models/model-a-sql", headers=ANY_KEY, timeout=10)
    assert one.status_code == 200 and one.json()["id"] == "model-a-sql"
    for r in (
        httpx.get(router.url + "/v1/models/model-z", headers=ANY_KEY, timeout=10),
        ask(router, "model-z"),
    ):
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "model-z" in err["message"]


def test_a_key_limited_to_some_models_gets_403_for_others(
    fleet: tuple[Server, dict[str, Server]],
) -> None:
    router, _ = fleet
    for model in ("model-a-sql", "assistant"):
        assert ask(router, model, SQL_KEY).status_code == 200
    for model in ("model-b", "model-a", None):  # the router's `model` is not on its list
        r = ask(router, model, SQL_KEY)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "model_not_allowed"
    assert ask(router, "model-b", ANY_KEY).status_code == 200


def test_an_engine_that_joins_brings_its_models(fleet: tuple[Server, dict[str, Server]]) -> None:
    router, engines = fleet
    assert ask(router, "model-c").status_code == 404
    r = httpx.post(
        router.url + "/admin/engines",
        headers=ADMIN,
        json={"name": "c", "url": engines["c"].url, "models": ["model-c"]},
        timeout=5,
    )
    assert r.status_code == 201, r.text
    wait_until(lambda: ask(router, "model-c").status_code == 200, 10)
    assert stats(engines["c"])["last"]["model"] == "model-c"
    ids = [m["id"] for m in httpx.get(router.url + "/v1/models", headers=ANY_KEY).json()["data"]]
    assert "model-c" in ids
    bad = httpx.post(
        router.url + "/admin/engines",
        headers=ADMIN,
        json={"name": "d", "url": engines["c"].url, "models": "model-d"},
        timeout=5,
    )
    assert bad.status_code == 400 and "models" in bad.text


def test_an_engine_that_loads_an_adapter_is_followed(
    fleet: tuple[Server, dict[str, Server]],
) -> None:
    """`models: auto`: what the engine's own /v1/models lists, read at every health probe."""
    router, engines = fleet
    d = engines["d"]
    wait_until(lambda: "model-d" in listed(router), 10)
    assert ask(router, "model-d-lora").status_code == 404
    httpx.post(d.url + "/models", json=["model-d", "model-d-lora"], timeout=5)
    wait_until(lambda: "model-d-lora" in listed(router), 10)  # within a probe (0.2 s here)
    said = httpx.get(router.url + "/v1/models/model-d-lora", headers=ANY_KEY, timeout=10).json()
    assert said["owned_by"] == "scripted"  # the engine's own word on it
    r = ask(router, "model-d-lora")
    assert r.status_code == 200, r.text
    assert stats(d)["last"]["model"] == "model-d-lora"
    httpx.post(d.url + "/models", json=["model-d"], timeout=5)  # unloaded
    wait_until(lambda: "model-d-lora" not in listed(router), 10)
    assert ask(router, "model-d-lora").status_code == 404


def test_lexi_engine_s_names_are_followed_with_models_auto(model_path: str, tmp_path: Path) -> None:
    """LexiEngine lists its model and its aliases on /v1/models: with `models: auto` the
    router serves each of them there."""
    engine = start_engine(model_path, "--alias", "smol", "--alias", "tiny")
    router = start_router(
        tmp_path,
        "model: smol\nlisten: {port: $PORT}\nadmission: open\n"
        f"engines:\n  - {{name: lexi, url: '{engine.url}', models: auto}}\n",
    )
    try:
        ids = listed(router)
        assert {"smol", "tiny"} <= set(ids)
        body = chat("Say hi.", max_tokens=4)
        body["model"] = "tiny"
        r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert ask(router, "gpt-4").status_code == 404
    finally:
        router.stop()
        engine.stop()
