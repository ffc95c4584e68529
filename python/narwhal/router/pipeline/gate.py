"""The gate: whether this router takes a completion request now, and where it may go.

The spec's last refusal row: standby, fenced, whole-wave maintenance and monitoring-degraded
are each a retryable 503. Leadership is checked again once a request is placed (the queue
may have waited): the fencing token it carries must be one this router still holds.
"""

from __future__ import annotations

from narwhal.errors import ApiError, unavailable
from narwhal.router.endings import End
from narwhal.router.engines import Pool
from narwhal.router.ha.leadership import Leadership, Role
from narwhal.router.ha.maintenance import Maintenance
from narwhal.router.models import Catalog
from narwhal.router.policies import Policy
from narwhal.router.request import RESPONSES, RESPONSES_DIALECTS, Request


class Gate:
    def __init__(
        self,
        leadership: Leadership,
        maintenance: Maintenance,
        pool: Pool,
        policy: Policy,
        catalog: Catalog,
    ) -> None:
        self.leadership = leadership
        self.maintenance = maintenance
        self.pool = pool
        self.catalog = catalog
        self.policy = policy

    def degraded(self) -> str | None:
        """Why the policy's predictions cannot be trusted now, or None."""
        eligible = self.pool.eligible()
        return self.policy.degraded(eligible) if eligible else None

    def unavailable(self) -> tuple[End, str] | None:
        """Why this router takes no completion request now: (how the request ends, the
        reason), or None."""
        why = self.leadership.serving()
        if why is not None:
            return not_leading(self.leadership.role), why
        if self.maintenance.whole:
            return End.MAINTENANCE, "whole-wave maintenance: every engine is in the wave"
        degraded = self.degraded()
        if degraded is not None:
            return End.MONITORING_DEGRADED, "monitoring-degraded: " + degraded
        return None

    def check(self) -> None:
        down = self.unavailable()
        if down is not None:
            raise not_taking(*down)

    def check_leading(self) -> None:
        """Raises the retryable 503 unless this router may still place work."""
        why = self.leadership.serving()
        if why is not None:
            raise not_taking(not_leading(self.leadership.role), why)

    def cannot_serve(self, req: Request) -> frozenset[str]:
        """The engines that cannot serve the request: not its model, or not its route (a 404
        when no engine's dialect serves the route)."""
        names = self.catalog.not_serving(req.served)
        if req.route != RESPONSES:
            return names
        engines = self.pool.engines
        route = frozenset(e.name for e in engines if e.spec.dialect not in RESPONSES_DIALECTS)
        if engines and len(route) == len(engines):  # none yet (engines_from): a 503 later
            raise ApiError(
                404,
                f"no engine behind this router serves {req.route} (dialects that do: "
                + ", ".join(sorted(RESPONSES_DIALECTS))
                + ")",
                code="unsupported",
            ).ended(End.INVALID)
        return names | route


def not_leading(role: Role) -> End:
    """How a request ends at a router that may not place work in `role` (its label the
    role's name; a leader whose lease lapsed is fenced by then)."""
    return _NOT_LEADING[role]


_NOT_LEADING = {
    Role.STANDBY: End.STANDBY,
    Role.FENCED: End.FENCED,
    Role.STOPPING: End.STOPPING,
    Role.LEADER: End.FENCED,
    Role.ACTIVE: End.FENCED,
}


def not_taking(row: End, reason: str) -> ApiError:
    """The retryable 503 (`errors.unavailable`): this router takes no completion request
    now (why: `reason`); the request ends as `row` says, its label the error's code."""
    code = row.label or row.outcome
    return unavailable(f"this router takes no requests now ({reason}); retry shortly", code).ended(
        row
    )
