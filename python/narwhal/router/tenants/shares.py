"""Fair shares when predictive admission refuses rather than queues.

The fair queue gives tenants turns among requests waiting for a seat; predictive admission
places or refuses at once, so there a tenant sending ten times another's work would get ten
times the admissions until the fleet is full. Here each tenant's tokens served lately
(decaying, `TAU_BUDGETS` TTFT budgets) are kept; while the router is refusing work for lack
of room (a refusal within `SATURATED_BUDGETS` budgets), a tenant over its equal share of
what active tenants were served is judged against a smaller TTFT budget, `fair / share` of
its own (at least `FLOOR`): the fleet fills with the others' work first, and the shares even
out. When nothing is being refused, nobody's budget changes: work that fits is never turned
away for fairness."""

from __future__ import annotations

import math
import time

# Both in TTFT budgets: what is "lately" scales with how long a request may take to start.
TAU_BUDGETS = 2.0  # how long served tokens count (e-folding time)
SATURATED_BUDGETS = 1.0  # a refusal this recent means the fleet is full
FLOOR = 0.25  # no tenant's budget is cut below this share of its own
ACTIVE = 0.02  # a tenant served less than this share of the total is not competing


class Shares:
    def __init__(self, budget_s: float = 5.0) -> None:
        self.budget_s = budget_s  # the router's TTFT budget (set again on a reload)
        self._served: dict[str, float] = {}
        self._at = 0.0
        self._refused_at = -math.inf

    def _decay(self, now: float) -> None:
        if now > self._at:
            k = math.exp(-(now - self._at) / (TAU_BUDGETS * self.budget_s))
            for t in self._served:
                self._served[t] *= k
            self._at = now

    def served(self, tenant: str, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._decay(now)
        self._served[tenant] = self._served.get(tenant, 0.0) + tokens

    def refused(self, now: float | None = None) -> None:
        """The router refused work for lack of room."""
        self._refused_at = time.monotonic() if now is None else now

    def fair_share(self, tenant: str, now: float | None = None) -> float:
        """The share of its budget a request of `tenant` is judged against now."""
        now = time.monotonic() if now is None else now
        if now - self._refused_at > SATURATED_BUDGETS * self.budget_s:
            return 1.0
        self._decay(now)
        total = sum(self._served.values())
        if total <= 0:
            return 1.0
        active = [t for t, v in self._served.items() if v >= ACTIVE * total]
        mine = self._served.get(tenant, 0.0)
        if len(active) < 2 or mine <= total / len(active):
            return 1.0
        return max(FLOOR, total / len(active) / mine)
