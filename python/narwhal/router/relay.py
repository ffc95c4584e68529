"""Relay: one placed request's upstream call, streamed through or assembled.

Each socket read from the engine crosses into Rust twice: HTTP de-framing
(`upstream.py`) and then `StreamRelay.feed` or `Assembler.feed`; Python only moves the
resulting bytes and updates counters.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson

from narwhal import asgi
from narwhal._native import Assembler, AssemblyError, StreamRelay
from narwhal.asgi import Send
from narwhal.errors import ApiError
from narwhal.router.admission import Admission
from narwhal.router.engines import Engine, Pool
from narwhal.router.intake import Intake, upstream_body
from narwhal.router.metrics import RouterMetrics
from narwhal.router.predict import Predictor
from narwhal.router.upstream import Exchange, Upstream, UpstreamError


class EngineFailed(Exception):
    """The engine could not be reached or broke before answering."""


@dataclass
class Placed:
    intake: Intake
    engine: Engine
    arrived: float
    deadline: float
    tokens: int = 0  # sized prompt tokens, counted in engine.prefill_tokens while in prefill
    alone: bool = False  # the engine's prefill was ours alone at placement
    sent_at: float = 0.0
    first_at: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of those, what the engine's prefix cache served
    output_tokens: int = 0
    predicted_s: float | None = None  # projected TTFT at admission, for drift scoring
    phase: str = "prefill"


def _error_event(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error",
                                                "param": None, "code": code}}) + b"\n\n"


class Relayer:
    def __init__(self, pool: Pool, admission: Admission, metrics: RouterMetrics,
                 predictor: Predictor | None) -> None:
        self.upstreams: dict[str, Upstream] = {}
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.predictor = predictor

    def placed(self, p: Placed) -> None:
        p.alone = p.engine.prefill == 1
        p.engine.prefill_tokens += p.tokens

    def _first_output(self, p: Placed) -> None:
        if p.phase == "prefill":
            p.phase = "decode"
            p.first_at = time.monotonic()
            p.engine.prefill_tokens -= p.tokens
            self.admission.to_decode(p.engine)

    def release(self, p: Placed) -> None:
        if p.phase == "prefill":
            p.engine.prefill_tokens -= p.tokens
            self.admission.leave_prefill(p.engine)
        elif p.phase == "decode":
            self.admission.leave_decode(p.engine)
        p.phase = "done"

    def upstream(self, e: Engine) -> Upstream:
        up = self.upstreams.get(e.url)
        if up is None:
            up = self.upstreams[e.url] = Upstream(e.url)
        return up

    def close(self) -> None:
        for up in self.upstreams.values():
            up.close()

    async def run(self, p: Placed, send: Send) -> None:
        e = p.engine
        body = upstream_body(p.intake, e.spec.token_ids)
        p.sent_at = time.monotonic()
        try:
            resp = await self.upstream(e).request(p.intake.route, body, p.deadline)
        except asyncio.TimeoutError:
            raise ApiError(504, "the request deadline passed before the engine answered",
                           type="timeout_error", code="deadline_exceeded") from None
        except OSError as exc:
            self.pool.mark_failed(e, f"request failed: {exc}")
            raise EngineFailed(str(exc)) from exc
        done = False
        try:
            if resp.status != 200:
                # The engine's own refusal (a bad grammar, say) reaches the client as it is.
                data = await self._read(p, resp, False, all=True)
                ctype = (resp.content_type or "application/json").encode()
                done = True
                await asgi.send_bytes(send, resp.status, data, ctype)
                return
            if p.intake.stream:
                done = await self._stream(p, resp, send)
            else:
                done = await self._assemble(p, resp, send)
        finally:
            # Anything but a stream seen to its end (a fault, a timeout, a client that went
            # away) closes the connection: that is how the engine learns to stop.
            resp.release(done)

    async def _read(self, p: Placed, resp: Exchange, started: bool, all: bool = False) -> bytes:
        """Next body bytes (b"" if the engine broke off); before headers are out, the
        deadline bounds the wait."""
        try:
            if all:
                return await resp.read_all()
            return await resp.read(None if started else p.deadline)
        except asyncio.TimeoutError:
            raise ApiError(504, "the request deadline passed before the first token",
                           type="timeout_error", code="deadline_exceeded") from None
        except UpstreamError:
            return b""

    async def _stream(self, p: Placed, resp: Exchange, send: Send) -> bool:
        e, m = p.engine, self.metrics
        relay = StreamRelay(strip_token_ids=not p.intake.wants_token_ids,
                            require_token_ids=e.spec.token_ids,
                            drop_usage=not p.intake.include_usage)
        started = False
        tokens = 0
        first_at = 0.0
        prompt_ids: int | None = None
        # Bound once: this loop runs once per socket read (often one token).
        read = resp.read
        feed = relay.feed
        while True:
            try:
                chunk = await (read() if started else self._read(p, resp, started))
            except UpstreamError:
                chunk = b""
            if not chunk:
                # The engine closed the stream without `[DONE]`: it broke mid-stream.
                m.stream_faults.labels(e.name, "engine_disconnected").inc()
                self.pool.mark_failed(e, "stream ended early")
                if not started:
                    raise EngineFailed("stream ended before any output")
                await asgi.stream_chunk(send, _error_event("the engine stream ended early",
                                                           "engine_disconnected"), more=False)
                return False
            rep = feed(chunk)
            if rep.first_output:
                self._first_output(p)
                first_at = time.monotonic()
            tokens += rep.output_tokens or rep.generation_events
            forward = rep.forward
            # The prompt IDs the relay counted are exact; a usage frame (always last) only
            # fills in when the engine sent none.
            prompt_ids = rep.prompt_ids or prompt_ids
            p.prompt_tokens = prompt_ids or rep.prompt_tokens or p.prompt_tokens
            if rep.cached_tokens is not None:
                p.cached_tokens = rep.cached_tokens
            if forward:
                if not started:
                    await asgi.start_stream(send)
                    started = True
                    m.ttfb.labels(e.name).observe(time.monotonic() - p.arrived)
                await send({"type": "http.response.body", "body": forward, "more_body": True})
            if rep.fault_reason is not None:
                m.stream_faults.labels(e.name, rep.fault_reason).inc()
                if self.predictor is not None:  # its timing cannot be trusted
                    self.predictor.profiles[e.name].discarded += 1
                if not started:
                    await asgi.start_stream(send)
                await asgi.stream_chunk(send, _error_event(
                    f"engine stream rejected: {rep.fault_message}", rep.fault_reason),
                    more=False)
                return False
            if rep.done:
                await asgi.stream_chunk(send, b"", more=False)
                p.output_tokens = tokens
                self._done(p, tokens, first_at)
                return True

    def _done(self, p: Placed, tokens: int, first_at: float) -> None:
        m, name = self.metrics, p.engine.name
        if self.predictor is not None:
            ttft = p.first_at - p.sent_at if p.first_at else None
            if ttft is not None and p.predicted_s is not None:
                m.predicted_ttft.labels(name).observe(p.predicted_s)
                m.observed_ttft.labels(name).observe(ttft)
            self.predictor.profiles[name].observe(
                p.intake.prompt_bytes, p.prompt_tokens, ttft, p.alone, tokens,
                time.monotonic() - first_at if first_at else 0.0, p.predicted_s,
                cached_tokens=p.cached_tokens or 0)
        m.completed.labels(name).inc()
        m.output_tokens.labels(name).inc(tokens)
        if tokens > 1 and first_at:
            m.tpot.labels(name).observe((time.monotonic() - first_at) / (tokens - 1))

    async def _assemble(self, p: Placed, resp: Exchange, send: Send) -> bool:
        e = p.engine
        asm = Assembler(p.intake.kind, keep_token_ids=p.intake.wants_token_ids,
                        require_token_ids=e.spec.token_ids)
        first_at = 0.0
        try:
            while not asm.done:
                chunk = await self._read(p, resp, False)
                if not chunk:
                    self.metrics.stream_faults.labels(e.name, "engine_disconnected").inc()
                    self.pool.mark_failed(e, "stream ended early")
                    raise EngineFailed("the engine stream ended before [DONE]")
                if asm.feed(chunk):
                    self._first_output(p)
                    first_at = time.monotonic()
            body = asm.finish(p.intake.estimated_prompt_tokens())
            # Only the engine's own count: the estimate must not be learned from itself.
            p.prompt_tokens = asm.reported_prompt_tokens
            p.cached_tokens = asm.reported_cached_tokens
        except AssemblyError as exc:
            self.metrics.stream_faults.labels(e.name, "assembly").inc()
            raise ApiError(502, f"the engine's output cannot be assembled: {exc}",
                           type="server_error", param=getattr(exc, "field", None),
                           code="bad_engine_output") from None
        self.metrics.ttfb.labels(e.name).observe(time.monotonic() - p.arrived)
        await asgi.send_bytes(send, 200, body)
        self._done(p, asm.measured_output_tokens, first_at)
        return True
