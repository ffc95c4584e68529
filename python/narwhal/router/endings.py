"""Every way a completion request ends, drawn once, the way httpx draws its error tree: a
row is the outcome `narwhal_finished_total{outcome}` counts and, for a refusal, the
`reason` label of `narwhal_rejected_total` / `narwhal_refused_total`.

    completed        the answer relayed in full
    stream_fault     the stream ended with an error event, or cut short
    engine_error     the engine's own non-200 answer, relayed as it sent it
    engine_failed    the engine failed under the request (502)
    deadline         the request's deadline passed while placed (504)
    client_gone      the client went away first
    invalid          the request's own fault (400, 403, 404, 413)
    rejected/...     no room now, nothing judged (503 or 429 to retry)
      retention        the router holds as many requests as it may
      queue_full       the admission queue is full
      backend_unavailable   no engine can take work
      wait_expired     no seat came before the wait or deadline ran out
      engine_busy      every engine answered 429
      fenced           this router was fenced out
      tenant           the tenant is over its limits
      standby, stopping, maintenance, monitoring_degraded   the gate takes no work now
    refused/...      judged: it could not be served within its targets (429)
      ttft_budget_exceeded         the projected first token comes too late
      queue_wait                   ... counting the router's queue, or a wait spent it
      prompt_exceeds_ttft_budget   the prompt alone takes longer than the budget
      tpot_target_exceeded         no engine keeps the pace of its streams

A stage says which row (an `End`) where it knows the cause: on the error it raises
(`ApiError.ended`) or as the relay's answer. `Ending`, the one record of how one request
ended, takes the row; nothing else writes an outcome or a label, and `Flow` counts it once.
"""

from __future__ import annotations

import enum

from narwhal.errors import ApiError


class End(enum.Enum):
    """A row: (outcome, label)."""

    _value_: tuple[str, str | None]

    COMPLETED = ("completed", None)
    STREAM_FAULT = ("stream_fault", None)
    ENGINE_ERROR = ("engine_error", None)
    ENGINE_FAILED = ("engine_failed", None)
    DEADLINE = ("deadline", None)
    CLIENT_GONE = ("client_gone", None)
    INVALID = ("invalid", None)
    RETENTION = ("rejected", "retention")
    QUEUE_FULL = ("rejected", "queue_full")
    BACKEND_UNAVAILABLE = ("rejected", "backend_unavailable")
    WAIT_EXPIRED = ("rejected", "wait_expired")
    ENGINE_BUSY = ("rejected", "engine_busy")
    FENCED = ("rejected", "fenced")
    TENANT = ("rejected", "tenant")
    STANDBY = ("rejected", "standby")
    STOPPING = ("rejected", "stopping")
    MAINTENANCE = ("rejected", "maintenance")
    MONITORING_DEGRADED = ("rejected", "monitoring_degraded")
    TTFT_BUDGET_EXCEEDED = ("refused", "ttft_budget_exceeded")
    QUEUE_WAIT = ("refused", "queue_wait")
    PROMPT_EXCEEDS_TTFT_BUDGET = ("refused", "prompt_exceeds_ttft_budget")
    TPOT_TARGET_EXCEEDED = ("refused", "tpot_target_exceeded")

    @property
    def outcome(self) -> str:
        return self._value_[0]

    @property
    def label(self) -> str | None:
        return self._value_[1]


# The outcomes, in the order `narwhal_finished_total` is drawn.
OUTCOMES = tuple(dict.fromkeys(e.outcome for e in End))
# Each refusal counter's labels (drawn at start, so a dashboard sees zeros).
REJECTED = tuple(e.label for e in End if e.outcome == "rejected" and e.label)
REFUSED = tuple(e.label for e in End if e.outcome == "refused" and e.label)


class Ending:
    """How one request ended: exactly one row each, so `narwhal_finished_total` adds up to
    `narwhal_offered_total`; and the request's tokens, where an engine answered."""

    __slots__ = ("end", "status", "tokens")

    def __init__(self) -> None:
        self.end = End.CLIENT_GONE  # until a stage or the relay says otherwise
        self.status = 0
        self.tokens: int | None = None  # prompt + output tokens, when an engine answered

    @property
    def outcome(self) -> str:
        return self.end.outcome

    @property
    def label(self) -> str | None:
        return self.end.label

    def by(self, e: ApiError) -> None:
        """Ended by `e` (an error nobody said the row of is the request's own fault)."""
        cause = e.cause
        self.end = cause if isinstance(cause, End) else End.INVALID
        self.status = e.status
