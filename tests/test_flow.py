"""The flow on its own, in process: the router's real stages wired as `narwhal serve` wires
them, no socket (every request here ends before an engine is called). Each way a request
ends is one row of `router/endings.py`, counted once: `narwhal_finished_total` adds up to
`narwhal_offered_total`, and a refusal lands in its counter under its own label."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from narwhal.errors import ApiError
from narwhal.router.app import Router
from narwhal.router.config import parse
from narwhal.router.ha.leadership import Role
from tests.support import measured

BUDGET_S = 1.0


def router() -> Router:
    r = Router(
        parse(
            {
                "model": "main",
                "engines": [{"name": "a", "url": "http://127.0.0.1:9"}],
                "admission": "predictive",
                "predictive": {"ttft_budget_s": BUDGET_S},
            }
        )
    )
    for e in r.pool.engines:
        e.healthy = True
    assert r.predictor is not None
    for p in r.predictor.profiles.values():
        measured(p, 1000.0, 4.0)  # 1,000 tokens a second, 4 bytes a token
        p.measured_at = time.monotonic()
    return r


def call(r: Router, body: bytes) -> ApiError:
    """One chat completion through the flow; the error it ended with."""
    scope: dict[str, Any] = {"type": "http", "method": "POST", "headers": []}
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if sent:  # the body went: the client then waits (and stays)
            await asyncio.sleep(3600)
        sent.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is sent by a request that ends here: {message}")

    with pytest.raises(ApiError) as e:
        asyncio.run(r.flow("/v1/chat/completions", scope, receive, send))
    return e.value


def chat(words: int) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "word " * words}]})


def sample(r: Router, name: str, **labels: str) -> float:
    value = r.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


def finished(r: Router) -> dict[str, float]:
    out = {}
    for metric in r.metrics.registry.collect():
        for s in metric.samples:
            if s.name == "narwhal_finished_total" and s.value:
                out[s.labels["outcome"]] = s.value
    return out


def test_each_way_a_request_ends_before_an_engine_is_counted_once_under_its_row() -> None:
    r = router()
    e = call(r, b"{not json")
    assert (e.status, finished(r)) == (400, {"invalid": 1.0})
    assert sample(r, "narwhal_invalid_requests_total") == 1

    e = call(r, chat(2000))  # 10 kB: 2,500 tokens, 2.5 s alone at 1,000 a second
    assert (e.status, e.code) == (429, "prompt_exceeds_ttft_budget")
    assert finished(r) == {"invalid": 1.0, "refused": 1.0}
    refused = ("narwhal_refused_total", {"reason": "prompt_exceeds_ttft_budget", "model": "main"})
    assert sample(r, refused[0], **refused[1]) == 1

    r.admission.retained = r.admission.retention_limit  # the router holds all it may
    e = call(r, chat(10))
    assert (e.status, e.code) == (429, "retention_full")
    assert sample(r, "narwhal_rejected_total", reason="retention", model="main") == 1
    r.admission.retained = 0

    r.leadership.role, r.leadership.reason = Role.STANDBY, "standby: another router leads"
    e = call(r, chat(10))
    assert (e.status, e.code) == (503, "standby")
    assert sample(r, "narwhal_rejected_total", reason="standby", model="main") == 1

    # Every request offered ended exactly once, whatever ended it.
    assert sum(finished(r).values()) == sample(r, "narwhal_offered_total") == 4
    assert finished(r) == {"invalid": 1.0, "refused": 1.0, "rejected": 2.0}
    assert r.admission.retained == 0  # retention given back on every way out
