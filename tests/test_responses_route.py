"""`/v1/responses` through the router: admitted, placed and relayed like the completion
routes, to engines whose dialect serves it; the OpenAI SDK's `responses.create` works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import Server, start_engine, start_router

pytestmark = pytest.mark.slow

FORCED = 'root ::= "Four."'


@pytest.fixture(scope="module")
def router(
    model_path: str, scripted: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    engine = start_engine(model_path, "--alias", "main")
    # The scripted engine speaks sglang's dialect, which does not serve the route: never
    # placed on for it.
    r = start_router(
        tmp_path_factory.mktemp("resp"),
        f"""
listen: {{port: $PORT}}
admission: open
engines:
  - {{name: old, url: '{scripted.url}', dialect: sglang}}
  - {{name: lexi, url: '{engine.url}', dialect: lexi}}
""",
    )
    yield r
    r.stop()
    engine.stop()


def test_the_sdk_s_responses_create_works_through_the_router(router: Server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=router.url + "/v1", api_key="x")
    for _ in range(3):  # never placed on the engine whose dialect cannot serve it
        r = client.responses.create(
            model="main", input="What is 2+2?", extra_body={"grammar": FORCED}
        )
        assert r.output_text == "Four." and r.status == "completed"
    events = list(
        client.responses.create(
            model="main", input="What is 2+2?", stream=True, extra_body={"grammar": FORCED}
        )
    )
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Four."


def test_the_engine_s_refusal_passes_through(router: Server) -> None:
    r = httpx.post(router.url + "/v1/responses", json={"input": "hi", "previous_response_id": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(router.url + "/v1/responses", json={"input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_no_engine_that_serves_it_is_404_unsupported(scripted: Server, tmp_path: Path) -> None:
    r = start_router(
        tmp_path,
        f"listen: {{port: $PORT}}\nadmission: open\n"
        f"engines: [{{name: s, url: '{scripted.url}', dialect: sglang}}]\n",
    )
    try:
        resp = httpx.post(r.url + "/v1/responses", json={"input": "hi"})
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "unsupported"
        assert "/v1/responses" in resp.json()["error"]["message"]
    finally:
        r.stop()
