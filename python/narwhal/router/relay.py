"""Relay: one placed request's upstream call, streamed through or assembled.

A streamed answer on Granian is relayed by the connection's native read callback
(`UpstreamReader`, set up in `Relayer._push`): Python only sees first output, usage, the
end and faults. Before that (or on a server whose `send` must be awaited), and for an
assembled answer, each read crosses into Rust twice: HTTP de-framing (`upstream.py`), then
`StreamRelay.push` or `Assembler.feed`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass

import orjson

from narwhal import asgi
from narwhal._native import Assembler, AssemblyError, RelayChunk, StreamRelay
from narwhal.asgi import Send
from narwhal.errors import ApiError
from narwhal.router.engines import Engine
from narwhal.router.lease import Lease
from narwhal.router.pipeline.intake import upstream_body
from narwhal.router.upstream import Exchange, Upstream, UpstreamError

log = logging.getLogger("narwhal.relay")


class EngineFailed(Exception):
    """The engine could not be reached or broke before answering."""


@dataclass
class Refusal:
    """An engine's own non-200 answer, to pass on as it is."""

    status: int
    body: bytes
    content_type: bytes
    retry_after: str | None

    async def send(self, send: Send) -> None:
        headers = [("retry-after", self.retry_after)] if self.retry_after else []
        await asgi.send_bytes(send, self.status, self.body, self.content_type, headers)


class EngineFenced(Exception):
    """The engine refused the fencing token (409 `fenced`): another router leads now."""

    def __init__(self, engine: str, token: int | None) -> None:
        super().__init__(f"engine {engine} refused fencing token {token}")


class EngineBusy(Exception):
    """The engine answered 429 before anything was sent: another engine may take it."""

    def __init__(self, engine: str, refusal: Refusal) -> None:
        super().__init__(f"engine {engine} answered {refusal.status}")
        self.engine = engine
        self.refusal = refusal


def _error_event(message: str, code: str) -> bytes:
    return (
        b"data: "
        + orjson.dumps(
            {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        )
        + b"\n\n"
    )


# The status an engine would have answered with, by the OpenAI error type of the error
# event it streamed instead (the router always streams upstream, so a non-streaming
# client's refusal arrives in the stream, after a 200 the client never saw).
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "invalid_response_error": 422,
    "rate_limit_error": 429,
}


def _engine_refusal(chunk: bytes) -> tuple[int, bytes] | None:
    """(status, body) of the engine's error event in `chunk`, for a non-streaming client."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"error"' in line:
            try:
                err = orjson.loads(line[6:]).get("error")
            except orjson.JSONDecodeError:
                continue
            if isinstance(err, dict):
                return _normalised(err)
    return None


def _normalised(err: dict[str, object]) -> tuple[int, bytes]:
    """The engine's error object in the OpenAI envelope: `message`, `type`, `param` and
    `code` always there, `code` a string (engines send `"code": 500` or leave it out); the
    engine's own message kept."""
    kind = err.get("type")
    status = _STATUS_OF_TYPE.get(str(kind), 502)
    message = err.get("message")
    param = err.get("param")
    code = err.get("code")
    return status, ApiError(
        status,
        message if isinstance(message, str) and message else "the engine reported an error",
        type=kind if isinstance(kind, str) and kind else "server_error",
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) and code else "engine_error",
    ).body()


def _deadline_passed() -> ApiError:
    """Before any byte went to the client, a passed deadline is still an HTTP 504."""
    return ApiError(
        504,
        "the request deadline passed before the engine answered",
        type="timeout_error",
        code="deadline_exceeded",
    )


def _past(deadline: float) -> bool:
    # The loop's timers run on a millisecond clock that may fire a hair before
    # time.monotonic() (the deadlines' clock) reaches the deadline.
    return time.monotonic() >= deadline - 0.005


def _done_at_call(sent: Awaitable[None]) -> tuple[type | None, Awaitable[None] | None]:
    """(the type of `sent` if it did all its work in the call, what is left to await).

    Granian's ASGI `send` sends at once and returns an awaitable with nothing left to do;
    only then may later sends be made from Rust without awaiting them (the native relay),
    comparing each one's type with this one's. Told by what the awaitable does, not by its
    name: it finishes without yielding. A coroutine or future (other servers) always waits.
    """
    if inspect.iscoroutine(sent) or isinstance(sent, asyncio.Future):
        return None, sent
    it = sent.__await__()
    try:
        first = next(it)
    except StopIteration:
        return type(sent), None
    return None, _Resumed(it, first)


class _Resumed:
    """The rest of an awaitable whose first step was taken by `_done_at_call`."""

    __slots__ = ("first", "it")

    def __init__(self, it: Generator[object, object, object], first: object) -> None:
        self.it = it
        self.first = first

    def __await__(self) -> Generator[object, object, None]:
        value = self.first
        while True:
            try:
                got = yield value
            except BaseException as exc:  # a cancellation, say: the awaitable decides
                try:
                    value = self.it.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = self.it.send(got)
                except StopIteration:
                    return


class _Stream:
    """One streamed response's accounting, fed one socket read's body at a time."""

    __slots__ = ("complete", "ended", "engine_error", "lease", "prompt_ids", "push", "relay")

    def __init__(self, lease: Lease, relay: StreamRelay, complete: Callable[[], bool]) -> None:
        self.lease = lease
        self.relay = relay
        # The bytes to forward, or a RelayChunk when the read held more than output.
        self.push = relay.push
        self.prompt_ids: int | None = None
        self.complete = complete  # the engine's HTTP response ended well
        self.engine_error = False  # the engine sent an error event of its own
        self.ended = False  # the stream's end was seen (later reads change nothing)

    def broken(self) -> bytes:
        """The engine closed the stream without `[DONE]`: it broke mid-stream."""
        self.ended = True
        self.lease.fault("engine_disconnected", "stream ended early")
        return _error_event("the engine stream ended early", "engine_disconnected")

    def step(self, chunk: bytes) -> tuple[bytes, bytes | None, bool | None]:
        """(bytes to forward, the last bytes to send if the stream ends here, and then
        whether it ended well)."""
        if self.ended:
            return b"", None, None
        if not chunk:
            if self.engine_error and self.complete():
                # The engine said what went wrong and ended its answer cleanly: that was
                # this request's outcome (relayed once), not a fault of the engine.
                self.ended = True
                self.lease.fault("engine_error")
                return b"", b"", False
            return b"", self.broken(), False
        rep = self.push(chunk)
        if isinstance(rep, bytes):
            return rep, None, None
        return self.report(rep)

    def report(self, rep: RelayChunk) -> tuple[bytes, bytes | None, bool | None]:
        """`step` for a read that held more than output tokens."""
        if self.ended:
            return b"", None, None
        lease = self.lease
        self.engine_error |= rep.engine_error
        if rep.first_output:
            lease.first_output()
        # The prompt IDs the relay counted are exact; a usage frame (always last) only
        # fills in when the engine sent none.
        self.prompt_ids = rep.prompt_ids or self.prompt_ids
        lease.prompt_tokens = self.prompt_ids or rep.prompt_tokens or lease.prompt_tokens
        if rep.cached_tokens is not None:
            lease.cached_tokens = rep.cached_tokens
        if rep.fault_reason is not None:
            self.ended = True
            lease.fault(rep.fault_reason)
            return (
                rep.forward,
                _error_event(f"engine stream rejected: {rep.fault_message}", rep.fault_reason),
                False,
            )
        if rep.done:
            self.ended = True
            lease.finished(self.relay.counted)
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

    def __init__(
        self,
        send: Send,
        sent_type: type,
        held: Callable[[bool], None],
        failed: Callable[[BaseException], None],
    ) -> None:
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
                await self.send({"type": "http.response.body", "body": body, "more_body": more})
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
    """Runs a lease's upstream call and relays the answer; what it sees goes to the lease."""

    def __init__(
        self,
        idle_s: float = 120.0,
        native: bool = True,
        count_path: Callable[[str], None] | None = None,
    ) -> None:
        self.idle_s = idle_s  # an engine silent this long in the middle of an answer stalled
        self.native = native  # streams relayed from the read callback where `send` allows
        self.count_path = count_path or (lambda _: None)
        self.warned = False
        self.upstreams: dict[str, Upstream] = {}

    def upstream(self, e: Engine) -> Upstream:
        up = self.upstreams.get(e.url)
        if up is None:
            up = self.upstreams[e.url] = Upstream(e.url, api_key=e.api_key)
        return up

    def close(self) -> None:
        for up in self.upstreams.values():
            up.close()

    async def run(self, lease: Lease, send: Send) -> str:
        """Relay the lease's answer to `send`; how it ended: "completed", "stream_fault"
        (the stream ended with an error event) or "engine_error" (the engine's own non-200
        answer, passed through). Raises EngineBusy (a 429, nothing sent), EngineFailed or a
        504 before anything was sent."""
        e = lease.on
        body = upstream_body(lease.intake, e.spec.token_ids)
        lease.sent_at = time.monotonic()
        headers = "" if lease.fence is None else f"x-narwhal-fence: {lease.fence}\r\n"
        rec = asgi.current.get()
        if rec is not None:  # the ID is printable ASCII without spaces (asgi.begin)
            headers += f"x-request-id: {rec.id}\r\n"
        try:
            resp = await self.upstream(e).request(lease.intake.route, body, lease.deadline, headers)
        except asyncio.TimeoutError:
            raise _deadline_passed() from None
        except OSError as exc:
            lease.fault("connect", f"request failed: {exc}")
            raise EngineFailed(str(exc)) from exc
        done = False
        try:
            if resp.status != 200:
                # The engine's own refusal (a bad grammar, say) reaches the client as it is.
                try:
                    data = await resp.read_all()
                except UpstreamError:
                    data = b""  # the status is the engine's word; a cut body adds nothing
                done = True
                refusal = Refusal(
                    resp.status,
                    data,
                    (resp.content_type or "application/json").encode(),
                    resp.retry_after,
                )
                if resp.status == 429:
                    raise EngineBusy(e.name, refusal)
                if resp.status == 409 and b'"fenced"' in data:
                    raise EngineFenced(e.name, lease.fence)
                await refusal.send(send)
                return "engine_error"
            if lease.intake.passthrough:
                done = await self._passthrough(lease, resp, send)
                return "completed" if done else "stream_fault"
            if lease.intake.stream:
                done = await self._stream(lease, resp, send)
                return "completed" if done else "stream_fault"
            outcome = await self._assemble(lease, resp, send)
            done = outcome == "completed"
            return outcome
        finally:
            # Anything but a stream seen to its end (a fault, a timeout, a client that went
            # away) closes the connection: that is how the engine learns to stop.
            resp.release(done)

    async def _read(self, lease: Lease, resp: Exchange) -> bytes:
        """Next body bytes (b"" if the engine broke off), for as long as nothing has gone
        to the client: the deadline bounds the wait, and so does the idle gap."""
        loop = asyncio.get_running_loop()
        try:
            return await resp.read(min(lease.deadline, loop.time() + self.idle_s))
        except asyncio.TimeoutError:
            if not _past(lease.deadline):
                raise self._stalled(lease) from None
            raise _deadline_passed() from None
        except UpstreamError:
            return b""

    def _stalled(self, lease: Lease) -> EngineFailed:
        lease.fault("engine_stalled", f"sent nothing for {self.idle_s:g}s mid-answer")
        return EngineFailed(f"the engine sent nothing for {self.idle_s:g}s")

    def _timed_out(self, lease: Lease) -> bytes:
        """The error event that ends a stream that ran out of time (its deadline, or the
        engine's idle gap), reported."""
        if _past(lease.deadline):
            lease.fault("deadline_exceeded")
            return _error_event("the request deadline passed", "deadline_exceeded")
        self._stalled(lease)
        return _error_event(f"the engine sent nothing for {self.idle_s:g}s", "engine_stalled")

    async def _stream(self, lease: Lease, resp: Exchange, send: Send) -> bool:
        e = lease.on
        relay = StreamRelay(
            strip_token_ids=not lease.intake.wants_token_ids,
            require_token_ids=e.spec.token_ids,
            drop_usage=not lease.intake.include_usage,
        )
        st = _Stream(lease, relay, resp.complete)
        # Until the first bytes are out, a fault can still be an HTTP error and the deadline
        # applies: the stream is pulled read by read.
        sent_type: type | None = None  # what `send` returns when it sent at once
        while True:
            chunk = await self._read(lease, resp)
            if not chunk:
                st.broken()
                raise EngineFailed("stream ended before any output")
            forward, final, outcome = st.step(chunk)
            if forward or final is not None:
                sent_type, rest = _done_at_call(send(asgi.stream_head()))
                if rest is not None:
                    await rest
                if forward:
                    lease.first_byte()
                    await send({"type": "http.response.body", "body": forward, "more_body": True})
            if final is not None:
                await asgi.stream_chunk(send, final, more=False)
            if outcome is not None:
                return outcome
            if forward:
                break
        if self.native:
            if sent_type is not None:
                self.count_path("native")
                return await self._push(st, resp, send, sent_type)
            self._warn_not_native()
        self.count_path("awaited")
        read = resp.read  # bound once: this loop runs once per socket read (often a token)
        loop = asyncio.get_running_loop()
        while True:
            try:
                chunk = await read(min(lease.deadline, loop.time() + self.idle_s))
            except UpstreamError:
                chunk = b""
            except asyncio.TimeoutError:
                await asgi.stream_chunk(send, self._timed_out(lease), more=False)
                return False
            forward, final, outcome = st.step(chunk)
            if forward:
                await send({"type": "http.response.body", "body": forward, "more_body": True})
            if final is not None:
                await asgi.stream_chunk(send, final, more=False)
            if outcome is not None:
                return outcome

    async def _passthrough(self, lease: Lease, resp: Exchange, send: Send) -> bool:
        """An answer relayed as the engine sends it (the Responses API: its events are the
        engine's, neither validated nor assembled here). The deadline and the idle gap
        bound it as any other; whether it ended well is the engine's HTTP framing's word."""
        first = await self._read(lease, resp)
        if not first:
            lease.fault("engine_disconnected", "the answer ended before any byte")
            raise EngineFailed("the engine's answer ended before any byte")
        lease.first_output()
        ctype = (resp.content_type or "application/json").encode()
        await send(asgi.response_head(200, ctype))
        lease.first_byte()
        await send({"type": "http.response.body", "body": first, "more_body": True})
        loop = asyncio.get_running_loop()
        while True:
            try:
                chunk = await resp.read(min(lease.deadline, loop.time() + self.idle_s))
            except UpstreamError:
                chunk = b""
            except asyncio.TimeoutError:
                self._timed_out(lease)  # reported; the body just ends
                chunk = b""
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                continue
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if resp.complete():
                lease.finished(0)  # output tokens are counted only where the router parses
                return True
            if not _past(lease.deadline):
                lease.fault("engine_disconnected", "stream ended early")
            return False

    def _warn_not_native(self) -> None:
        if not self.warned:
            self.warned = True
            log.warning(
                "serving.native_relay is on, but this server's ASGI send must be "
                "awaited: streams are relayed from Python (slower; see "
                "narwhal_relayed_streams_total{path})"
            )

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
            if _past(st.lease.deadline) or (reads == seen and not out.holding):
                out.put(self._timed_out(st.lease), more=False)
                end(False)
                return
            timer[0] = loop.call_at(min(now + self.idle_s, st.lease.deadline), watch, reads)

        timer.append(
            loop.call_at(min(loop.time() + self.idle_s, st.lease.deadline), watch, resp.reads)
        )
        resp.push(on_body, relay)
        try:
            outcome = await ended
            await out.flushed()  # the stream's last bytes may still wait for the client
            return outcome
        finally:
            timer[0].cancel()
            resp.push(None)
            resp.hold(False)

    async def _assemble(self, lease: Lease, resp: Exchange, send: Send) -> str:
        e = lease.on
        asm = Assembler(
            lease.intake.kind,
            keep_token_ids=lease.intake.wants_token_ids,
            require_token_ids=e.spec.token_ids,
        )
        chunk = b""
        try:
            while not asm.done:
                chunk = await self._read(lease, resp)
                if not chunk:
                    lease.fault("engine_disconnected", "stream ended early")
                    raise EngineFailed("the engine stream ended before [DONE]")
                if asm.feed(chunk):
                    lease.first_output()
            body = asm.finish(lease.intake.estimated_prompt_tokens())
            # Only the engine's own count: the estimate must not be learned from itself.
            lease.prompt_tokens = asm.reported_prompt_tokens
            lease.cached_tokens = asm.reported_cached_tokens
        except AssemblyError as exc:
            refusal = _engine_refusal(chunk) if exc.field == "error" else None
            if refusal is not None:  # the engine's own error, in its stream: its answer
                lease.fault("engine_error")
                await asgi.send_bytes(send, *refusal)
                return "engine_error"
            lease.fault("assembly")
            raise ApiError(
                502,
                f"the engine's output cannot be assembled: {exc}",
                type="server_error",
                param=getattr(exc, "field", None),
                code="bad_engine_output",
            ) from None
        lease.first_byte()
        await asgi.send_bytes(send, 200, body)
        lease.finished(asm.measured_output_tokens)
        return "completed"
