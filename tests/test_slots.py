"""Slot hand-out: prefix-preferring pick, oldest waiter first, Busy at the wait limit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.engine.batch import shared_prefix
from narwhal.engine.slots import Busy, Slots

tokens = st.lists(st.integers(0, 3), max_size=40)


@given(tokens, tokens)
def test_shared_prefix_is_the_common_prefix(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert shared_prefix(a, b) == n == shared_prefix(b, a)


def test_the_free_slot_holding_the_longest_prefix_is_picked() -> None:
    held = {0: [1, 2], 1: [1, 2, 3, 4], 2: [9]}
    prompt = [1, 2, 3, 5]

    async def go() -> list[int]:
        s = Slots(3, 0)
        first = await s.acquire(lambda i: shared_prefix(held[i], prompt))
        second = await s.acquire(lambda i: shared_prefix(held[i], prompt))
        return [first, second]

    assert asyncio.run(go()) == [1, 0]


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):  # loop steps, not time
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


def test_a_released_slot_goes_to_the_oldest_waiter_and_the_rest_time_out() -> None:
    async def go() -> None:
        s = Slots(1, 0.2)
        held = await s.acquire(lambda i: 0)
        first = asyncio.create_task(s.acquire(lambda i: 0))
        await until(lambda: s.waiting == 1)
        second = asyncio.create_task(s.acquire(lambda i: 0))
        await until(lambda: s.waiting == 2)
        s.release(held)
        got = await first  # the oldest waiter gets the slot ...
        with pytest.raises(Busy):
            await second  # ... and the other one, still waiting, is refused at the limit
        assert (s.busy, s.waiting) == (1, 0)
        s.release(got)
        assert s.busy == 0

    asyncio.run(go())


def test_no_wait_means_busy_at_once() -> None:
    async def go() -> None:
        s = Slots(1, 0)
        await s.acquire(lambda i: 0)
        await s.acquire(lambda i: 0)

    with pytest.raises(Busy):
        asyncio.run(go())


def test_short_prefixes_give_way_to_keeping_busy_slots_packed() -> None:
    from narwhal.engine.slots import REUSE_WORTH

    async def go(held_by_7: int) -> int:
        s = Slots(8, 0)
        for _ in range(2):
            await s.acquire(lambda i: 0)  # slots 0 and 1 are busy
        return await s.acquire(lambda i: held_by_7 if i == 7 else 0)

    assert asyncio.run(go(20)) == 2  # a short prefix on slot 7 is not worth the spread
    assert asyncio.run(go(REUSE_WORTH)) == 7  # a long one is reused
