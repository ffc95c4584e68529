"""Relay: one placed request's upstream call, streamed through or assembled.

A streamed answer on Granian is relayed by the connection's native read callback
(`UpstreamReader`, set up in `Relayer._push`): Python only sees first output, usage, the
end and faults. Before that (or on a server whose `send` must be awaited), and for an
assembled answer, each read crosses into Rust twice: HTTP de-framing (`upstream.py`), then
`StreamRelay.push` or `Assembler.feed`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from narwhal import asgi
from narwhal._native import Assembler, AssemblyError, RelayChunk, StreamRelay
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


# The status an engine would have answered with, by the OpenAI error type of the error
# event it streamed instead (the router always streams upstream, so a non-streaming
# client's refusal arrives in the stream, after a 200 the client never saw).
_STATUS_OF_TYPE = {"invalid_request_error": 400, "authentication_error": 401,
                   "permission_error": 403, "not_found_error": 404,
                   "invalid_response_error": 422, "rate_limit_error": 429}


def _engine_refusal(chunk: bytes) -> tuple[int, bytes] | None:
    """(status, body) of the engine's error event in `chunk`, for a non-streaming client."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"error"' in line:
            try:
                err = orjson.loads(line[6:]).get("error")
            except orjson.JSONDecodeError:
                continue
            if isinstance(err, dict):
                status = _STATUS_OF_TYPE.get(str(err.get("type")), 502)
                return status, orjson.dumps({"error": err})
    return None


def _past(deadline: float) -> bool:
    # The loop's timers run on a millisecond clock that may fire a hair before
    # time.monotonic() (the deadlines' clock) reaches the deadline.
    return time.monotonic() >= deadline - 0.005


def _completes_at_call(sent: object) -> bool:
    # Granian's ASGI `send` does its work in the call and returns an empty awaitable; a
    # coroutine or future (other servers) must be awaited for the message to go out.
    return type(sent).__name__ == "PyEmptyAwaitable"


class _Stream:
    """One streamed response's accounting, fed one socket read's body at a time."""

    __slots__ = ("complete", "engine_error", "first_at", "p", "prompt_ids", "push", "relay",
                 "relayer")

    def __init__(self, relayer: Relayer, p: Placed, relay: StreamRelay,
                 complete: Callable[[], bool]) -> None:
        self.relayer = relayer
        self.p = p
        self.relay = relay
        # The bytes to forward, or a RelayChunk when the read held more than output.
        self.push = relay.push
        self.first_at = 0.0
        self.prompt_ids: int | None = None
        self.complete = complete  # the engine's HTTP response ended well
        self.engine_error = False  # the engine sent an error event of its own

    def broken(self) -> bytes:
        """The engine closed the stream without `[DONE]`: it broke mid-stream."""
        e = self.p.engine
        self.relayer.metrics.stream_faults.labels(e.name, "engine_disconnected").inc()
        self.relayer.pool.mark_failed(e, "stream ended early")
        return _error_event("the engine stream ended early", "engine_disconnected")

    def step(self, chunk: bytes) -> tuple[bytes, bytes | None, bool | None]:
        """(bytes to forward, the last bytes to send if the stream ends here, and then
        whether it ended well)."""
        if not chunk:
            if self.engine_error and self.complete():
                # The engine said what went wrong and ended its answer cleanly: that was
                # this request's outcome (relayed once), not a fault of the engine.
                e = self.p.engine
                self.relayer.metrics.stream_faults.labels(e.name, "engine_error").inc()
                return b"", b"", False
            return b"", self.broken(), False
        rep = self.push(chunk)
        if isinstance(rep, bytes):
            return rep, None, None
        return self.report(rep)

    def report(self, rep: RelayChunk) -> tuple[bytes, bytes | None, bool | None]:
        """`step` for a read that held more than output tokens."""
        p = self.p
        self.engine_error |= rep.engine_error
        if rep.first_output:
            self.relayer._first_output(p)
            self.first_at = time.monotonic()
        # The prompt IDs the relay counted are exact; a usage frame (always last) only
        # fills in when the engine sent none.
        self.prompt_ids = rep.prompt_ids or self.prompt_ids
        p.prompt_tokens = self.prompt_ids or rep.prompt_tokens or p.prompt_tokens
        if rep.cached_tokens is not None:
            p.cached_tokens = rep.cached_tokens
        if rep.fault_reason is not None:
            r = self.relayer
            r.metrics.stream_faults.labels(p.engine.name, rep.fault_reason).inc()
            if r.predictor is not None:  # its timing cannot be trusted
                r.predictor.profiles[p.engine.name].discarded += 1
            return rep.forward, _error_event(f"engine stream rejected: {rep.fault_message}",
                                             rep.fault_reason), False
        if rep.done:
            p.output_tokens = tokens = self.relay.counted
            self.relayer._done(p, tokens, self.first_at)
            return rep.forward, b"", True
        return rep.forward, None, None


class _Outbox:
    """A pushed stream's sends to Granian, kept in order.

    Granian's `send` puts a body on a small channel to the client's connection; when the
    channel is full it returns an awaitable that sends later instead of sending now, and a
    send after it can overtake it (tokens reordered, `[DONE]` before the last frame). A
    send that did not go at once is awaited before anything after it goes out, and the
    engine's socket is not read meanwhile (`held`), so a slow client slows the engine
    instead of filling the router's memory.
    """

    __slots__ = ("failed", "held", "queue", "send", "sent_type", "task")

    def __init__(self, send: Send, sent_type: type, held: Callable[[bool], None],
                 failed: Callable[[BaseException], None]) -> None:
        self.send = send
        self.sent_type = sent_type
        self.held = held
        self.failed = failed
        self.queue: deque[tuple[bytes, bool]] | None = None  # set while a send waits
        self.task: asyncio.Task[None] | None = None

    @property
    def holding(self) -> bool:
        """A send is waiting for the client (the engine's socket is not being read)."""
        return self.queue is not None

    def put(self, body: bytes, more: bool) -> None:
        if self.queue is not None:
            self.queue.append((body, more))
            return
        sent = self.send({"type": "http.response.body", "body": body, "more_body": more})
        if type(sent) is not self.sent_type:
            self.waiting(sent)

    def waiting(self, sent: Awaitable[None]) -> None:
        """`sent` has not gone out yet: everything after it waits for it."""
        self.queue = deque()
        self.held(True)
        self.task = asyncio.ensure_future(self._drain(sent))

    async def _drain(self, sent: Awaitable[None]) -> None:
        try:
            await sent
            while self.queue:
                body, more = self.queue.popleft()
                await self.send({"type": "http.response.body", "body": body,
                                 "more_body": more})
        except Exception as exc:  # the client went away
            self.failed(exc)
            return
        finally:
            self.queue = None
        self.held(False)

    async def flushed(self) -> None:
        while self.task is not None and not self.task.done():
            await asyncio.shield(self.task)


class Relayer:
    def __init__(self, pool: Pool, admission: Admission, metrics: RouterMetrics,
                 predictor: Predictor | None, idle_s: float = 120.0) -> None:
        self.idle_s = idle_s  # an engine silent this long in the middle of an answer stalled
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

    async def run(self, p: Placed, send: Send) -> str:
        """Relay `p`'s answer to `send`; how it ended: "completed", "stream_fault" (the
        stream ended with an error event) or "engine_error" (the engine's own non-200
        answer, passed through). Raises EngineFailed or a 504 before anything was sent."""
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
                try:
                    data = await resp.read_all()
                except UpstreamError:
                    data = b""  # the status is the engine's word; a cut body adds nothing
                ctype = (resp.content_type or "application/json").encode()
                done = True
                if resp.status == 429:  # the engine's capacity refusal is a rejection too
                    self.metrics.rejected.labels("engine_busy").inc()
                headers = [("retry-after", resp.retry_after)] if resp.retry_after else []
                await asgi.send_bytes(send, resp.status, data, ctype, headers)
                return "engine_error"
            if p.intake.stream:
                done = await self._stream(p, resp, send)
                return "completed" if done else "stream_fault"
            outcome = await self._assemble(p, resp, send)
            done = outcome == "completed"
            return outcome
        finally:
            # Anything but a stream seen to its end (a fault, a timeout, a client that went
            # away) closes the connection: that is how the engine learns to stop.
            resp.release(done)

    async def _read(self, p: Placed, resp: Exchange) -> bytes:
        """Next body bytes (b"" if the engine broke off), for as long as nothing has gone
        to the client: the deadline bounds the wait, and so does the idle gap."""
        loop = asyncio.get_running_loop()
        try:
            return await resp.read(min(p.deadline, loop.time() + self.idle_s))
        except asyncio.TimeoutError:
            if not _past(p.deadline):
                raise self._stalled(p) from None
            raise ApiError(504, "the request deadline passed before the engine answered",
                           type="timeout_error", code="deadline_exceeded") from None
        except UpstreamError:
            return b""

    def _stalled(self, p: Placed) -> EngineFailed:
        e = p.engine
        self.metrics.stream_faults.labels(e.name, "engine_stalled").inc()
        self.pool.mark_failed(e, f"sent nothing for {self.idle_s:g}s mid-answer")
        return EngineFailed(f"the engine sent nothing for {self.idle_s:g}s")

    def _timed_out(self, p: Placed) -> bytes:
        """The error event that ends a stream that ran out of time (its deadline, or the
        engine's idle gap), counted."""
        if _past(p.deadline):
            self.metrics.stream_faults.labels(p.engine.name, "deadline_exceeded").inc()
            return _error_event("the request deadline passed", "deadline_exceeded")
        self._stalled(p)
        return _error_event(f"the engine sent nothing for {self.idle_s:g}s", "engine_stalled")

    async def _stream(self, p: Placed, resp: Exchange, send: Send) -> bool:
        e = p.engine
        relay = StreamRelay(strip_token_ids=not p.intake.wants_token_ids,
                            require_token_ids=e.spec.token_ids,
                            drop_usage=not p.intake.include_usage)
        st = _Stream(self, p, relay, resp.complete)
        # Until the first bytes are out, a fault can still be an HTTP error and the deadline
        # applies: the stream is pulled read by read.
        sent_type: type | None = None  # what `send` returns when it sent at once
        while True:
            chunk = await self._read(p, resp)
            if not chunk:
                st.broken()
                raise EngineFailed("stream ended before any output")
            forward, final, outcome = st.step(chunk)
            if forward or final is not None:
                await asgi.start_stream(send)
                if forward:
                    self.metrics.engine(e.name).ttfb.observe(time.monotonic() - p.arrived)
                    sent = send({"type": "http.response.body", "body": forward,
                                 "more_body": True})
                    sent_type = type(sent) if _completes_at_call(sent) else None
                    await sent
            if final is not None:
                await asgi.stream_chunk(send, final, more=False)
            if outcome is not None:
                return outcome
            if forward:
                break
        if sent_type is not None:
            return await self._push(st, resp, send, sent_type)
        read = resp.read  # bound once: this loop runs once per socket read (often a token)
        loop = asyncio.get_running_loop()
        while True:
            try:
                chunk = await read(min(p.deadline, loop.time() + self.idle_s))
            except UpstreamError:
                chunk = b""
            except asyncio.TimeoutError:
                await asgi.stream_chunk(send, self._timed_out(p), more=False)
                return False
            forward, final, outcome = st.step(chunk)
            if forward:
                await send({"type": "http.response.body", "body": forward, "more_body": True})
            if final is not None:
                await asgi.stream_chunk(send, final, more=False)
            if outcome is not None:
                return outcome

    async def _push(self, st: _Stream, resp: Exchange, send: Send, sent_type: type) -> bool:
        """Relay the rest of the stream from the connection's read callback.

        Only for a server whose `send` finishes its work when called (Granian's does): a
        read that holds only output goes from the socket through the relay to `send` in
        Rust (`UpstreamReader`); this coroutine only waits for the end, and the callbacks
        below see the rest (first output, usage, the end, faults, a send that waits).
        """
        ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def end(outcome: bool | BaseException) -> None:
            if ended.done():
                return
            if isinstance(outcome, BaseException):  # the client went away, say
                ended.set_exception(outcome)  # the coroutine decides
            else:
                ended.set_result(outcome)
            resp.push(None)  # nothing more goes to the client

        def on_body(chunk: bytes) -> None:
            deliver(lambda: st.step(chunk))

        relay = (st.relay, send, lambda rep: on_report(rep), sent_type)

        def held(waiting: bool) -> None:
            resp.hold(waiting)
            if waiting:
                resp.relay_natively(None)  # a native send would overtake the waiting one
            elif not ended.done():
                resp.relay_natively(relay)

        out = _Outbox(send, sent_type, held, end)

        def deliver(step: Callable[[], tuple[bytes, bytes | None, bool | None]]) -> None:
            if ended.done():
                return
            try:
                forward, final, outcome = step()
                if final is not None:  # the last bytes go out with the stream's end: one send
                    out.put(forward + final, more=False)
                elif forward:
                    out.put(forward, more=True)
            except Exception as exc:
                end(exc)
                return
            if outcome is not None:
                end(outcome)

        def on_report(rep: RelayChunk | BaseException | Awaitable[None]) -> None:
            if isinstance(rep, RelayChunk):
                deliver(lambda: st.report(rep))
            elif isinstance(rep, BaseException):  # raised by `send`
                end(rep)
            else:  # a send Granian could not do at once (its channel to the client is full)
                out.waiting(rep)

        loop = asyncio.get_running_loop()
        timer: list[asyncio.TimerHandle] = []

        def watch(seen: int) -> None:
            """Every idle gap (or at the deadline): a stream with no read since the last
            look, or past its deadline, ends with an error event."""
            if ended.done():
                return
            now, reads = loop.time(), resp.reads
            # While a send waits for the client, the engine is not read: no reads then is
            # the client's pace, not a stalled engine.
            if _past(st.p.deadline) or (reads == seen and not out.holding):
                out.put(self._timed_out(st.p), more=False)
                end(False)
                return
            timer[0] = loop.call_at(min(now + self.idle_s, st.p.deadline), watch, reads)

        timer.append(loop.call_at(min(loop.time() + self.idle_s, st.p.deadline), watch,
                                  resp.reads))
        resp.push(on_body, relay)
        try:
            outcome = await ended
            await out.flushed()  # the stream's last bytes may still wait for the client
            return outcome
        finally:
            timer[0].cancel()
            resp.push(None)
            resp.hold(False)

    def _done(self, p: Placed, tokens: int, first_at: float) -> None:
        m, name = self.metrics.engine(p.engine.name), p.engine.name
        if self.predictor is not None:
            ttft = p.first_at - p.sent_at if p.first_at else None
            if ttft is not None and p.predicted_s is not None:
                self.metrics.predicted_ttft.labels(name).observe(p.predicted_s)
                self.metrics.observed_ttft.labels(name).observe(ttft)
            self.predictor.profiles[name].observe(
                p.intake.prompt_bytes, p.prompt_tokens, ttft, p.alone, tokens,
                time.monotonic() - first_at if first_at else 0.0, p.predicted_s,
                cached_tokens=p.cached_tokens or 0)
        self.pool.succeeded(p.engine)
        m.completed.inc()
        m.output_tokens.inc(tokens)
        if tokens > 1 and first_at:
            m.tpot.observe((time.monotonic() - first_at) / (tokens - 1))

    async def _assemble(self, p: Placed, resp: Exchange, send: Send) -> str:
        e = p.engine
        asm = Assembler(p.intake.kind, keep_token_ids=p.intake.wants_token_ids,
                        require_token_ids=e.spec.token_ids)
        first_at = 0.0
        chunk = b""
        try:
            while not asm.done:
                chunk = await self._read(p, resp)
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
            refusal = _engine_refusal(chunk) if exc.field == "error" else None
            if refusal is not None:  # the engine's own error, in its stream: its answer
                self.metrics.stream_faults.labels(e.name, "engine_error").inc()
                await asgi.send_bytes(send, *refusal)
                return "engine_error"
            self.metrics.stream_faults.labels(e.name, "assembly").inc()
            raise ApiError(502, f"the engine's output cannot be assembled: {exc}",
                           type="server_error", param=getattr(exc, "field", None),
                           code="bad_engine_output") from None
        self.metrics.engine(e.name).ttfb.observe(time.monotonic() - p.arrived)
        await asgi.send_bytes(send, 200, body)
        self._done(p, asm.measured_output_tokens, first_at)
        return "completed"
