"""What a request's trace costs the router's event loop, per request, measured in process:
`RequestTrace` as the flow and the relayer use it (begun, the call's traceparent, ended),
for a request the sampler leaves out and for one it records (every span made and handed
to the SDK's batch processor; the export runs on its own thread and is not counted).

    OTEL_BSP_MAX_QUEUE_SIZE=200000 .venv/bin/python -m bench.trace_cost [--requests 20000]

With `sample_ratio` r a request costs about (1 - r) x unsampled + r x sampled; divided by
a request's tokens it is comparable with the router's CPU per token (bench.router_e2e).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

from narwhal.router.endings import End, Ending
from narwhal.router.tracing import RequestTrace
from narwhal.telemetry import Settings, Tracing
from tests.otlp_receiver import Receiver


def lease(now: float) -> Any:
    m = SimpleNamespace(
        sent_at=now,
        first_at=now + 0.05,
        decode_s=0.5,
        first_byte_at=now + 0.05,
        cached_tokens=100,
        prompt_tokens=500,
        output_tokens=64,
    )
    return SimpleNamespace(measured=m, on=SimpleNamespace(name="e0"), predicted_s=0.06, arrived=now)


def per_request_us(tracing: Tracing, n: int) -> float:
    fields = {"engine": "e0", "ttfb_ms": 50.0, "projected_ms": 60.0, "tokens_in": 500}
    end = Ending()
    end.end = End.COMPLETED
    started = time.process_time()
    for _ in range(n):
        now = time.monotonic()
        t = RequestTrace(tracing, None, "POST /v1/chat/completions", now)
        t.read_at = t.judged_at = t.placed_at = now
        t.call(lease(now))
        t.finish(end, None, fields, now + 0.6)
    tracing.shutdown()  # what is still queued is exported, and counted
    return (time.process_time() - started) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    a = ap.parse_args()
    receiver = Receiver()
    try:
        out = {}
        for ratio in (0.0, 1.0):
            per_request_us(Tracing(Settings(receiver.url, "bench", ratio), "bench"), 1000)
            tracing = Tracing(Settings(receiver.url, "bench", ratio), "bench")
            out[ratio] = per_request_us(tracing, a.requests)
    finally:
        receiver.close()
    at = 0.99 * out[0.0] + 0.01 * out[1.0]
    print("| per request | µs (this process's CPU) |")
    print("|---|---|")
    print(f"| left out by the sampler | {out[0.0]:.1f} |")
    print(f"| recorded (5 spans, 2 events, exported) | {out[1.0]:.1f} |")
    print(f"| at sample_ratio 0.01 | {at:.1f} ({at / 64:.2f} µs a token at 64 tokens) |")


if __name__ == "__main__":
    main()
