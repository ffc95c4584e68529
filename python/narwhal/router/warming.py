"""Warming: a conversation's prompt refused for its TTFT is prefilled anyway where an engine
has room, its answer thrown away, so that it is in that engine's prefix cache when the
conversation comes back.

A refusal for the prompt's length is final for that request, but not for its conversation:
the next turn carries the same history and more, and a router that refused the first turn
of a long conversation refused every later one for the same history's length, while a
router that served the first turn (late) served the later ones from cache. So where the
policy finds an engine with nothing ahead and its streams' pace to spare while the fleet
has room (`Policy.warming`), the prompt goes there with one output token asked for, placed
like any request (a lease from admission, the leader's fencing token, the cache picture and
the conversation's engine told where it went), and relayed to nowhere; the predictor learns
its prefill from it as from any answer. A warm gives way to live work: its prefill counts
ahead of them like any other, so they go elsewhere while they can; the first one seated on
its engine makes it yield (`yield_to`: the connection closes, the engine stops and keeps
what it computed), and one that would be refused makes every warm yield and is judged again
(`yield_all`). Only the leader warms; at most a WARM_SHARE of the engines at once, one
prompt an engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol

from narwhal.errors import ApiError
from narwhal.router.admission import Admission
from narwhal.router.engines import Pool
from narwhal.router.ha.leadership import Leadership
from narwhal.router.policies import Plan, Policy
from narwhal.router.relay.errors import EngineBusy, EngineFailed, EngineFenced
from narwhal.router.relay.relayer import Relayer
from narwhal.router.request import Request, Standing

log = logging.getLogger("narwhal.warming")

# Prompts warmed at once, fleet-wide: a quarter of the engines (at least one), so that most
# of the fleet stays free for the live requests that come meanwhile.
WARM_SHARE = 0.25
# A warm's deadline, in its projected TTFT: an engine that has not answered by then is
# late enough that what it holds is not what the picture says.
WARM_DEADLINE_PROJECTIONS = 3.0


class _Outcomes(Protocol):
    def labels(self, outcome: str) -> Any: ...


async def _discard(_: Any) -> None:
    pass


class Warmer:
    def __init__(
        self,
        policy: Policy,
        pool: Pool,
        admission: Admission,
        relayer: Relayer,
        leadership: Leadership,
        outcomes: _Outcomes,
    ) -> None:
        self.policy = policy
        self.pool = pool
        self.admission = admission
        self.relayer = relayer
        self.leadership = leadership
        self.outcomes = outcomes  # counted by outcome: warmed, yielded, no_room, failed
        self._jobs: asyncio.Queue[tuple[Request, Plan]] = asyncio.Queue(maxsize=1)
        self._running: dict[str, asyncio.Task[None]] = {}  # engine name -> its warm

    def offer(self, req: Request, cannot: frozenset[str] = frozenset()) -> None:
        """`req` was just refused for its TTFT: warmed where the policy finds room (and
        fewer than the fleet's share of warms run), else let go."""
        eligible = self.pool.eligible()
        engines = [e for e in eligible if e.name not in cannot and e.name not in self._running]
        cap = max(1, int(WARM_SHARE * len(eligible)))
        if not engines or len(self._running) >= cap or self._jobs.full():
            return
        try:
            plan = self.policy.warming(req, engines)
        except Exception:
            # The request's own answer is the 429 it was given: a warm that cannot be
            # planned is logged and counted, never its error.
            log.exception("planning a warm failed")
            self.outcomes.labels("failed").inc()
            return
        if plan is None or plan.prefer is None:
            return
        self._jobs.put_nowait((req, plan))

    async def run_forever(self) -> None:
        """Starts each warm offered (a warm ends itself, and counts how); the warms under
        way end with it."""
        try:
            while True:
                req, plan = await self._jobs.get()
                assert plan.prefer is not None
                name = plan.prefer.name
                if name in self._running or self.leadership.serving() is not None:
                    plan.settle()
                    continue
                self._start(name, _warm_request(req), plan)
        finally:
            for task in list(self._running.values()):
                task.cancel()

    async def yield_all(self) -> bool:
        """A live request would be refused for its TTFT: every warm stops and gives its
        seat back (awaited, so the request is judged again without them); whether any
        was running. A warm never costs a live request its answer."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return bool(tasks)

    def yield_to(self, engine: str) -> None:
        """A live request was seated on `engine`: a warm there stops, so that the live one
        does not wait behind it."""
        task = self._running.get(engine)
        if task is not None:
            task.cancel()

    def _start(self, name: str, req: Request, plan: Plan) -> None:
        task = asyncio.create_task(self._warm(req, plan), name=f"warm-{name}")
        self._running[name] = task

        def ended(_: asyncio.Task[None]) -> None:
            self._running.pop(name, None)

        task.add_done_callback(ended)

    async def _warm(self, req: Request, plan: Plan) -> None:
        """One prompt prefilled on the plan's engine; every way it ends counted, none raised
        (a warm is nobody's request: its failure is logged, not answered)."""
        e = plan.prefer
        assert e is not None
        now = time.monotonic()
        deadline = now + WARM_DEADLINE_PROJECTIONS * (plan.predicted_s or 0.0)
        outcome = "failed"
        try:
            # Placed with no projection (a warm's is an extrapolation no admission rests on,
            # and its miss is not one the margin live requests are judged by should carry),
            # its tokens counted ahead like any prefill's: live requests go elsewhere while
            # they can, one seated on its engine anyway makes it yield (`yield_to`), so it
            # starts sooner than projected, never later, and one that would be refused makes
            # every warm yield first (`yield_all`). (Not counted, live requests were
            # projected as if the engine were idle and waited out the warm's step in
            # progress: 5 points more misses at 1x and 2x in a run; bench/README.md.)
            # Its prefill, where it runs to its first token, teaches the fit as any does.
            async with self.admission.place_on(e, req, now, deadline, plan.tokens) as lease:
                if lease is None:
                    outcome = "no_room"  # live traffic came first
                    return
                lease.fence = self.leadership.token
                lease.warm = True
                self.policy.placed(lease, plan)
                await self.relayer.run(lease, _discard)
                outcome = "warmed" if lease.measured.first_at else "failed"
        except asyncio.CancelledError:
            # A live request was seated on its engine (or the router is stopping): closing
            # the connection is how the engine learns to stop, keeping what it computed.
            outcome = "yielded"
        except EngineFenced as exc:
            self.leadership.fence(str(exc))
        except (ApiError, EngineFailed, EngineBusy) as exc:
            log.info("warming a refused prompt on %s failed: %s", e.name, exc)
        except Exception:
            log.exception("warming a refused prompt on %s failed", e.name)
        finally:
            plan.settle()
            self.outcomes.labels(outcome).inc()


def _warm_request(req: Request) -> Request:
    """`req` as a warm sends it: one output token, streamed, nothing but the prompt asked
    for, in the lowest class."""
    body = {
        k: v
        for k, v in req.body.items()
        if k not in ("max_completion_tokens", "logprobs", "top_logprobs", "n", "best_of")
    }
    body["max_tokens"] = 1
    body["stream"] = True
    return dataclasses.replace(
        req,
        body=body,
        stream=True,
        wants_token_ids=False,
        include_usage=True,
        max_tokens=1,
        standing=Standing(tenant=req.standing.tenant, rank=2, share=1.0, order=4),
    )
