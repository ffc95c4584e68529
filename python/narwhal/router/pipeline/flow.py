"""One completion request through the stages, in order, and its one outcome.

Each stage that refuses a request counts the refusal and says how it ended (`Ending`);
`narwhal_finished_total{outcome}` is counted here, once, whatever happened.
"""

from __future__ import annotations

import asyncio
import time

from narwhal import asgi
from narwhal.asgi import Receive, Scope, Send
from narwhal.errors import ApiError
from narwhal.router.admission import Admission
from narwhal.router.config import RouterConfig
from narwhal.router.metrics import RouterMetrics
from narwhal.router.pipeline import Ending
from narwhal.router.pipeline.gate import Gate
from narwhal.router.pipeline.intake import Intake
from narwhal.router.pipeline.judge import Judge
from narwhal.router.pipeline.place import Placer
from narwhal.router.pipeline.read import read


class Flow:
    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        admission: Admission,
        gate: Gate,
        judge: Judge,
        placer: Placer,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self.gate = gate
        self.judge = judge
        self.placer = placer

    async def __call__(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """One completion request, from its arrival to its one outcome."""
        m = self.metrics
        arrived = time.monotonic()
        m.offered.inc()
        end = Ending()
        try:
            try:
                self.admission.retain()
            except ApiError:
                m.rejected.labels("retention").inc()
                end.outcome = "rejected"
                raise
            try:
                req, deadline, budget = await read(
                    path, scope, receive, self.config, m, arrived, end
                )
                await self._serve(req, receive, send, arrived, deadline, budget, end)
            finally:
                self.admission.release_retention()
        finally:
            m.finished.labels(end.outcome).inc()
            rec = asgi.current.get()
            if rec is not None:
                rec.fields["outcome"] = end.outcome

    async def _serve(
        self,
        req: Intake,
        receive: Receive,
        send: Send,
        arrived: float,
        deadline: float,
        budget: float,
        end: Ending,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(asgi.watch_disconnect(receive, task))
        try:
            try:
                self.gate.check()
            except ApiError as e:
                self.metrics.rejected.labels(e.code or "unavailable").inc()
                end.outcome = "rejected"
                raise
            try:
                plan = await self.judge.plan(req, arrived, budget)
            except ApiError as e:
                self.metrics.refused.labels(e.code or "predictive").inc()
                end.outcome = "refused"
                raise
            try:
                busy = self.gate.cannot_serve(req)
            except ApiError:
                end.outcome = "invalid"
                raise
            await self.placer.serve(req, send, arrived, deadline, plan, busy, end)
        except asyncio.CancelledError:
            end.outcome = "client_gone"
            if not watcher.done():
                raise  # not the client's doing: shutting down
        finally:
            watcher.cancel()
