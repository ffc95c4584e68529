"""LoRA adapters on LexiEngine, on the real model: an adapter (`--lora NAME=PATH`) is a model
of its own beside the base, listed on /v1/models; llama.cpp applies adapters to a whole
context, so requests of the base and of an adapter decode in turns, each answer what it
would be alone; a router following the engine's models (`models: auto`) serves it."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.lora_gguf import write_lora
from tests.support import Server, start_engine, start_router

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    lora = write_lora(tmp_path_factory.mktemp("lora") / "sql.gguf")
    e = start_engine(model_path, "--alias", "smol", "--lora", f"smol-sql={lora}", "--parallel", "4")
    yield e
    e.stop()


def answer(url: str, model: str) -> str:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_an_adapter_is_a_model_beside_the_base(engine: Server) -> None:
    listed = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["smol", "smol-sql"]
    assert listed[1]["root"] == "smol"
    assert httpx.get(engine.url + "/v1/models/smol-sql", timeout=10).status_code == 200
    # Greedy: the adapter changes the answer, and each answers the same every time.
    base, sql = answer(engine.url, "smol"), answer(engine.url, "smol-sql")
    assert base != sql
    assert answer(engine.url, "smol") == base


def at_once(url: str, models: list[str]) -> list[tuple[str, str]]:
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        return list(pool.map(lambda m: (m, answer(url, m)), models))


def test_base_and_adapter_requests_decode_in_turns_and_answer_as_alone(engine: Server) -> None:
    alone = {m: answer(engine.url, m) for m in ("smol", "smol-sql")}
    # One of each at once: each adapter's step holds its request alone, as when it ran
    # alone, so the answers are the same to the token.
    pair = at_once(engine.url, ["smol", "smol-sql"])
    assert all(text == alone[m] for m, text in pair), pair
    # Two of each (four slots): a step holds both requests of one adapter. A batch of two
    # may round differently from a batch of one on some CPUs (llama.cpp's kernels differ
    # by batch size, and the second request may join the first mid-answer), so a late token
    # may differ; each answer still follows its own model's answer further than the other's
    # (an adapter applied to the wrong request answers as the other model from the start).
    four = at_once(engine.url, ["smol", "smol-sql"] * 2)
    other = {"smol": "smol-sql", "smol-sql": "smol"}
    assert all(common(text, alone[m]) > common(text, alone[other[m]]) for m, text in four), (
        alone,
        four,
    )


def common(a: str, b: str) -> int:
    """How many leading characters two answers share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_a_router_following_the_engine_serves_its_adapter(engine: Server, tmp_path: Path) -> None:
    router = start_router(
        tmp_path,
        "model: smol\nlisten: {port: $PORT}\nadmission: open\n"
        f"engines:\n  - {{name: lexi, url: '{engine.url}', models: auto}}\n",
    )
    try:
        listed = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in listed] == ["smol", "smol-sql"]
        assert listed[1]["root"] == "smol"  # what the engine says of it, passed on
        assert answer(router.url, "smol-sql") == answer(engine.url, "smol-sql")
    finally:
        router.stop()
