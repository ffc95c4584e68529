"""The judge: the admission policy's plan for a request, before it is placed.

A request no engine can take without breaking the time per output token of streams
decoding there waits in the router for one to end, while its TTFT budget allows, and is
refused with 429 `tpot_target_exceeded` when none has.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from narwhal.errors import ApiError
from narwhal.router.decisions import Decision
from narwhal.router.engines import Pool
from narwhal.router.policies import OPEN_PLAN, Plan, Policy
from narwhal.router.policies.ttft import NoEngineKeepsPace
from narwhal.router.request import Request

# A request that would wait less than this for an engine to keep pace is refused at once.
MIN_WAIT_S = 0.01
TTFT_REFUSALS = frozenset({"ttft_budget_exceeded", "prompt_exceeds_ttft_budget"})


class Judge:
    def __init__(
        self,
        policy: Policy,
        pool: Pool,
        on_paced_wait: Callable[[], None],
        on_refused: Callable[[Request, frozenset[str]], None] | None = None,
        make_room: Callable[[], Awaitable[bool]] | None = None,
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
            return plan
