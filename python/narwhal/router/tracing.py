"""One completion request's trace through the router (`telemetry: {...}`; narwhal.telemetry).

The request's span (kind server, child of the client's `traceparent`) has a child per stage:
`intake` (the body read and checked), `placement` (the judgement: the decision record as
attributes, each engine weighed as an event, the wait for pace inside it), `queue` (the
wait for a seat), `upstream` (kind client: the call to the engine, whose `traceparent`
names it, with the first token and the last as events) and `relay` (first byte out to the
end). The stages write the times they pass (`read_at`, `judged_at`, `placed_at`; the
lease's measured times); the spans are made from them when the request ends, except the
upstream span, begun as its call goes out. A request the sampler leaves out still passes
its trace on (the flag says unsampled), and costs one span that records nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from narwhal.router.decisions import ms
from narwhal.router.tenants.fair_queue import CLASSES
from narwhal.telemetry import CLIENT, Trace, Tracing, traceparent

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from narwhal.router.decisions import Decision
    from narwhal.router.endings import Ending
    from narwhal.router.lease import Lease
    from narwhal.router.request import Request

log = logging.getLogger("narwhal.tracing")

# Outcomes that are not a served request: the request's span says so in its status.
FAILED = frozenset({"refused", "rejected", "invalid", "engine_failed", "deadline", "stream_fault"})


class RequestTrace(Trace):
    """What the stages record of one request for its spans (see the module)."""

    __slots__ = ("attributes", "calls", "judged_at", "placed_at", "read_at")

    def __init__(self, tracing: Tracing, parent: str | None, name: str, arrived: float) -> None:
        super().__init__(tracing, parent, name, arrived)
        self.read_at = 0.0  # the body was read and checked
        self.judged_at = 0.0  # placement chose (after any wait for pace)
        self.placed_at = 0.0  # a seat was had
        self.calls: list[tuple[Span, Lease]] = []  # upstream calls, the last one answered
        self.attributes: dict[str, Any] = {}  # of the request's span, as intake learns them

    def read(self, req: Request) -> None:
        """The body was read and checked: what the request's span says of it."""
        if not self.recording:
            return
        self.read_at = time.monotonic()
        self.attributes.update(
            {
                "gen_ai.request.model": req.body.get("model"),
                "narwhal.tenant": req.standing.tenant or None,
                "narwhal.priority": CLASSES[req.standing.rank],
                "narwhal.stream": req.stream,
                "narwhal.prompt_bytes": req.prompt_bytes,
                "narwhal.max_tokens": req.max_tokens,
            }
        )

    def call(self, lease: Lease) -> str:
        """The `traceparent` header line for the call to `lease`'s engine, naming the
        upstream span begun for it (an earlier call that engine 429'd ends here)."""
        if not self.recording:
            return f"traceparent: {traceparent(self.root)}\r\n"
        t = self.tracing
        sent = lease.measured.sent_at
        if self.calls:
            busy, _ = self.calls[-1]
            t.failed(busy, "the engine answered 429: another took the request")
            t.close(busy, sent)
        span = t.open(self.root, "upstream", sent, CLIENT)
        span.set_attribute("narwhal.engine", lease.on.name)
        self.calls.append((span, lease))
        return f"traceparent: {traceparent(span)}\r\n"

    def finish(
        self, end: Ending, record: Decision | None, fields: dict[str, Any], now: float
    ) -> None:
        """The request ended at `now`, as `end` says: its spans go to the exporter. A span
        that cannot be made is logged, never the request's fault."""
        if not self.recording:
            return
        try:
            self._finish(end, record, fields, now)
        except Exception:
            log.warning(
                "request %s: its spans could not be made",
                self.attributes.get("narwhal.request_id"),
                exc_info=True,
            )

    def _finish(
        self, end: Ending, record: Decision | None, fields: dict[str, Any], now: float
    ) -> None:
        t, root = self.tracing, self.root
        read_at = self.read_at or now
        t.child(root, "intake", self.arrived, read_at)
        if self.read_at and record is not None and (record.candidates or record.refusal):
            self._placement(record, self.judged_at or now)
        if self.judged_at and self.placed_at:
            t.child(root, "queue", self.judged_at, self.placed_at)
        if self.calls:
            self._upstream(now)
        attrs = {
            **self.attributes,
            "narwhal.outcome": end.outcome,
            "narwhal.engine": fields.get("engine"),
            "narwhal.ttft.projected_ms": fields.get("projected_ms"),
            "narwhal.ttft.measured_ms": fields.get("ttfb_ms"),
            "narwhal.tokens.cached": fields.get("tokens_cached"),
            "narwhal.tokens.cached_expected": fields.get("cached_expected"),
            "gen_ai.usage.input_tokens": fields.get("tokens_in"),
            "gen_ai.usage.output_tokens": fields.get("tokens_out"),
            "http.response.status_code": end.status or None,
        }
        if end.outcome in FAILED:
            reason = end.label or end.outcome
            attrs["narwhal.refusal.reason"] = (
                reason if end.outcome in ("refused", "rejected") else None
            )
            t.failed(root, reason)
        t.close(root, now, attrs)

    def _placement(self, record: Decision, until: float) -> None:
        """The decision record as the placement span: its figures as attributes, each
        engine weighed as an event."""
        t = self.tracing
        span = t.open(self.root, "placement", self.read_at)
        d = record.describe()
        for c in d["candidates"]:
            t.event(span, "candidate", until, c)
        refusal = record.refusal or {}
        attrs = {
            "narwhal.budget_ms": d["budget_ms"],
            "narwhal.waited_for_pace_ms": d["waited_ms"],
            "narwhal.choice": d["choice"],
            "narwhal.why": d["why"],
            "narwhal.candidates": len(d["candidates"]),
            "narwhal.refusal.code": refusal.get("code"),
            "narwhal.refusal.message": refusal.get("message"),
        }
        if refusal:
            t.failed(span, str(refusal.get("code")))
        t.close(span, until, attrs)

    def _upstream(self, now: float) -> None:
        """The answered call's span closed with what the relay measured, and the relay's."""
        t = self.tracing
        span, lease = self.calls[-1]
        m = lease.measured
        if m.first_at:
            t.event(span, "first_token", m.first_at, None)
            if m.decode_s:
                t.event(span, "last_token", m.first_at + m.decode_s, None)
        t.close(
            span,
            now,
            {
                "narwhal.ttft.projected_ms": ms(lease.predicted_s or None),
                "narwhal.ttft.measured_ms": ms(m.first_at - lease.arrived) if m.first_at else None,
                "narwhal.tokens.cached": m.cached_tokens,
                "gen_ai.usage.input_tokens": m.prompt_tokens,
                "gen_ai.usage.output_tokens": m.output_tokens,
            },
        )
        if m.first_byte_at:
            t.child(self.root, "relay", m.first_byte_at, now)
