"""The judge: the admission policy's plan for a request, before it is placed.

A request no engine can take without breaking the time per output token of streams
decoding there waits in the router for one to end, while its TTFT budget allows, and is
refused with 429 `tpot_target_exceeded` when none has. With active routers the wait is the
fleet's: a waiter that finds room gives it first, once, to an older one waiting at another
router that the room would fit too (`FleetWaiters`), as the oldest of one router's own
waiters goes first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from narwhal.errors import ApiError
from narwhal.router.decisions import Decision
from narwhal.router.engines import Pool
from narwhal.router.policies import OPEN_PLAN, Plan, Policy
from narwhal.router.policies.ttft import NoEngineKeepsPace
from narwhal.router.request import Request

# A request that would wait less than this for an engine to keep pace is refused at once.
MIN_WAIT_S = 0.01
TTFT_REFUSALS = frozenset({"ttft_budget_exceeded", "prompt_exceeds_ttft_budget"})


class FleetWaiters(Protocol):
    """The other active routers' requests waiting for pace (`peering.Exchange`)."""

    def waiting(self, key: object, order: int, size: int) -> None:
        """A request of `order` and a prompt of `size` bytes began to wait here (`key`:
        its wait)."""

    def waited(self, key: object) -> None:
        """It no longer waits."""

    def older(self, order: int, size: int, since: float) -> float | None:
        """How long one of `order` and `size` waiting since `since` that found room gives
        way to an older one waiting elsewhere that the room would fit too (None: none)."""


class Judge:
    def __init__(
        self,
        policy: Policy,
        pool: Pool,
        on_paced_wait: Callable[[], None],
        on_refused: Callable[[Request, frozenset[str]], None] | None = None,
        make_room: Callable[[], Awaitable[bool]] | None = None,
        waiters: FleetWaiters | None = None,
    ) -> None:
        self.policy = policy
        self.pool = pool
        self.on_paced_wait = on_paced_wait  # once per request that waited for pace
        # Told of each request refused for its TTFT at once (not after waiting for pace),
        # with the engines that cannot serve it (`warming.Warmer.offer`).
        self.on_refused = on_refused
        # Before a request is refused for its TTFT: the router's own warms give way, and
        # whether any did (`warming.Warmer.yield_all`); it is then judged again, once.
        self.make_room = make_room
        self.waiters = waiters

    async def plan(
        self,
        req: Request,
        arrived: float,
        budget: float,
        record: Decision | None = None,
        cannot: frozenset[str] = frozenset(),
    ) -> Plan:
        """The policy's plan over the eligible engines not in `cannot` (those that cannot
        serve the request's route), or its refusal (an ApiError); `record`, where given, is
        told what was weighed, chosen and waited for."""
        wait = _Wait(self.waiters, req.standing.order, req.prompt_bytes)
        try:
            return await self._plan(req, arrived, budget, wait, record, cannot)
        finally:
            wait.over()

    async def _plan(
        self,
        req: Request,
        arrived: float,
        budget: float,
        wait: _Wait,
        record: Decision | None,
        cannot: frozenset[str],
    ) -> Plan:
        deferred: ApiError | None = None
        room_made = False
        while True:
            engines = self.pool.eligible()
            if cannot:
                engines = [e for e in engines if e.name not in cannot]
            if not engines:
                return OPEN_PLAN  # placement answers 503: nothing to judge against
            left = budget - (time.monotonic() - arrived)
            try:
                plan = self.policy.judge(req, engines, left, record)
            except NoEngineKeepsPace as e:
                if e.slack_s <= MIN_WAIT_S:
                    raise e.refusal from None
                if deferred is None:
                    self.on_paced_wait()
                    wait.began()
                deferred = e.refusal
                began = time.monotonic()
                try:
                    await self.policy.room(e.slack_s, req.standing.order)
                finally:
                    if record is not None:
                        record.waited_s += time.monotonic() - began
                continue
            except ApiError as e:
                # Waiting used up the budget: the reason is still the pace.
                if deferred is not None and e.code in TTFT_REFUSALS:
                    raise deferred from None
                if e.code in TTFT_REFUSALS and not room_made and self.make_room is not None:
                    room_made = True
                    if await self.make_room():
                        continue
                if e.code in TTFT_REFUSALS and self.on_refused is not None:
                    self.on_refused(req, cannot)
                raise
            if deferred is not None and plan.predicted_s is not None and plan.predicted_s > left:
                # A profile that cannot vouch for the prompt's size places it wherever what
                # is ahead fits (a prompt is not refused for its length on a guess), but this
                # one waited here: the wait, not its length, is what its projection no longer
                # fits, and placed it would start late (the bench: 4 of 8 late first tokens
                # were placed so, 1-2 s over what their wait had left).
                plan.settle()
                raise deferred from None
            pause = (
                wait.give_way(left - (plan.predicted_s or 0.0)) if deferred is not None else None
            )
            if pause is not None:
                plan.settle()  # the room is the older waiter's first
                await asyncio.sleep(pause)
                continue
            return plan


class _Wait:
    """One request's wait for pace as the other active routers are told of it."""

    __slots__ = ("gave_way", "order", "since", "size", "waiters")

    def __init__(self, waiters: FleetWaiters | None, order: int, size: int) -> None:
        self.waiters = waiters
        self.order = order
        self.size = size
        self.since: float | None = None  # when it began to wait (None: it has not)
        self.gave_way = False

    def began(self) -> None:
        if self.waiters is not None:
            self.since = time.monotonic()
            self.waiters.waiting(self, self.order, self.size)

    def give_way(self, left_s: float) -> float | None:
        """How long to leave the room it found to an older waiter elsewhere; once a
        request (every stream's end wakes every waiter: gave way at each, a waiter behind
        an older one that no room fits waited out its budget, and the chat trace at 1x
        refused 3.5-4 % where one router refused 1.5-2 %); None: take it."""
        if self.waiters is None or self.since is None or self.gave_way:
            return None
        pause = self.waiters.older(self.order, self.size, self.since)
        if pause is None or pause >= left_s:
            return None
        self.gave_way = True
        return pause

    def over(self) -> None:
        if self.waiters is not None and self.since is not None:
            self.waiters.waited(self)
