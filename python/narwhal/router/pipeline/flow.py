"""One completion request through the stages, in order, and its one outcome.

A stage that refuses a request raises the error the client gets, saying how the request
ended and the label its refusal counter takes (`ApiError.ended`); a request answered by
the relay ends as the relay says (`Ending`). Both are counted here, once, where the request
ends: `narwhal_finished_total{outcome}` whatever happened, and the refusal's counter.
"""

from __future__ import annotations

import asyncio
import time

from narwhal import asgi
from narwhal.asgi import Receive, Scope, Send
from narwhal.errors import ApiError
from narwhal.router.admission import Admission
from narwhal.router.config import RouterConfig
from narwhal.router.decisions import Decision, Decisions
from narwhal.router.endings import Ending
from narwhal.router.metrics import RouterMetrics
from narwhal.router.pipeline.classify import CRITICAL, classify
from narwhal.router.pipeline.gate import Gate
from narwhal.router.pipeline.judge import Judge
from narwhal.router.pipeline.place import Placer
from narwhal.router.pipeline.read import read
from narwhal.router.request import Request
from narwhal.router.tenants.fair_queue import CLASSES
from narwhal.router.tenants.registry import Tenants
from narwhal.router.tracing import RequestTrace
from narwhal.telemetry import Tracing

# What a decision record says was measured: the access line's fields of the engine's part.
MEASURED = ("engine", "ttfb_ms", "sent_ms", "tokens_in", "tokens_cached", "tokens_out")


class Flow:
    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        admission: Admission,
        gate: Gate,
        judge: Judge,
        placer: Placer,
        tenants: Tenants,
        decisions: Decisions | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.decisions = decisions  # where each judged request's record is kept (None: not)
        self.tracing = tracing  # None: no spans (and nothing on the way costs any)
        self.metrics = metrics
        self.admission = admission
        self.gate = gate
        self.judge = judge
        self.placer = placer
        self.tenants = tenants

    async def __call__(
        self, path: str, scope: Scope, receive: Receive, send: Send, tenant: str | None = None
    ) -> None:
        """One completion request, from its arrival to its one outcome; `tenant`: the one
        its key is for (its limits apply)."""
        m = self.metrics
        arrived = time.monotonic()
        m.offered.inc()
        end = Ending()
        rank: int | None = None
        record: Decision | None = None
        rec = asgi.current.get()  # the access line's record: its ID, its fields
        trace = self._trace(path, scope, arrived, rec) if self.tracing is not None else None
        try:
            self.admission.retain()
            try:
                req, deadline, budget = await read(
                    path, scope, receive, self.config, m, arrived, self.gate.catalog.resolve
                )
                req, budget = classify(
                    req,
                    tenant,
                    asgi.header(scope, b"x-narwhal-priority"),
                    budget,
                    self.config,
                    self.tenants,
                )
                rank = req.standing.rank
                if rec is not None:
                    rec.fields["model"] = req.model  # resolved: one the catalog holds
                if trace is not None:
                    trace.read(req)
                ticket = self.tenants.admit(tenant, req.estimated_prompt_tokens(), rank)
                record = self._record(req, trace, rec)
                try:
                    await self._serve(
                        req, receive, send, arrived, deadline, budget, end, record, trace
                    )
                finally:
                    self.tenants.end(ticket, end.tokens)
            finally:
                self.admission.release_retention()
        except ApiError as e:
            end.by(e)
            if rec is not None and e.fields:
                rec.fields.update(e.fields)
            if record is not None and end.outcome in ("refused", "rejected"):
                record.refusal = {"status": e.status, "code": e.code, "message": e.message}
                # The client can quote it; the operator reads why (GET /admin/requests/ID).
                e.message += f" (request {record.id})"
            raise
        finally:
            if end.outcome == "refused":
                self.tenants.shares.refused()  # the fleet is full: fair shares apply
                if rank == CRITICAL and end.label != "prompt_exceeds_ttft_budget":
                    self.tenants.reserve.refused()  # lower classes leave it more room
            m.finished_as(end.outcome).inc()
            named = rec.fields.get("model") if rec is not None else None
            self._count(end, named if isinstance(named, str) else self.config.model)
            if tenant:
                self.tenants.finished(tenant, rank, end.outcome, end.label)
            if rec is not None:
                rec.fields["outcome"] = end.outcome
                if end.outcome in ("refused", "rejected"):
                    rec.fields["reason"] = end.label
                if record is not None:
                    self._keep(record, end, rec.fields)
            if trace is not None:
                trace.finish(end, record, rec.fields if rec is not None else {}, time.monotonic())

    def _trace(
        self, path: str, scope: Scope, arrived: float, rec: asgi.Record | None
    ) -> RequestTrace:
        assert self.tracing is not None
        trace = RequestTrace(
            self.tracing, asgi.header(scope, b"traceparent"), f"POST {path}", arrived
        )
        if trace.recording and rec is not None:
            trace.attributes["narwhal.request_id"] = rec.id
        return trace

    def _record(
        self, req: Request, trace: RequestTrace | None, rec: asgi.Record | None
    ) -> Decision | None:
        """A decision record for this request, where they are kept or it is traced (the
        record is its placement span)."""
        if rec is None or (self.decisions is None and (trace is None or not trace.recording)):
            return None
        st = req.standing
        return Decision(rec.id, st.tenant, CLASSES[st.rank], req.prompt_bytes)

    def _keep(self, record: Decision, end: Ending, fields: dict[str, object]) -> None:
        """The record closed with how the request ended and what was measured of it, and
        kept where records are."""
        record.outcome = end.outcome
        record.reason = end.label if end.outcome in ("refused", "rejected") else None
        if "engine" in fields:
            record.measured = {k: fields.get(k) for k in MEASURED}
        if self.decisions is not None:
            self.decisions.keep(record)

    async def _serve(
        self,
        req: Request,
        receive: Receive,
        send: Send,
        arrived: float,
        deadline: float,
        budget: float,
        end: Ending,
        record: Decision | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(asgi.watch_disconnect(receive, task))
        try:
            self.gate.check()
            # The engines that cannot serve the route, named once: the judge plans only over
            # the rest, and placement takes only them.
            cannot = self.gate.cannot_serve(req)
            plan = await self.judge.plan(req, arrived, budget, record, cannot)
            judged = time.monotonic()
            if trace is not None:
                trace.judged_at = judged
            rec = asgi.current.get()
            if rec is not None:
                rec.fields["judged_ms"] = round((judged - arrived) * 1000, 1)
            try:
                # Where a projection judged it, its whole TTFT is held: the wait for a seat
                # counts, and a request whose budget a wait spent is refused, not placed.
                ttft_by = arrived + budget if plan.predicted_s is not None else None
                await self.placer.serve(
                    req, send, arrived, deadline, plan, cannot, end, ttft_by, trace
                )
            finally:
                plan.settle()
        except asyncio.CancelledError:
            # `client_gone` (the Ending's own) unless the answer had all gone out first.
            if not watcher.done():
                raise  # not the client's doing: shutting down
        finally:
            watcher.cancel()

    def _count(self, end: Ending, model: str) -> None:
        """The refusal's counter, by the model the request named (once the catalog resolved
        it; else the router's: never a name a client chose)."""
        m = self.metrics
        if end.outcome == "rejected":
            m.rejected.labels(end.label, model).inc()
        elif end.outcome == "refused":
            m.refused.labels(end.label, model).inc()
        elif end.outcome == "invalid" and end.status in (400, 413):
            m.invalid_requests.inc()
