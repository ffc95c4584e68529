"""Predictive admission with a TPOT target, end to end: the router in front of one
simulated GPU engine (bench/fleet/server.py, chunked prefill beside decoding streams)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from narwhal.router.policies.lengths import MIN_SAMPLES
from tests.support import (
    Server,
    chat,
    metric,
    simulated_engine,
    sse_frames,
    start_router,
    wait_idle,
)

pytestmark = pytest.mark.slow


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Every simulated step twice as long: a 6,000-token prefill takes about 2.4 s.
    with simulated_engine("--time-scale", "2") as url:
        r = start_router(
            Path(tmp_path_factory.mktemp("paced")),
            f"""
model: main
listen: {{port: $PORT}}
admission: predictive
predictive: {{ttft_budget_s: 30, tpot_target_s: 0.1}}
engines:
  - {{name: gpu, url: '{url}', dialect: vllm}}
""",
        )
        try:
            # The router learns the engine's prefill rate, its time per output token and how
            # long answers run (it waits or refuses for pace only once it has seen enough):
            # answers that end on their own after 8 tokens (`stop@8`, the simulated end of
            # text), short of their max_tokens.
            for i in range(MIN_SAMPLES):
                got = httpx.post(
                    r.url + "/v1/chat/completions",
                    json=chat(words(f"w{i}-", 300) + " stop@8", stream=True, max_tokens=64),
                    timeout=60,
                )
                assert got.status_code == 200
            yield r
        finally:
            r.stop()


def test_a_long_prefill_waits_for_a_short_stream_to_end_then_is_served(router: Server) -> None:
    # A short answer behind a long prompt of its own: about 0.4 s of stall would break its
    # 100 ms a token over 6 tokens. A second long prompt placed beside it would bring 2.4 s.
    ended: list[str] = []

    def short() -> None:
        with httpx.stream(
            "POST",
            router.url + "/v1/chat/completions",
            json=chat(words("a", 6000), stream=True, max_tokens=6),
            timeout=60,
        ) as resp:
            body = resp.read().decode()
        assert resp.status_code == 200, body
        ended.append(body)

    waits = metric(router, "narwhal_paced_waits_total")
    first = threading.Thread(target=short)
    first.start()
    time.sleep(0.5)  # the short one is in its prefill
    second = httpx.post(
        router.url + "/v1/chat/completions",
        json=chat(words("b", 6000), stream=True, max_tokens=4),
        timeout=60,
    )
    first.join(60)
    assert second.status_code == 200, second.text
    tokens = [f for f in sse_frames(second.text) if isinstance(f, dict) and f["choices"]]
    assert tokens  # served in full after waiting
    assert ended, "the short stream did not finish"
    assert metric(router, "narwhal_paced_waits_total") == waits + 1


def test_ready_shows_how_long_answers_run_and_each_engines_ledger(router: Server) -> None:
    """An operator reads why pace holds a request back: what the router has seen of answer
    lengths, what a new stream is held to, and each engine's streams and headroom."""
    wait_idle(router)  # no stream decoding now
    body = httpx.get(router.url + "/ready", timeout=10).json()
    lengths = body["lengths"]
    assert lengths["ready"] and lengths["ended"] >= MIN_SAMPLES  # the warm-up's answers
    assert lengths["new_stream_tokens"] >= 2
    (engine,) = body["engines"]
    assert engine["pace"]["tau0_ms"] is not None  # learned from the warm-up's streams
    assert engine["pace"]["streams"] == 0
