"""The router's Prometheus counters, gauges and histograms."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from narwhal.router.endings import OUTCOMES, REFUSED, REJECTED
from narwhal.router.lease import Events, Lease

if TYPE_CHECKING:
    from narwhal.router.admission import Admission
    from narwhal.router.engines import Pool
    from narwhal.router.predict import Predictor

# Up to the default request timeout (600 s): a long answer lands in a bucket, not in +Inf.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# No `*_created` series (one per counter and histogram child): they double what a scrape
# carries and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]
_TPOT = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1)
# ln(measured / projected TTFT): 0 exact, +0.69 twice as long, -0.69 half; signed, since
# a late first token and an early one cost different things (the SLO, or refused work).
_LOG_RATIO = (-1.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 1.5)
# (cached tokens the engine reported - tokens the router expected it to hold) / prompt.
_SHARE_ERROR = (-1, -0.5, -0.25, -0.1, -0.01, 0.01, 0.1, 0.25, 0.5, 1)


class RouterMetrics:
    """Every series the router exports, defined by family: how requests ended, what
    engines did, latencies and projections, and the server itself."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._outcomes(r)
        self._engines(r)
        self._tenants(r)
        self._latencies(r)
        self._server(r)
        self._peers(r)
        self._per_engine: dict[tuple[str, str], EngineMetrics] = {}
        self._answered: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def _outcomes(self, r: CollectorRegistry) -> None:
        """Arrivals, refusals and how each request ended."""
        self.offered = Counter("narwhal_offered", "Arrivals at a completion route", registry=r)
        self.unsized_offered = Counter(
            "narwhal_unsized_offered", "Arrivals whose body ended before sizing", registry=r
        )
        self.rejected = Counter(
            "narwhal_rejected", "Capacity rejections", ["reason", "model"], registry=r
        )
        self.refused = Counter(
            "narwhal_refused", "Predictive refusals", ["reason", "model"], registry=r
        )
        self.invalid_requests = Counter(
            "narwhal_invalid_requests", "Malformed request bodies", registry=r
        )
        self.background_errors = Counter(
            "narwhal_background_errors",
            "Failures of a background loop (each logged with its stack and started again)",
            ["task"],
            registry=r,
        )
        self.warmed = Counter(
            "narwhal_warmed_prompts",
            "Prompts refused for their TTFT and prefilled anyway on an engine with room, by "
            "outcome (warmed, yielded to a live request, no_room, failed)",
            ["outcome"],
            registry=r,
        )
        self.paced_waits = Counter(
            "narwhal_paced_waits",
            "Requests that waited in the router for an engine to keep its streams' TPOT target",
            registry=r,
        )
        self.finished = Counter(
            "narwhal_finished",
            "Requests by how they ended (completed, stream_fault, "
            "engine_error, engine_failed, deadline, rejected, refused, invalid, client_gone); "
            "adds up to narwhal_offered_total",
            ["outcome"],
            registry=r,
        )
        # Looked up once (`engine` says why): one of these a request.
        self._finished_as = {outcome: self.finished.labels(outcome) for outcome in OUTCOMES}

    def _engines(self, r: CollectorRegistry) -> None:
        """What each engine answered, holds and relayed."""
        self.completed = Counter(
            "narwhal_completed", "Requests answered in full", ["engine", "model"], registry=r
        )
        self.stream_faults = Counter(
            "narwhal_stream_faults",
            "Engine answers that ended in a fault, by reason "
            "(engine_disconnected, engine_stalled, engine_removed, connect, assembly, "
            "engine_error, deadline_exceeded, or the frame check that refused the stream)",
            ["engine", "reason"],
            registry=r,
        )
        self.output_tokens = Counter(
            "narwhal_output_tokens", "Relayed output tokens", ["engine", "model"], registry=r
        )
        self.prompt_tokens = Counter(
            "narwhal_prompt_tokens",
            "Prompt tokens of answered requests, as the engine counted them",
            ["engine", "model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "narwhal_cached_prompt_tokens",
            "Of those, the tokens the engine's prefix cache served (where it says: the "
            "llama-server dialect does not); over narwhal_prompt_tokens_total, its hit rate",
            ["engine", "model"],
            registry=r,
        )
        # The targets requests are held to (predictive.ttft_budget_s, tpot_target_s), for
        # dashboards to draw the latencies against; a reload that changes one moves it.
        self.target = Gauge(
            "narwhal_target_seconds",
            "The TTFT budget and the TPOT target (where set) requests are held to",
            ["target"],
            registry=r,
        )
        self.inflight = Gauge(
            "narwhal_inflight", "Requests placed on an engine", ["engine", "phase"], registry=r
        )
        self.retained = Gauge("narwhal_retained", "Requests the router holds", registry=r)
        self.queued = Gauge("narwhal_queued", "Requests waiting for placement", registry=r)
        self.engine_restarts = Counter(
            "narwhal_engine_restarts",
            "Managed engine processes that exited and were restarted",
            ["engine"],
            registry=r,
        )
        self.engine_healthy = Gauge(
            "narwhal_engine_healthy",
            "1 when the engine is eligible for placement",
            ["engine"],
            registry=r,
        )

        self.engines = Gauge(
            "narwhal_engines",
            "Engines in the fleet, by state (serving, draining, unhealthy)",
            ["state"],
            registry=r,
        )
        self.membership = Counter(
            "narwhal_engine_membership_changes",
            "Engines added, drained and removed while the router runs, by where the change "
            "came from (config, admin, etcd, dns)",
            ["change", "source"],
            registry=r,
        )

    def _tenants(self, r: CollectorRegistry) -> None:
        """Each tenant's requests, as its limits took them and as they ended."""
        self.tenant_requests = Counter(
            "narwhal_tenant_requests",
            "Requests of each tenant (auth.api_keys) by priority class, as its own limits "
            "took them: admitted, refused_rpm, refused_tpm, refused_concurrency",
            ["tenant", "priority", "result"],
            registry=r,
        )
        self.tenant_finished = Counter(
            "narwhal_tenant_finished",
            "Requests of each tenant by priority class, as they ended (the outcome of "
            "narwhal_finished_total, and the refusal's reason or empty)",
            ["tenant", "priority", "outcome", "reason"],
            registry=r,
        )
        self.tenant_queue_time = Histogram(
            "narwhal_tenant_queue_time_seconds",
            "Arrival to placement on an engine, per tenant and priority class",
            ["tenant", "priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tenant_tokens = Counter(
            "narwhal_tenant_tokens",
            "Prompt and output tokens each tenant's requests used, as the router measured them",
            ["tenant"],
            registry=r,
        )

    def _latencies(self, r: CollectorRegistry) -> None:
        """Time to first byte, projections against what engines did, time per token."""
        self.ttfb = Histogram(
            "narwhal_time_to_first_byte_seconds",
            "Arrival to first relayed byte",
            ["engine", "model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "narwhal_predicted_ttft_seconds",
            "Projected TTFT of admitted requests",
            ["engine"],
            buckets=_LATENCY,
            registry=r,
        )
        self.observed_ttft = Histogram(
            "narwhal_observed_ttft_seconds",
            "TTFT of requests that had a projection, from when they were projected (their "
            "wait in the router's queue included, as the projection counts it)",
            ["engine"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "narwhal_ttft_prediction_error",
            "ln(engine TTFT / projected TTFT) of requests placed where they were projected",
            ["engine"],
            buckets=_LOG_RATIO,
            registry=r,
        )
        self.cache_expectation_error = Histogram(
            "narwhal_cache_expectation_error",
            "(cached prompt tokens the engine reported - those expected) / prompt tokens",
            ["engine"],
            buckets=_SHARE_ERROR,
            registry=r,
        )
        self.prediction_drift = Gauge(
            "narwhal_prediction_drift",
            "EWMA of |ln(observed/predicted TTFT)|",
            ["engine"],
            registry=r,
        )
        self.sizing_error = Gauge(
            "narwhal_sizing_error",
            "EWMA relative error of prompt-token sizing",
            ["engine"],
            registry=r,
        )
        self.tpot = Histogram(
            "narwhal_time_per_output_token_seconds",
            "Mean time per output token after the first",
            ["engine", "model"],
            buckets=_TPOT,
            registry=r,
        )
        self.queue_time = Histogram(
            "narwhal_queue_time_seconds",
            "Arrival to placement on an engine",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )

    def _peers(self, r: CollectorRegistry) -> None:
        """Active routers' picture exchange (`ha.mode: active`)."""
        self.peer_deltas = Counter(
            "narwhal_peer_deltas",
            "Picture deltas exchanged with the other active routers: sent (acknowledged), "
            "received (folded in), dropped (an outbox over its bound, or a peer that could "
            "not be reached: replaced by a snapshot)",
            ["direction"],
            registry=r,
        )
        for d in ("sent", "received", "dropped"):
            self.peer_deltas.labels(d)
        self.peer_snapshots = Counter(
            "narwhal_peer_snapshots",
            "Snapshots of a router's live work sent to a peer (it joined, or missed deltas) "
            "and received",
            ["direction"],
            registry=r,
        )
        for d in ("sent", "received"):
            self.peer_snapshots.labels(d)
        self.peer_lag = Histogram(
            "narwhal_peer_lag_seconds",
            "A delta's time from this router's placement to a peer's acknowledgement: how "
            "old the other routers' picture of this router's work is, at most",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.peer_yields = Counter(
            "narwhal_peer_yields",
            "Times a request that waited for pace and found room gave it first to an older "
            "request waiting at another active router",
            registry=r,
        )
        self.peers = Gauge(
            "narwhal_peers",
            "Other active routers this router exchanges its picture with",
            registry=r,
        )
        self.placements = Counter(
            "narwhal_placements",
            "Requests placed by each active router as this one sees them (its own, and the "
            "others' through the exchange): the routers' shares of placement",
            ["router"],
            registry=r,
        )

    def _server(self, r: CollectorRegistry) -> None:
        """Responses by code, how streams were relayed, the server's own housekeeping."""
        self.relayed_streams = Counter(
            "narwhal_relayed_streams",
            "Streamed answers by how they were relayed: native "
            "(from the read callback, in Rust) or awaited (each send from Python)",
            ["path"],
            registry=r,
        )
        for path in ("native", "awaited"):
            self.relayed_streams.labels(path)
        self.responses = Counter(
            "narwhal_responses",
            "Completion responses by status code",
            ["model", "route", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "narwhal_request_duration_seconds",
            "Completion requests, arrival to the last byte",
            ["model", "route"],
            buckets=_LATENCY,
            registry=r,
        )
        self.info = Gauge(
            "narwhal_info", "The router's model and version", ["model", "version"], registry=r
        )
        self.silent_closed = Counter(
            "narwhal_silent_connections_closed",
            "Client connections closed for sending nothing within serving.header_timeout_s",
            registry=r,
        )

    def watch(self, events: Events) -> None:
        events.subscribe(first_byte=self._first_byte, finished=self._finished, fault=self._fault)

    def _first_byte(self, lease: Lease) -> None:
        m = self.engine(lease.on.name, lease.request.model)
        m.ttfb.observe(time.monotonic() - lease.arrived)

    def _finished(self, lease: Lease) -> None:
        name = lease.on.name
        m = self.engine(name, lease.request.model)
        m.completed.inc()
        tokens = lease.measured.output_tokens
        m.output_tokens.inc(tokens)
        if tokens > 1 and lease.measured.decode_s:
            m.tpot.observe(lease.measured.decode_s / (tokens - 1))
        ttft = lease.projected_ttft_s
        if lease.predicted_s is not None and ttft is not None:
            self.predicted_ttft.labels(name).observe(lease.predicted_s)
            self.observed_ttft.labels(name).observe(ttft)
            if lease.predicted_s > 0 and ttft > 0:
                self.ttft_prediction_error.labels(name).observe(math.log(ttft / lease.predicted_s))
        # Only where the engine said what its cache served (llama-server's dialect does not).
        prompt, cached = lease.measured.prompt_tokens, lease.measured.cached_tokens
        if prompt:
            m.prompt_tokens.inc(prompt)
            if cached:
                m.cached_tokens.inc(cached)
        held = lease.cached_expected
        if held is not None and prompt and cached is not None:
            self.cache_expectation_error.labels(name).observe((cached - held) / prompt)

    def _fault(self, lease: Lease, kind: str, against_engine: str | None) -> None:
        self.stream_faults.labels(lease.on.name, kind).inc()

    def answered(self, model: str, route: str, code: int, seconds: float) -> None:
        """One completion response: its code and how long it took (children looked up once,
        as in `engine`)."""
        key = (model, route, code)
        pair = self._answered.get(key)
        if pair is None:
            pair = self._answered[key] = (
                self.responses.labels(model, route, str(code)),
                self.duration.labels(model, route),
            )
        pair[0].inc()
        pair[1].observe(seconds)

    def finished_as(self, outcome: str) -> Any:
        """`narwhal_finished_total{outcome}`'s child."""
        child = self._finished_as.get(outcome)
        if child is None:
            child = self._finished_as[outcome] = self.finished.labels(outcome)
        return child

    def serving(self, model: str) -> None:
        """Every refusal and rejection reason exported at 0 for the router's `model` from
        the start: a dashboard's rate() needs the series before the first event."""
        for reason in REJECTED:
            self.rejected.labels(reason, model)
        for reason in REFUSED:
            self.refused.labels(reason, model)

    def targets(self, ttft_budget_s: float, tpot_target_s: float | None) -> None:
        self.target.labels("ttft").set(ttft_budget_s)
        if tpot_target_s is not None:
            self.target.labels("tpot").set(tpot_target_s)
        else:
            with contextlib.suppress(KeyError):
                self.target.remove("tpot")

    def engine(self, name: str, model: str) -> EngineMetrics:
        """The per-request series of one engine and model, looked up once: `labels()`
        validates and locks on every call (~2.5 µs), and a streamed request touches four."""
        em = self._per_engine.get((name, model))
        if em is None:
            em = self._per_engine[(name, model)] = EngineMetrics(self, name, model)
        return em

    def refresh(self, pool: Pool, admission: Admission, predictor: Predictor | None) -> None:
        """The gauges, read from their owners when `/metrics` is scraped."""
        eligible = pool.eligible()
        states = dict.fromkeys(("serving", "draining", "unhealthy"), 0)
        for e in pool.engines:
            self.engine_healthy.labels(e.name).set(1 if e in eligible else 0)
            states[e.state] += 1
        for state, n in states.items():
            self.engines.labels(state).set(n)
        self.retained.set(admission.retained)
        self.queued.set(admission.queued)
        for e in pool.engines:
            self.inflight.labels(e.name, "prefill").set(e.prefill)
            self.inflight.labels(e.name, "decode").set(e.decode)
            if predictor is not None:
                prof = predictor.profiles[e.name]
                self.prediction_drift.labels(e.name).set(prof.drift or 0.0)
                self.sizing_error.labels(e.name).set(prof.sizing_error or 0.0)

    def forget(self, name: str) -> None:
        """A removed engine's gauges go (its counters stay: what it served happened)."""
        for gauge, labels in (
            (self.engine_healthy, (name,)),
            (self.inflight, (name, "prefill")),
            (self.inflight, (name, "decode")),
            (self.prediction_drift, (name,)),
            (self.sizing_error, (name,)),
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)


class EngineMetrics:
    __slots__ = ("cached_tokens", "completed", "output_tokens", "prompt_tokens", "tpot", "ttfb")

    def __init__(self, m: RouterMetrics, name: str, model: str) -> None:
        self.ttfb: Any = m.ttfb.labels(name, model)
        self.prompt_tokens: Any = m.prompt_tokens.labels(name, model)
        self.cached_tokens: Any = m.cached_tokens.labels(name, model)
        self.completed: Any = m.completed.labels(name, model)
        self.output_tokens: Any = m.output_tokens.labels(name, model)
        self.tpot: Any = m.tpot.labels(name, model)
