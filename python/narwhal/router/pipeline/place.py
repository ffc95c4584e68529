"""Placement: a seat on an engine through a lease, the relay, and another engine when one
answers 429 (while the deadline leaves time and an engine that did not is eligible).

The lease carries the leader's fencing token to the engine; the policy hears where the
request went (`placed`) before the relay starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from narwhal import asgi
from narwhal.asgi import Send
from narwhal.errors import ApiError, unavailable
from narwhal.router.admission import Admission, BudgetSpent, Expired
from narwhal.router.endings import End, Ending
from narwhal.router.engines import Pool
from narwhal.router.lease import Lease
from narwhal.router.pipeline.gate import Gate
from narwhal.router.policies import Plan, Policy
from narwhal.router.relay.errors import EngineBusy, EngineFailed, EngineFenced
from narwhal.router.relay.relayer import Relayer, ended
from narwhal.router.request import Request
from narwhal.router.tenants.registry import Tenants
from narwhal.router.tracing import RequestTrace


class Placer:
    def __init__(
        self,
        admission: Admission,
        pool: Pool,
        gate: Gate,
        policy: Policy,
        relayer: Relayer,
        queue_time: Any,
        tenants: Tenants,
        seated: Callable[[str], None] | None = None,
        told: Callable[[Lease, Plan], None] | None = None,
    ) -> None:
        self.admission = admission
        self.pool = pool
        self.gate = gate
        self.leadership = gate.leadership
        self.policy = policy
        self.relayer = relayer
        self.queue_time = queue_time  # the queue-time histogram, by model
        self._queue_time: dict[str, Any] = {}  # its children, looked up once a model
        self.tenants = tenants
        # Told the engine of each request seated (`warming.Warmer.yield_to`).
        self.seated = seated
        # Told of each placement, after the policy (`ha.mode: active`: the other routers).
        self.told = told

    async def serve(
        self,
        req: Request,
        send: Send,
        arrived: float,
        deadline: float,
        plan: Plan,
        busy: frozenset[str],
        end: Ending,
        ttft_by: float | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        """Placed and relayed; `busy` names the engines not to place on; `ttft_by`: when
        its first token is due, held while it waits for a seat (None: not held); `trace`:
        its spans' times, where it is traced."""
        while True:
            try:
                end.end = await self._once(
                    req, send, arrived, deadline, plan, busy, end, ttft_by, trace
                )
                return
            except EngineBusy as e:
                busy = busy | {e.engine}
                if not self._may_retry(busy, deadline):
                    end.end = End.ENGINE_BUSY
                    await e.refusal.send(send)  # the engine's own 429, as it sent it
                    return

    def _may_retry(self, busy: frozenset[str], deadline: float) -> bool:
        """Another engine may take a request that engines in `busy` refused with 429, while
        its deadline has time left."""
        return time.monotonic() < deadline and any(e.name not in busy for e in self.pool.eligible())

    async def _once(
        self,
        req: Request,
        send: Send,
        arrived: float,
        deadline: float,
        plan: Plan,
        busy: frozenset[str],
        end: Ending,
        ttft_by: float | None,
        trace: RequestTrace | None,
    ) -> End:
        placed = False
        try:
            async with self.admission.place(
                req,
                arrived,
                deadline,
                prefer=plan.prefer,
                tokens=plan.tokens,
                predicted_s=plan.predicted_s,
                exclude=busy,
                ttft_by=ttft_by,
                own_s=plan.own_s,
            ) as lease:
                # Again once placed (the queue may have waited), but only leadership: the
                # token the request carries must be one this router still holds. (The engine
                # it got is out of the wave; a degraded predictor has already admitted it.)
                self.gate.check_leading()
                lease.fence = self.leadership.token
                if plan.blocks is not None:
                    lease.cached_expected = plan.held_by(lease.on.name)
                self.policy.placed(lease, plan)
                if self.told is not None:
                    self.told(lease, plan)
                if self.seated is not None:
                    self.seated(lease.on.name)
                placed = True
                now = time.monotonic()
                if trace is not None:
                    trace.placed_at = now
                waited = now - arrived
                child = self._queue_time.get(req.model)
                if child is None:
                    child = self._queue_time[req.model] = self.queue_time.labels(req.model)
                child.observe(waited)
                if req.standing.tenant:
                    self.tenants.queued(req.standing.tenant, req.standing.rank, waited)
                return await self._relay(lease, send, end, trace)
        except EngineFenced as e:
            self.leadership.fence(str(e))
            raise unavailable(f"this router was fenced ({e}); retry shortly", "fenced").ended(
                End.FENCED
            ) from None
        except BudgetSpent as e:
            spent = ApiError(
                429,
                "waiting for a seat spent the TTFT budget: its first token could no longer "
                "come in time",
                type="rate_limit_error",
                code="ttft_budget_exceeded",
                headers={"retry-after": str(max(1, round(e.overrun_s)))},
            ).ended(End.QUEUE_WAIT)
            spent.fields["overrun_ms"] = round(e.overrun_s * 1000, 1)
            raise spent from None
        except Expired:
            raise ApiError(
                504,
                "no engine had room before the wait or deadline ran out",
                type="timeout_error",
                code="admission_timeout",
            ).ended(End.WAIT_EXPIRED) from None
        except ApiError as e:
            # A 503 (no longer leading once placed: nothing was sent) said so itself, as did
            # admission's refusals.
            if placed:
                e.ended(End.DEADLINE if e.status == 504 else End.ENGINE_FAILED)
            raise

    async def _relay(
        self, lease: Lease, send: Send, end: Ending, trace: RequestTrace | None
    ) -> End:
        try:
            # Checked again once a connection is ready, just before the bytes go:
            # connecting (a fresh connection, or a retried one) may take longer than
            # what is left of this router's leadership.
            return await self.relayer.run(lease, send, self.gate.check_leading, trace)
        except asyncio.CancelledError:
            answered = lease.measured.answered
            if answered is not None:  # the answer had gone out whole before the hang-up
                end.end = ended(lease, answered)  # as the relay would have returned it
            raise
        except EngineFailed as e:
            raise ApiError(
                502,
                f"engine {lease.on.name} failed: {e}",
                type="server_error",
                code="engine_failed",
            ) from None
        finally:
            _note(lease)
            prompt = lease.measured.prompt_tokens or lease.request.estimated_prompt_tokens()
            end.tokens = prompt + lease.measured.output_tokens


def _note(lease: Lease) -> None:
    """What the access log line says of the engine's part."""
    rec = asgi.current.get()
    if rec is None:
        return
    rec.fields.update(
        engine=lease.on.name,
        ttfb_ms=round((lease.measured.first_byte_at - lease.arrived) * 1000, 1)
        if lease.measured.first_byte_at
        else None,
        tokens_in=lease.measured.prompt_tokens,
        tokens_out=lease.measured.output_tokens,
        # What placement promised: the TTFT it projected there and when the first token was
        # due (from arrival), beside what came (ttfb_ms).
        projected_ms=round(lease.predicted_s * 1000, 1) if lease.predicted_s else None,
        own_ms=round(lease.own_s * 1000, 1) if lease.own_s else None,
        tokens_sized=lease.tokens or None,
        cached_expected=lease.cached_expected or 0,
        tokens_cached=lease.measured.cached_tokens,
        due_ms=round((lease.ttft_by - lease.arrived) * 1000, 1) if lease.ttft_by else None,
        # How long it waited in the router before the engine had it (judge, queue, connect).
        sent_ms=round((lease.measured.sent_at - lease.arrived) * 1000, 1)
        if lease.measured.sent_at
        else None,
    )
