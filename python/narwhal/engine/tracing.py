"""One generation request's trace through LexiEngine (`--otlp-endpoint`; narwhal.telemetry).

The request's span (kind server) continues the caller's trace (the router sends
`traceparent`), with a child per stage: `render` (the body read, the template rendered and
tokenized), `queue` (the wait for a slot), `prefill` (to the first token), `decode` (to the
last) and `verify_tool_call` (each call the output held, checked against the offered tools'
schemas). Made from the times the stages pass, when the request ends.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from narwhal.telemetry import Trace, Tracing

if TYPE_CHECKING:
    from narwhal.engine.generation import Finish, Request
    from narwhal.engine.protocol import Job
    from narwhal.engine.render import Check

log = logging.getLogger("lexi_engine.tracing")


class GenerationTrace(Trace):
    """What the stages record of one request for its spans (see the module)."""

    __slots__ = (
        "checks",
        "finish",
        "finished_at",
        "gen",
        "job",
        "rendered_at",
        "seated_at",
        "status",
    )

    def __init__(self, tracing: Tracing, parent: str | None, name: str, arrived: float) -> None:
        super().__init__(tracing, parent, name, arrived)
        self.rendered_at = 0.0  # the prompt's tokens are ready
        self.seated_at = 0.0  # a slot was had
        self.finished_at = 0.0  # the decode loop's last word (its Finish) came
        self.job: Job | None = None
        self.gen: Request | None = None
        self.finish: Finish | None = None
        self.checks: list[Check] = []
        self.status = 200  # what the client was answered (499: it went away first)

    def rendered(self, job: Job) -> None:
        self.rendered_at = time.monotonic()
        self.job = job

    def ended(self, status: int, now: float) -> None:
        """The request ended at `now` with `status`: its spans go to the exporter (a span
        that cannot be made is logged, never the request's fault)."""
        if not self.recording:
            return
        try:
            self._ended(status, now)
        except Exception:
            log.warning("a request's spans could not be made", exc_info=True)

    def _ended(self, status: int, now: float) -> None:
        t, root = self.tracing, self.root
        t.child(root, "render", self.arrived, self.rendered_at or now)
        if self.rendered_at and self.seated_at:
            t.child(root, "queue", self.rendered_at, self.seated_at)
        gen, finish = self.gen, self.finish
        if gen is not None and gen.first_token_at is not None:
            t.child(
                root,
                "prefill",
                gen.started_at,
                gen.first_token_at,
                {"narwhal.tokens.cached": gen.cached_tokens},
            )
            t.child(root, "decode", gen.first_token_at, self.finished_at or now)
        for c in self.checks:
            span = t.open(root, "verify_tool_call", c.began)
            if c.call is None:
                t.failed(span, "not a valid call of the offered tools")
            t.close(span, c.ended, {"gen_ai.tool.name": c.call.name if c.call else None})
        job = self.job
        attrs: dict[str, Any] = {
            "http.response.status_code": status,
            "gen_ai.request.model": job.body.get("model") if job is not None else None,
            "gen_ai.usage.input_tokens": len(job.prompt_ids) if job is not None else None,
            "gen_ai.usage.output_tokens": finish.completion_tokens if finish else None,
            "gen_ai.response.finish_reasons": [finish.reason] if finish else None,
            "narwhal.tokens.cached": finish.cached_tokens if finish else None,
        }
        if status >= 400:
            t.failed(root, f"answered {status}")
        t.close(root, now, attrs)
