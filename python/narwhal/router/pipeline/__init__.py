"""A completion request's way through the router, one stage a module, in this order:

- `read` and `intake`: the body read within its limits, checked and sized (the refusal rows
  that need no engine), with its TTFT budget and deadline: the request record
  (`router/request.py`);
- `classify`: where it stands (tenant, class, the share of its budget it is judged
  against, its order among waiters);
- `gate`: whether this router takes work now (leadership, whole-wave maintenance,
  monitoring-degraded) and which engines can serve the route;
- `judge`: the admission policy's plan (`policies/`), waiting while the budget allows when
  no engine keeps its streams' pace;
- `place`: a seat on an engine through the lease (`admission`), the relay (`relay`), and
  another engine when one answers 429.

A stage that refuses a request raises the client's error saying how the request ended
(`ApiError.ended`); `flow` counts it once, in its `Ending`.
"""

from __future__ import annotations

from narwhal.errors import ApiError


class Ending:
    """How one request ended: exactly one outcome each, so `narwhal_finished_total` adds
    up to `narwhal_offered_total`, and the label of the refusal counter it adds to."""

    __slots__ = ("label", "outcome", "status", "tokens")

    def __init__(self) -> None:
        self.outcome = "client_gone"
        self.label: str | None = None
        self.status = 0
        self.tokens: int | None = None  # prompt + output tokens, when an engine answered

    def by(self, e: ApiError) -> None:
        """Ended by `e` (an error nobody said the outcome of is the request's own fault)."""
        self.outcome, self.label, self.status = e.outcome or "invalid", e.label, e.status
