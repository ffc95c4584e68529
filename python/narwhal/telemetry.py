"""OpenTelemetry traces, for the router and LexiEngine alike: off unless configured.

Spans go over OTLP/HTTP (protobuf) through the OpenTelemetry SDK's own exporter, batched
on its thread: the event loop only builds spans. Incoming `traceparent` is honoured (a
sampled parent is recorded whatever the ratio: the SDK's parent-based sampler), and each
request's call onward carries one, so one trace runs from the client through the router
into the engine.

Spans are made from times the request path records anyway (monotonic seconds), when what
they cover is over: nothing is held open across awaits but the one span a traceparent
must name before its call goes out. The SDK is imported only when tracing is on.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    Attributes = dict[str, Any]

SERVER, CLIENT, INTERNAL = "server", "client", "internal"


@dataclass(frozen=True)
class Settings:
    """Where spans go and how many requests are traced."""

    otlp_endpoint: str  # the collector's OTLP/HTTP base URL (`http://collector:4318`)
    service_name: str
    sample_ratio: float = 1.0  # of requests that come without a sampled parent


def installed() -> bool:
    """The OpenTelemetry SDK and its OTLP/HTTP exporter can be imported (the `telemetry`
    extra)."""
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:
        return False


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (a full `/v1/traces` URL as is),
    as `OTEL_EXPORTER_OTLP_ENDPOINT` is read."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def wall_ns(mono: float) -> int:
    """A monotonic time (seconds) as the wall-clock nanoseconds spans are stamped in."""
    return time.time_ns() + int((mono - time.monotonic()) * 1e9)


class Tracing:
    """One process's tracer: spans begun from a request's traceparent, children made over
    recorded times, and the exporter's batch flushed at shutdown."""

    def __init__(self, settings: Settings, scope: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(settings.otlp_endpoint)))
        )
        self.tracer = self.provider.get_tracer(scope)
        self._kinds = {
            SERVER: SpanKind.SERVER,
            CLIENT: SpanKind.CLIENT,
            INTERNAL: SpanKind.INTERNAL,
        }
        self._propagator = TraceContextTextMapPropagator()
        self._error = StatusCode.ERROR
        self._status = Status
        self._in = set_span_in_context

    def begin(self, name: str, traceparent: str | None, start: float) -> Span:
        """A request's span (kind server), child of `traceparent` where one came and is
        valid (anything else starts a trace of its own), from `start` (monotonic)."""
        ctx = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        return self.tracer.start_span(
            name, context=ctx, kind=self._kinds[SERVER], start_time=wall_ns(start)
        )

    def open(self, parent: Span, name: str, start: float, kind: str = INTERNAL) -> Span:
        """A child of `parent` from `start`, ended by its caller (`close`)."""
        return self.tracer.start_span(
            name,
            context=self._in(parent),
            kind=self._kinds[kind],
            start_time=wall_ns(start),
        )

    def child(
        self,
        parent: Span,
        name: str,
        start: float,
        end: float,
        attributes: Attributes | None = None,
        kind: str = INTERNAL,
    ) -> Span:
        """A child of `parent` over `start`..`end` (monotonic), ended."""
        span = self.open(parent, name, start, kind)
        if attributes:
            span.set_attributes(_clean(attributes))
        span.end(end_time=wall_ns(max(start, end)))
        return span

    def close(self, span: Span, end: float, attributes: Attributes | None = None) -> None:
        if attributes:
            span.set_attributes(_clean(attributes))
        span.end(end_time=wall_ns(end))

    def failed(self, span: Span, why: str) -> None:
        span.set_status(self._status(self._error, why))

    def event(self, span: Span, name: str, at: float, attributes: Attributes | None) -> None:
        span.add_event(name, _clean(attributes or {}), timestamp=wall_ns(at))

    def shutdown(self) -> None:
        """The batch still queued is sent (blocking: run it off the event loop)."""
        self.provider.shutdown()


def tracing_of(
    otlp_endpoint: str | None, service_name: str, sample_ratio: float, scope: str
) -> Tracing | None:
    """A program's tracer from its settings; None (off) without an endpoint."""
    if not otlp_endpoint:
        return None
    return Tracing(Settings(otlp_endpoint, service_name, sample_ratio), scope)


class Trace:
    """One request's own span (kind server, child of the `traceparent` it came with), begun
    at its arrival; what its stages record for the rest is the program's (router.tracing,
    engine.tracing)."""

    __slots__ = ("arrived", "recording", "root", "tracing")

    def __init__(self, tracing: Tracing, parent: str | None, name: str, arrived: float) -> None:
        self.tracing = tracing
        self.root: Span = tracing.begin(name, parent, arrived)
        self.recording = self.root.is_recording()  # False: left out by the sampler
        self.arrived = arrived


def traceparent(span: Span) -> str:
    """The W3C `traceparent` value naming `span` (its sampled flag as decided)."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def _clean(attributes: Attributes) -> Attributes:
    """Attributes OpenTelemetry takes: None left out (it warns on each)."""
    return {k: v for k, v in attributes.items() if v is not None}
