"""The first stage: the body read within its limits and handed to `intake.check`, with the
request's TTFT budget (`x-narwhal-ttft-target-ms`) and deadline (`x-narwhal-timeout-ms`)."""

from __future__ import annotations

from collections.abc import Callable

from narwhal import asgi
from narwhal.asgi import Receive, Scope
from narwhal.errors import ApiError
from narwhal.router.config import RouterConfig
from narwhal.router.endings import End
from narwhal.router.metrics import RouterMetrics
from narwhal.router.pipeline import intake
from narwhal.router.request import Request

_MAX_MS = 10**9  # 11.6 days: more than any timeout, and a float without overflow


async def read(
    path: str,
    scope: Scope,
    receive: Receive,
    config: RouterConfig,
    metrics: RouterMetrics,
    arrived: float,
    models: str | Callable[[str | None], str] | None = None,
) -> tuple[Request, float, float]:
    """The checked request, its deadline (monotonic) and its TTFT budget (seconds)."""
    try:
        raw = await asgi.read_body(receive, config.max_request_bytes, config.body_timeout_s)
    except asgi.BodyTooLarge:
        raise ApiError(
            413,
            f"request body exceeds {config.max_request_bytes} bytes",
            code="request_too_large",
        ).ended(End.INVALID) from None
    except asgi.ClientGone:
        metrics.unsized_offered.inc()  # and ends `client_gone`
        raise
    except ApiError as e:  # a body that could not be read, or not in time
        e.ended(End.INVALID)
        raise
    try:
        ms = ms_header(scope, b"x-narwhal-timeout-ms")
        timeout = config.request_timeout_s
        deadline = arrived + (timeout if ms is None else min(timeout, ms / 1000))
        ms = ms_header(scope, b"x-narwhal-ttft-target-ms")
        budget = config.ttft_budget_s if ms is None else ms / 1000
        session = asgi.header(scope, b"x-session-id")
        req = intake.check(
            path,
            raw,
            config.model if models is None else models,
            session[:256] if session else None,
        )
    except ApiError as e:
        e.ended(End.INVALID)
        raise
    return req, deadline, budget


def ms_header(scope: Scope, name: bytes) -> int | None:
    """A positive integer of milliseconds from a request header, or a 400."""
    raw = asgi.header(scope, name)
    if raw is None:
        return None
    try:
        ms = int(raw) if len(raw) <= 18 else (1 << 62 if raw.isdigit() else 0)
    except ValueError:
        ms = 0
    if ms <= 0:
        raise ApiError(
            400, f"{name.decode()} must be a positive integer of milliseconds", param=name.decode()
        )
    return min(ms, _MAX_MS)
