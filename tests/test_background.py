"""Supervised background loops (narwhal.background): a loop that raises is logged with its
stack, counted and started again; one that returns is done; `failing()` names it."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from narwhal.background import Background


def errors() -> tuple[Counter, CollectorRegistry]:
    r = CollectorRegistry()
    return Counter("t_background_errors", "x", ["task"], registry=r), r


def test_a_loop_that_raises_is_logged_counted_and_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter, registry = errors()
    bg = Background(counter)
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise asyncio.TimeoutError  # what an aiohttp call raises on 3.10 when etcd is slow
        await asyncio.Event().wait()  # the second run keeps going

    async def go() -> dict[str, str]:
        bg.start("leadership", flaky)
        for _ in range(400):  # the first backoff is 0.1 s
            if len(runs) == 2:
                break
            await asyncio.sleep(0.01)
        failing = bg.failing()
        assert bg.running("leadership")
        await bg.stop()
        return failing

    with caplog.at_level(logging.ERROR, logger="narwhal.background"):
        failing = asyncio.run(go())
    assert len(runs) == 2
    assert "leadership" in failing and "TimeoutError" in failing["leadership"]
    assert registry.get_sample_value("t_background_errors_total", {"task": "leadership"}) == 1
    record = next(r for r in caplog.records if "leadership" in r.getMessage())
    assert record.exc_info is not None  # with its stack


def test_a_loop_that_returns_is_done_and_never_counted() -> None:
    counter, registry = errors()
    bg = Background(counter)
    runs: list[int] = []

    async def nothing_to_do() -> None:
        runs.append(1)

    async def go() -> None:
        bg.start("fence_follower", nothing_to_do)
        for _ in range(100):
            await asyncio.sleep(0)
        assert not bg.running("fence_follower")
        await bg.stop()

    asyncio.run(go())
    assert runs == [1]
    assert bg.failing() == {}
    # The series is there from the start, at 0: a dashboard's rate() needs it.
    assert registry.get_sample_value("t_background_errors_total", {"task": "fence_follower"}) == 0
