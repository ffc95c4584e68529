"""A prompt refused for its TTFT is warmed (router/warming.py): prefilled anyway on an
engine with room, so that the client's retry and the conversation's next turn are served
from that engine's cache. The router in front of one simulated GPU engine with a prefix
cache (bench/fleet/server.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import (
    Server,
    simulated_engine,
    sse_frames,
    start_router,
    wait_until,
)

pytestmark = pytest.mark.slow

# The simulated engine prefills 10k tokens/s, `scale` times slower. The router learns the
# rate from prompts of TEACH words (one token each), which vouch for prompts up to four
# times theirs; a prompt of LONG words then takes 0.6 s x scale alone (at a scale of 2,
# 1.2 s: over a 1 s budget).
TEACH = 2000
LONG = 6000


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def warmed(r: Server, outcome: str = "warmed") -> float:
    for line in httpx.get(r.url + "/metrics").text.splitlines():
        if line.startswith(f'narwhal_warmed_prompts_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def post(
    r: Server, messages: list[dict[str, str]], session: str, max_tokens: int = 2
) -> httpx.Response:
    """A streamed chat turn of conversation `session`, its usage asked for."""
    body = {
        "model": "main",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
    }
    return httpx.post(
        r.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=60
    )


def cached_tokens(resp: httpx.Response) -> int:
    usage = [f["usage"] for f in sse_frames(resp.text) if isinstance(f, dict) and f.get("usage")]
    return int(usage[-1]["prompt_tokens_details"]["cached_tokens"])


@contextlib.contextmanager
def fleet(
    tmp: Path, warm: bool, scale: float = 2, budget_s: float = 1.0
) -> Iterator[tuple[Server, str]]:
    """The router in front of one simulated engine `scale` times slower, its rate learned;
    the router and the engine's URL."""
    with simulated_engine("--time-scale", str(scale)) as url:
        r = start_router(
            tmp,
            f"""
model: main
listen: {{port: $PORT}}
admission: predictive
predictive: {{ttft_budget_s: {budget_s}, tpot_target_s: 0.5, warm_refused: {str(warm).lower()}}}
engines:
  - {{name: gpu, url: '{url}', dialect: vllm}}
""",
        )
        try:
            for i in range(4):  # the engine's prefill rate, measured on prompts of its own
                # (answers that end on their own after two tokens: `stop@2`, the simulated
                # end of text, short of their max_tokens)
                teach = [{"role": "user", "content": words(f"t{i}-", TEACH) + " stop@2"}]
                got = post(r, teach, f"t{i}", max_tokens=8)
                assert got.status_code == 200, got.text
            yield r, url
        finally:
            r.stop()


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Server]:
    with fleet(tmp_path, warm=True) as (r, _):
        yield r


def test_a_refused_prompt_is_warmed_and_its_retry_and_next_turn_served_from_cache(
    router: Server,
) -> None:
    history = [{"role": "user", "content": words("h0-", LONG)}]
    first = post(router, history, "conv")
    assert first.status_code == 429, first.text
    assert first.json()["error"]["code"] == "prompt_exceeds_ttft_budget"
    # The refusal is the client's at once; the engine prefills the prompt meanwhile.
    wait_until(lambda: warmed(router) == 1, 30)
    # Its one token is nobody's answer: how long answers run is learned from the four
    # taught ones alone.
    assert httpx.get(router.url + "/ready").json()["lengths"]["ended"] == 4

    retry = post(router, history, "conv")
    assert retry.status_code == 200, retry.text
    assert cached_tokens(retry) >= LONG // 2

    turn = [
        *history,
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": words("q0-", 40)},
    ]
    following = post(router, turn, "conv")
    assert following.status_code == 200, following.text
    assert cached_tokens(following) >= LONG // 2


def test_without_warming_the_retry_is_refused_again(tmp_path: Path) -> None:
    with fleet(tmp_path, warm=False) as (r, _):
        history = [{"role": "user", "content": words("h0-", LONG)}]
        for _ in range(2):
            got = post(r, history, "conv")
            assert got.status_code == 429, got.text
            assert got.json()["error"]["code"] == "prompt_exceeds_ttft_budget"
        assert (
            'narwhal_warmed_prompts_total{outcome="warmed"}'
            not in httpx.get(r.url + "/metrics").text
        )


def test_a_warm_yields_to_a_live_request_it_would_keep_out(tmp_path: Path) -> None:
    # Five times slower: the warm's prefill takes 3 s, over the 2.5 s budget.
    with fleet(tmp_path, warm=True, scale=5, budget_s=2.5) as (r, engine):
        seen = httpx.get(engine + "/sim/stats").json()["prompt_tokens"]
        history = [{"role": "user", "content": words("h0-", LONG)}]
        assert post(r, history, "conv").status_code == 429
        # The warm is in the engine's prefill: behind it a live request would be refused
        # for its TTFT, so the warm stops, and the live request is served.
        wait_until(lambda: httpx.get(engine + "/sim/stats").json()["prompt_tokens"] > seen, 30)
        live = post(r, [{"role": "user", "content": words("l0-", 200)}], "other")
        assert live.status_code == 200, live.text
        wait_until(lambda: warmed(r, "yielded") == 1, 30)
        assert warmed(r) == 0
