"""LexiEngine's Prometheus series (`/metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# No `*_created` series: they double a scrape and nobody reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]


class Metrics:
    def __init__(self, slots: int) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "lexi_requests", "Requests by route and status", ["route", "status"], registry=r
        )
        self.prompt_tokens = Counter("lexi_prompt_tokens", "Prompt tokens processed", registry=r)
        self.output_tokens = Counter("lexi_output_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("lexi_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("lexi_slots_busy", "Slots generating", registry=r)
        self.slots_total = Gauge("lexi_slots_total", "Slots", registry=r)
        self.slots_total.set(slots)
        self.ttft = Histogram(
            "lexi_time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.tpot = Histogram(
            "lexi_time_per_output_token_seconds",
            "Time per output token",
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.batch = Histogram(
            "lexi_batch_tokens",
            "Tokens in one decode step's batch",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.cached_tokens = Counter(
            "lexi_cached_prompt_tokens", "Prompt tokens reused from a slot's KV", registry=r
        )
        self.fenced = Counter(
            "lexi_fenced_requests",
            "Requests refused for a missing or old fencing token",
            registry=r,
        )
        self.fencing_token = Gauge(
            "lexi_fencing_token",
            "The highest router fencing token accepted (--fence)",
            registry=r,
        )
        self.silent_closed = Counter(
            "lexi_silent_connections_closed",
            "Client connections closed for sending nothing within --header-timeout",
            registry=r,
        )
        self.background_errors = Counter(
            "lexi_background_errors",
            "Failures of a background loop (each logged with its stack and started again)",
            ["task"],
            registry=r,
        )
