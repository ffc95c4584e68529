"""Decision records: for a placed and for a refused request, the engines weighed (each
one's projected TTFT and the cache expected there), the choice or the refusal and why, and
what was measured, on the admin API; the ring they are kept in is bounded."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.router.decisions import Decision, Decisions
from tests.otlp_receiver import Receiver, Span
from tests.support import Server, start_router, start_test_engine
from tests.test_predictive import MS_PER_TOKEN, chat, prompt
from tests.test_traces import of_request

TOKEN = "decisions-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def test_the_ring_keeps_the_last_records_and_no_more() -> None:
    ring = Decisions(100)
    for i in range(100_000):
        ring.keep(Decision(f"r{i}", "", "standard", 10))
    assert len(ring) == 100
    assert ring.get("r99999") is not None and ring.get("r99899") is None
    assert [d.id for d in ring.newest(None, 3)] == ["r99999", "r99998", "r99997"]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """Where the router's spans go: with traces on, a record is its placement span too."""
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver
) -> Iterator[tuple[Server, list[Server]]]:
    engines = [
        start_test_engine("tests.scripted_engine", "--prefill-ms-per-token", str(MS_PER_TOKEN))
        for _ in range(2)
    ]
    mp = pytest.MonkeyPatch()
    mp.setenv("NARWHAL_TEST_DECISIONS_ADMIN", TOKEN)
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    listed = "".join(
        f"\n  - {{name: e{i}, url: '{e.url}', dialect: lexi}}" for i, e in enumerate(engines)
    )
    router = start_router(
        tmp_path_factory.mktemp("d"),
        "model: main\nlisten: {port: $PORT}\nadmission: predictive\n"
        "predictive: {ttft_budget_s: 1.0}\nhealth: {interval_s: 0.2}\n"
        "admin: {token_env: NARWHAL_TEST_DECISIONS_ADMIN, decision_records: 50}\n"
        f"telemetry: {{otlp_endpoint: '{receiver.url}'}}\n"
        f"engines:{listed}\n",
    )
    mp.undo()
    # The fleet learns until a profile vouches for 1,500-token prompts: the engine placement
    # passes over for the long ones (its twin projects a hair faster) is judged by that one
    # (`Predictor.lender`), so waiting for both to vouch waited on a coin toss. A 400-token
    # prompt takes 0.8 s of the 1 s budget, which the margin of a fleet that has missed a
    # few cold projections refuses: the warm-up asks for a budget of its own.
    for _ in range(20):
        if max(vouched(router)) >= 1500:
            break
        for tokens in (100, 200, 300, 400):
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json=chat(prompt(tokens)),
                headers={"x-narwhal-ttft-target-ms": "5000"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
    assert max(vouched(router)) >= 1500
    yield router, engines
    router.stop()
    for e in engines:
        e.stop()


def vouched(router: Server) -> list[int]:
    ready = httpx.get(router.url + "/ready", timeout=10).json()
    return [int(e["profile"]["vouched_up_to_tokens"]) for e in ready["engines"]]


def record(router: Server, rid: str) -> dict[str, Any]:
    r = httpx.get(router.url + f"/admin/requests/{rid}", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.slow
def test_a_placed_request_says_what_was_weighed_chosen_and_measured(
    fleet: tuple[Server, list[Server]], receiver: Receiver
) -> None:
    router, _ = fleet
    shared = f"script:prefill:{MS_PER_TOKEN}:{uuid.uuid4().hex} " + "w" * 1200
    first = httpx.post(router.url + "/v1/chat/completions", json=chat(shared + " a"), timeout=30)
    assert first.status_code == 200
    again = httpx.post(
        router.url + "/v1/chat/completions",
        json=chat(shared + " b"),
        headers={"x-session-id": "conversation-7"},
        timeout=30,
    )
    assert again.status_code == 200
    d = record(router, again.headers["x-request-id"])
    assert d["session"] == "conversation-7"  # what may have steered it
    assert d["outcome"] == "completed" and d["refusal"] is None
    weighed = {c["engine"]: c for c in d["candidates"]}
    assert set(weighed) == {"e0", "e1"}
    assert all(c["projected_ttft_ms"] > 0 for c in weighed.values())
    home = record(router, first.headers["x-request-id"])["choice"]
    # Its prefix was placed on the first one's engine: expected in that engine's cache alone.
    assert weighed[home]["cached_tokens_expected"] > 0
    assert all(c["cached_tokens_expected"] == 0 for n, c in weighed.items() if n != home)
    assert d["choice"] in weighed and weighed[d["choice"]]["chosen"] and d["why"]
    assert d["measured"]["engine"] == d["choice"]
    assert d["measured"]["ttfb_ms"] > 0 and d["measured"]["tokens_in"] > 0
    # The same record is the request's placement span: an event per engine weighed.
    rid = again.headers["x-request-id"]
    placement = placement_span(receiver, rid)
    assert placement.attributes["narwhal.choice"] == d["choice"]
    events = {e["engine"]: e for name, e in placement.events if name == "candidate"}
    assert set(events) == {"e0", "e1"}
    assert events[home]["cached_tokens_expected"] == weighed[home]["cached_tokens_expected"]


def placement_span(receiver: Receiver, rid: str) -> Span:
    spans = receiver.wait_for(lambda s: "placement" in {x.name for x in of_request(s, rid)})
    return next(s for s in of_request(spans, rid) if s.name == "placement")


@pytest.mark.slow
def test_a_refused_request_says_why_and_is_listed_with_the_refusals(
    fleet: tuple[Server, list[Server]], receiver: Receiver
) -> None:
    router, _ = fleet
    r = httpx.post(router.url + "/v1/chat/completions", json=chat(prompt(1500)), timeout=30)
    assert r.status_code == 429
    rid = r.headers["x-request-id"]
    assert rid in r.json()["error"]["message"]  # the client can quote it
    d = record(router, rid)
    assert d["outcome"] == "refused" and d["choice"] is None
    assert d["refusal"]["code"] == "prompt_exceeds_ttft_budget" == d["reason"]
    assert {c["engine"] for c in d["candidates"]} == {"e0", "e1"}
    # Each engine's projection is past the 1 s budget: 1,500 tokens at 2 ms each.
    assert all(c["own_prefill_ms"] > d["budget_ms"] for c in d["candidates"])
    assert d["measured"] == {}
    listed = httpx.get(
        router.url + "/admin/requests?outcome=refused&limit=5", headers=ADMIN, timeout=10
    )
    assert listed.status_code == 200
    assert rid in [x["request_id"] for x in listed.json()["data"]]
    assert all(x["outcome"] == "refused" for x in listed.json()["data"])
    # Behind the admin token; a limit out of range is a 400 in the envelope.
    assert httpx.get(router.url + f"/admin/requests/{rid}", timeout=10).status_code == 401
    bad = httpx.get(router.url + "/admin/requests?limit=0", headers=ADMIN, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    gone = httpx.get(router.url + "/admin/requests/nope", headers=ADMIN, timeout=10)
    assert gone.status_code == 404
    # Its trace says so too: the request's span failed with the reason, and its placement
    # span with the refusal, over the engines weighed.
    placement = placement_span(receiver, rid)
    assert placement.error == "prompt_exceeds_ttft_budget"
    assert {e["engine"] for name, e in placement.events if name == "candidate"} == {"e0", "e1"}
    root = of_request(receiver.spans(), rid)[0]
    assert root.error == "prompt_exceeds_ttft_budget"
    assert root.attributes["narwhal.refusal.reason"] == "prompt_exceeds_ttft_budget"
    assert root.attributes["narwhal.outcome"] == "refused"


@pytest.mark.slow
def test_no_records_are_kept_where_the_setting_says_none(
    tmp_path: Path, scripted: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_DECISIONS_ADMIN", TOKEN)
    router = start_router(
        tmp_path,
        "model: main\nlisten: {port: $PORT}\nadmission: predictive\n"
        "admin: {token_env: NARWHAL_TEST_DECISIONS_ADMIN, decision_records: 0}\n"
        f"engines:\n  - {{name: e0, url: '{scripted.url}', dialect: lexi}}\n",
    )
    try:
        r = httpx.post(router.url + "/v1/chat/completions", json=chat("hello"), timeout=30)
        assert r.status_code == 200
        kept = httpx.get(
            router.url + f"/admin/requests/{r.headers['x-request-id']}", headers=ADMIN, timeout=10
        )
        assert kept.status_code == 404
        listed = httpx.get(router.url + "/admin/requests", headers=ADMIN, timeout=10)
        assert listed.status_code == 404
    finally:
        router.stop()


@pytest.mark.slow
def test_only_engines_that_serve_the_route_are_weighed(
    tmp_path: Path, fleet: tuple[Server, list[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Responses request is judged over the engines whose dialect serves it: the one that
    cannot is neither weighed nor chosen (placement would pass it over, and the projection
    made for it would be wasted)."""
    _, (sglang, lexi) = fleet
    monkeypatch.setenv("NARWHAL_TEST_DECISIONS_ADMIN", TOKEN)
    router = start_router(
        tmp_path,
        "model: main\nlisten: {port: $PORT}\nadmission: predictive\n"
        "admin: {token_env: NARWHAL_TEST_DECISIONS_ADMIN, decision_records: 10}\n"
        f"engines:\n  - {{name: old, url: '{sglang.url}', dialect: sglang}}\n"
        f"  - {{name: new, url: '{lexi.url}', dialect: lexi}}\n",
    )
    try:
        r = httpx.post(router.url + "/v1/responses", json={"input": "hello"}, timeout=30)
        d = record(router, r.headers["x-request-id"])
        assert [c["engine"] for c in d["candidates"]] == ["new"]
        assert d["choice"] == "new"
    finally:
        router.stop()
