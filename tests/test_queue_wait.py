"""Predictive admission holds the whole TTFT: the time a request waits in the router's
queue for a prefill seat counts against its budget, at arrival and while it waits.

One scripted engine that prefills one prompt at a time (~2,000 tokens/s), a 1 s budget,
and a burst of 60 prompts of 200 words 20 ms apart (7.5 s of prefill offered in 1.2 s), a
third of them critical and the rest sheddable: what is answered has its first token
within the budget (and the projection's error), the rest is refused at once or as soon as
its wait spends the budget, sheddable work first. The wait in the router's queue that a
projection counted is no miss of it: scored from when the request was sent, that wait read
as projections far too long, the drift passed its bound, and the router turned the burst
away with 503 `monitoring_degraded`."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import Server, metric, start_router, start_test_engine

pytestmark = pytest.mark.slow

BUDGET_S = 1.0
KEYS = {"critical": "key-of-ops", "sheddable": "key-of-batch"}


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_TEST_KEY_OPS", KEYS["critical"])
    monkeypatch.setenv("NARWHAL_TEST_KEY_BATCH", KEYS["sheddable"])


@pytest.fixture
def engine() -> Iterator[Server]:
    s = start_test_engine("tests.scripted_engine")
    yield s
    s.stop()


def prompt() -> str:
    # 0.5 ms a token, one prompt at a time; ~250 tokens (4 bytes each): ~0.13 s of prefill.
    # Short beside the budget: a prompt and the one on the engine ahead of it fit within
    # it at the widest margin a loaded machine teaches (2x, and the edge's 1.5x), so what
    # refuses is the router's queue (two suites on two cores once refused the burst of
    # 0.25 s prompts only for the engine's own projection, widened: no `queue_wait`).
    return f"script:prefill_serial:0.5:{uuid.uuid4().hex} " + "word " * 200


class Asked(threading.Thread):
    """One streamed request: its status, Retry-After and time to its first token."""

    def __init__(self, router: Server, klass: str) -> None:
        super().__init__()
        self.router, self.klass = router, klass
        self.status = 0
        self.retry_after: str | None = None
        self.ttft: float | None = None
        self.error = ""

    def run(self) -> None:
        body = {
            "model": "main",
            "messages": [{"role": "user", "content": prompt()}],
            "max_tokens": 4,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {KEYS[self.klass]}"}
        sent = time.monotonic()
        with httpx.stream(
            "POST", self.router.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as r:
            self.status = r.status_code
            self.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                self.error = r.read().decode(errors="replace")
            for line in r.iter_lines():
                if self.ttft is None and '"content":"w' in line:
                    self.ttft = time.monotonic() - sent


@pytest.mark.parametrize("seats", [1, 4, 64])
def test_a_burst_behind_the_prefill_seats_is_admitted_only_as_far_as_the_budget_holds(
    tmp_path: Path, engine: Server, seats: int
) -> None:
    router = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: predictive
predictive: {{ttft_budget_s: {BUDGET_S}}}
phases: {{prefill_concurrency: {seats}}}
queue: {{size: 256, wait_s: 30}}
auth:
  api_keys:
    - {{key_env: NARWHAL_TEST_KEY_OPS, tenant: ops, priority: critical}}
    - {{key_env: NARWHAL_TEST_KEY_BATCH, tenant: batch, priority: sheddable}}
engines: [{{name: s, url: '{engine.url}', dialect: lexi}}]
""",
    )
    try:
        for _ in range(4):  # the engine's prefill rate learned, one prompt at a time
            warm = Asked(router, "critical")
            warm.run()
            assert warm.status == 200
        asked = [Asked(router, "critical" if i % 3 == 0 else "sheddable") for i in range(60)]
        for a in asked:
            a.start()
            time.sleep(0.02)
        for a in asked:
            a.join(60)
        served = [a for a in asked if a.status == 200]
        refused = [a for a in asked if a.status != 200]
        assert served and refused, [a.status for a in asked]  # 7.5 s of work in 1.2 s
        # Within the budget and the projection's error, as sixty client threads on two cores
        # beside the router and the engine measure it (a first token 1.3 s in came once on a
        # fresh clone's Python 3.13 run): the bug this holds out put it 11 s in.
        late = [round(a.ttft or -1, 2) for a in served if a.ttft is None or a.ttft > 1.5 * BUDGET_S]
        assert not late, late
        for a in refused:
            assert a.status == 429, (a.status, a.error)
            assert a.retry_after is not None and int(a.retry_after) >= 1
        share = {
            k: sum(a.status != 200 for a in asked if a.klass == k)
            / sum(a.klass == k for a in asked)
            for k in KEYS
        }
        assert share["sheddable"] > share["critical"], share
        assert any(a.klass == "critical" for a in served)
        if seats == 1:
            # Here requests wait in the router for the one seat, and refusals say so.
            assert metric(router, 'narwhal_refused_total{model="main",reason="queue_wait"}') >= 1
    finally:
        router.stop()
