"""`admission: predictive`: admit and place by projected TTFT, knowing each engine's cache.

For every eligible engine the projection counts only the prompt tokens that engine is
expected to prefill (the prompt less what its prefix cache holds, `prefix_cache`), plus the
prefill already queued there, at the engine's learned rate (`predict`). Placement takes the
lowest guarded projection, so cache affinity and load balance are one decision; a
conversation stays on its engine while that engine is projected within budget; the spec's
429s come only when no engine is.
"""

from __future__ import annotations

import time

from narwhal.router.engines import Engine
from narwhal.router.intake import Intake
from narwhal.router.lease import Events, Lease
from narwhal.router.policies import Plan
from narwhal.router.policies.prefix_cache import Expectation, PrefixCache
from narwhal.router.policies.sessions import Sessions
from narwhal.router.policies.tpot import PrefillLoad
from narwhal.router.predict import Predictor, Projection


class PredictivePolicy:
    def __init__(
        self,
        predictor: Predictor,
        engines: list[Engine],
        cache: PrefixCache | None,
        tpot_target_s: float | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        self.predictor = predictor
        self.cache = cache
        self.tpot_target_s = tpot_target_s
        self.sessions = sessions or Sessions()
        self.loads = {e.name: PrefillLoad() for e in engines}
        self._engines = {e.name: e for e in engines}
        self._profiles = [predictor.profiles[e.name] for e in engines]

    def judge(self, req: Intake, engines: list[Engine], budget_s: float) -> Plan:
        blocks = None
        expected: dict[str, Expectation] = {}
        if self.cache is not None:
            blocks = self.cache.blocks(req.prefix_text())
            if len(blocks):
                bpt = [p.bytes_per_token for p in self._profiles]
                expected = {
                    name: x
                    for name, x in zip(
                        self.cache.names, self.cache.expect(blocks, bpt), strict=True
                    )
                    if x.blocks
                }
        cached = {name: x.tokens for name, x in expected.items()}
        home = self.sessions.engine(req.session)
        paced = self.tpot_target_s is not None
        proj = self.predictor.judge(
            req.prompt_bytes,
            engines,
            budget_s,
            cached,
            self._engines.get(home or ""),
            self._keeps_pace if paced else None,
            self._stall if paced else None,
        )
        return Plan(proj.engine, proj.tokens, proj.total_s, blocks, expected, req.session)

    def _keeps_pace(self, p: Projection) -> bool:
        assert self.tpot_target_s is not None
        rate = self._rate(p.engine.name)
        if rate is None:
            return True
        tpot = self.loads[p.engine.name].projected(p.tokens, rate, time.monotonic())
        return tpot is None or tpot <= self.tpot_target_s

    def _stall(self, p: Projection) -> float:
        """Stream-seconds of decode this prompt's prefill holds up on its engine: each
        stream decoding there waits out the prefill's share of every step it shares."""
        rate = self._rate(p.engine.name)
        return 0.0 if rate is None else p.tokens / rate * p.engine.decode

    def _rate(self, name: str) -> float | None:
        prof = self.predictor.profiles[name]
        return None if prof.prefill_tps is None else prof.prefill_tps / prof.correction

    def placed(self, lease: Lease) -> None:
        plan = lease.plan
        if plan is None:
            return
        name = lease.on.name
        if plan.blocks is not None and self.cache is not None:
            self.cache.placed(name, plan.blocks)
        self.sessions.placed(plan.session, name)
        self.loads[name].placed(lease.tokens, time.monotonic())

    def watch(self, events: Events) -> None:
        self.predictor.watch(events)
        events.subscribe(finished=self._finished)

    def _finished(self, lease: Lease) -> None:
        if lease.output_tokens > 1 and lease.decode_s > 0:
            rate = self._rate(lease.on.name)
            if rate is not None:
                tpot = lease.decode_s / (lease.output_tokens - 1)
                self.loads[lease.on.name].learn(tpot, rate, time.monotonic())
        if self.cache is not None:
            self._reported(lease)

    def _reported(self, lease: Lease) -> None:
        """The engine's own count of cached tokens corrects the picture."""
        plan = lease.plan
        if plan is None or plan.blocks is None or lease.cached_tokens is None:
            return
        assert self.cache is not None
        name = lease.on.name
        exp = plan.expected.get(name)
        if exp is not None:
            self.cache.reported(name, plan.blocks, exp, lease.cached_tokens)
