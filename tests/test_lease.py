"""The seat rule, without sockets: a placed request holds one seat on one engine and gives
it back exactly once, on every way out of its lease; counters come back to zero."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from narwhal.router.admission import Admission, Expired
from narwhal.router.config import EngineSpec
from narwhal.router.engines import Engine, Pool
from narwhal.router.lease import Events, Lease, Phase
from narwhal.router.pipeline import intake
from narwhal.router.policies import least_loaded
from narwhal.router.request import CHAT

REQ = intake.check(
    CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}), "m"
)


def setup(
    n: int = 2, prefill: int = 1, decode: int = 1, queue: int = 4, wait_s: float = 5.0
) -> tuple[Admission, list[Engine], list[tuple[str, str]]]:
    engines = [Engine(EngineSpec(f"e{i}"), f"http://e{i}", healthy=True) for i in range(n)]
    pool = Pool(engines, prefill, decode, eject_after=2)
    events = Events()
    heard: list[tuple[str, str]] = []
    events.subscribe(
        first_output=lambda lease: heard.append(("first", lease.on.name)),
        finished=lambda lease: heard.append(("finished", lease.on.name)),
        fault=lambda lease, kind, why: heard.append((kind, lease.on.name)),
        released=lambda lease: heard.append(("released", lease.on.name)),
    )
    events.subscribe(finished=pool.answered, fault=pool.faulted)
    return Admission(pool, 100, queue, wait_s, events, instead=least_loaded), engines, heard


def seats(engines: list[Engine]) -> list[tuple[int, int, int]]:
    return [(e.prefill, e.decode, e.prefill_tokens) for e in engines]


def run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro())  # type: ignore[arg-type]


ZERO = [(0, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize("ending", ["prefill", "decode", "finished", "raises", "fault"])
def test_every_way_out_gives_the_seat_back_once(ending: str) -> None:
    adm, engines, heard = setup()

    async def go() -> Lease:
        async with adm.place(REQ, 0.0, 1e9, tokens=7) as lease:
            assert seats(engines) == [(1, 0, 7), (0, 0, 0)]
            assert lease.phase is Phase.PREFILL
            if ending != "prefill":
                lease.first_output()
                lease.first_output()  # a second report moves nothing
                assert seats(engines) == [(0, 1, 0), (0, 0, 0)]
            if ending == "finished":
                lease.finished(5)
            if ending == "fault":
                lease.fault("engine_disconnected", "stream ended early")
            if ending == "raises":
                raise ValueError("the relay broke")
            lease.release()  # an early release is the release: the exit adds nothing
        return lease

    if ending == "raises":
        with pytest.raises(ValueError):
            run(go)
    else:
        assert run(go).phase is Phase.DONE
    assert seats(engines) == ZERO
    assert heard.count(("released", "e0")) == 1  # policies hear the end once, however it came
    assert ("finished", "e0") in heard if ending == "finished" else True
    assert engines[0].strikes == (1 if ending == "fault" else 0)


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):  # loop steps, not time: each wait is a few steps
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


def test_a_queued_request_takes_the_seat_the_first_one_gives_back() -> None:
    adm, engines, _ = setup(n=1)
    order: list[str] = []

    async def second() -> None:
        async with adm.place(REQ, 0.0, 1e9, tokens=3) as lease:
            order.append(lease.on.name)
            assert seats(engines) == [(1, 0, 3)]

    async def go() -> None:
        async with adm.place(REQ, 0.0, 1e9, tokens=3):
            waiting = asyncio.create_task(second())
            await until(lambda: adm.queued == 1)
            assert seats(engines) == [(1, 0, 3)] and not order
        await waiting
        assert order == ["e0"]

    run(go)
    assert seats(engines) == [(0, 0, 0)]


def test_placed_just_as_the_wait_is_cancelled_gives_the_seat_back() -> None:
    adm, engines, _ = setup(n=1)

    async def second() -> None:
        async with adm.place(REQ, 0.0, 1e9):
            pass

    async def go() -> None:
        async with adm.place(REQ, 0.0, 1e9):
            waiting = asyncio.create_task(second())
            await until(lambda: adm.queued == 1)
        # The exit handed the seat to the waiting request; it is cancelled in the same step,
        # before it could resume and see it.
        assert seats(engines) == [(1, 0, 0)]
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    run(go)
    assert seats(engines) == [(0, 0, 0)]


@pytest.mark.parametrize("how", ["expires", "cancelled"])
def test_leaving_the_queue_takes_no_seat(how: str) -> None:
    adm, engines, heard = setup(n=1, wait_s=0.05 if how == "expires" else 5.0)

    async def go() -> None:
        hold = asyncio.Event()

        async def first() -> None:
            async with adm.place(REQ, 0.0, 1e9):
                await hold.wait()

        t = asyncio.create_task(first())
        await asyncio.sleep(0)

        async def second() -> None:
            async with adm.place(REQ, 0.0, 1e9):
                raise AssertionError("never placed")

        waiting = asyncio.create_task(second())
        await asyncio.sleep(0)
        if how == "expires":
            with pytest.raises(Expired):
                await waiting
        else:
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        assert adm.queued == 0 and seats(engines) == [(1, 0, 0)]
        hold.set()
        await t

    run(go)
    assert seats(engines) == [(0, 0, 0)]
    assert heard == [("released", "e0")]  # the first request's; the one never placed, none


def test_an_excluded_engine_is_never_placed_on() -> None:
    adm, engines, _ = setup(n=2)

    async def go() -> list[str]:
        names = []
        for _ in range(3):
            async with adm.place(REQ, 0.0, 1e9, exclude=frozenset({"e0"})) as lease:
                names.append(lease.on.name)
        return names

    assert run(go) == ["e1"] * 3
    assert seats(engines) == ZERO


def test_place_on_takes_that_engine_or_nothing() -> None:
    adm, engines, _ = setup(n=2)

    async def go() -> list[str | None]:
        got: list[str | None] = []
        async with adm.place_on(engines[1], REQ, 0.0, 1e9) as lease:
            got.append(lease.on.name if lease else None)
            async with adm.place_on(engines[1], REQ, 0.0, 1e9) as full:  # prefill limit 1
                got.append(full.on.name if full else None)
        return got

    assert run(go) == ["e1", None]
    assert seats(engines) == ZERO


def test_faults_against_the_engine_eject_it_after_the_streak() -> None:
    adm, engines, heard = setup(n=1)

    async def go() -> None:
        for kind, why in [
            ("engine_error", None),
            ("engine_stalled", "quiet"),
            ("engine_disconnected", "cut"),
        ]:
            async with adm.place(REQ, 0.0, 1e9) as lease:
                lease.fault(kind, why)

    run(go)
    faults = [k for k, _ in heard if k != "released"]
    assert faults == ["engine_error", "engine_stalled", "engine_disconnected"]
    assert not engines[0].healthy  # two strikes (eject_after=2); the error event was none
    assert seats(engines) == [(0, 0, 0)]


def test_a_seat_is_taken_where_the_policy_says_when_its_engine_is_full() -> None:
    """Admission takes seats and picks none: where the plan's engine has no seat free, the
    policy names another among those that have (`Policy.instead`)."""
    engines = [Engine(EngineSpec(f"e{i}"), f"http://e{i}", healthy=True) for i in range(3)]
    asked: list[list[str]] = []

    def last(room: list[Engine]) -> Engine:
        asked.append([e.name for e in room])
        return room[-1]

    adm = Admission(Pool(engines, 1, 1, eject_after=2), 100, 4, 5.0, Events(), instead=last)

    async def go() -> list[str]:
        async with (
            adm.place(REQ, 0.0, 1e9, prefer=engines[0], tokens=1) as first,
            adm.place(REQ, 0.0, 1e9, prefer=engines[0], tokens=1) as second,
        ):
            return [first.on.name, second.on.name]

    # The first goes where the plan said; the second's engine is full: the policy chose
    # e2 of e1 and e2 (the least loaded would be e1, the first listed of two idle ones).
    assert run(go) == ["e0", "e2"]
    assert asked == [["e1", "e2"]]
    assert seats(engines) == [(0, 0, 0)] * 3
