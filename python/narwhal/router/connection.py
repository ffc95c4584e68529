"""One keep-alive connection to an engine, and the exchange (one request's response) it
carries.

Each socket read is de-framed by the native `ResponseDecoder` in one call, and the relay
wakes once per read, not once per chunk. While a stream is relayed, a read that holds only
output goes from the socket to the client without a Python frame (`UpstreamReader`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, cast

from narwhal._native import HttpError, ResponseDecoder, UpstreamReader

if TYPE_CHECKING:
    from narwhal._native import RelayChunk, StreamRelay
    from narwhal.asgi import Send

# One socket read's buffer, per connection.
_READ_BYTES = 64 * 1024
# Body bytes buffered for a slow reader before the socket stops being read.
_HIGH_WATER = 1 << 20
# After the relay saw the stream's end, how long the rest of the response may take before
# the connection is closed instead of being reused.
_DRAIN_S = 5.0


class UpstreamError(ConnectionError):
    """The engine could not be reached, broke the connection, or answered malformed HTTP."""


class Owner(Protocol):
    """Where a connection goes back to (`upstream.Upstream`): declared here, so the
    connection sits below the pool that holds it."""

    def idle(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One keep-alive connection; carries one exchange at a time.

    A buffered protocol: the socket reads into a buffer the connection owns. A plain
    `Protocol` gets a fresh `bytes` per read, which asyncio allocates at 256 KiB and then
    shrinks: an mmap, page faults and an mremap per read, more than the rest of the read.
    The buffer and the read callback are the native `UpstreamReader`'s; it hands what it
    does not relay itself to `_read`.
    """

    def __init__(self, pool: Owner) -> None:
        self.pool = pool
        self.reader = UpstreamReader(_READ_BYTES, self._read, self._fault)
        # The event loop looks these up once per connection and then calls them per read:
        # bound to the native reader, a read enters Rust directly.
        self.get_buffer = self.reader.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = self.reader.buffer_updated  # type: ignore[method-assign]
        self.transport: asyncio.Transport | None = None
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.error: Exception | None = None
        self.closed = False
        self.paused = False
        self.received = False  # any response byte on the current exchange
        self.draining: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        # Push mode: each read's body goes straight to this callback (b"": the body ended
        # or the connection broke) instead of waiting for `Exchange.read`.
        self.on_body: Callable[[bytes], None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    @property
    def decoder(self) -> ResponseDecoder | None:
        """The current exchange's response decoder; None while the connection is idle."""
        return self.reader.decoder

    @decoder.setter
    def decoder(self, d: ResponseDecoder | None) -> None:
        self.reader.decoder = d

    def _fault(self, message: str | None) -> None:
        if message is None:  # bytes on an idle connection: it cannot be trusted any more
            self.close()
        else:
            self._broken(UpstreamError(f"malformed HTTP response from the engine: {message}"))

    def _read(self, body: bytes) -> None:
        """One read's de-framed body (maybe empty), unless the reader relayed it."""
        d = self.decoder
        assert d is not None
        self.received = True
        if self.draining is not None:
            if d.complete:
                self._drained()
            return
        if self.on_body is not None:
            if body:
                self.on_body(body)
            if d.complete and self.on_body is not None:
                self.on_body(b"")
            return
        if body:
            self.body.append(body)
            self.buffered += len(body)
            if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
                self.transport.pause_reading()
                self.paused = True
        self._wake()

    def eof_received(self) -> bool | None:
        d = self.decoder
        if d is not None:
            try:
                d.eof()
            except HttpError as exc:
                self.error = self.error or UpstreamError(str(exc))
        return None  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        d = self.decoder
        if d is not None and not d.complete and self.error is None:
            self.error = UpstreamError(f"the engine closed the connection ({exc or 'EOF'})")
        if self.draining is not None:
            self.draining.cancel()
            self.draining = None
        self.pool.forget(self)
        self._wake()

    # exchange side

    def start(self, request: bytes) -> None:
        assert self.transport is not None
        self.decoder = ResponseDecoder()
        self.received = False
        self.error = None
        self.transport.write(request)

    async def wait(self, deadline: float | None) -> None:
        """Until something new happened on the connection (or the deadline passed)."""
        loop = asyncio.get_running_loop()
        fut = self.waiter = loop.create_future()
        timer = None
        if deadline is not None:
            timer = loop.call_at(deadline, _expire, fut)
        try:
            await fut
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self.on_body is not None:
            if self.error is not None or self.closed:
                self.on_body(b"")
            return
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> bytes:
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self.paused = False
        return data

    def _broken(self, exc: Exception) -> None:
        self.error = exc
        self.close()
        self._wake()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self.pool.forget(self)

    def finish(self, done: bool) -> None:
        """The exchange is over: reuse the connection when that is safe, else close it."""
        d = self.decoder
        self.body.clear()
        self.buffered = 0
        self.on_body = None
        self.reader.stop_relay()
        if self.paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()  # a pooled connection must be read again
            self.paused = False
        if not done or d is None or not d.keep_alive or self.error is not None or self.closed:
            self.close()
        elif d.complete:
            self.pool.idle(self)
        else:
            # The stream's end was seen but not the response's end (the terminating chunk
            # is usually in the next read): the read callback pools the connection once it
            # arrives, or the timer closes it.
            loop = asyncio.get_running_loop()
            self.draining = loop.call_later(_DRAIN_S, self.close)

    def _drained(self) -> None:
        assert self.draining is not None
        self.draining.cancel()
        self.draining = None
        d = self.decoder
        if d is not None and d.keep_alive and self.error is None:
            self.pool.idle(self)
        else:
            self.close()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class Exchange:
    """One request's response: status, content type, then the body as it arrives."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        d = conn.decoder
        assert d is not None
        self.status = d.status
        self.content_type = d.content_type
        self.retry_after = d.retry_after

    async def read(self, deadline: float | None = None) -> bytes:
        """The body bytes that arrived since the last read; b"" once the body is complete.

        Raises `UpstreamError` when the connection broke first, and `asyncio.TimeoutError`
        when `deadline` (event-loop time) passes with nothing new.
        """
        c = self._conn
        while True:
            if c.body:
                return c.take()
            if c.error is not None:
                raise c.error
            d = c.decoder
            if d is not None and d.complete:
                return b""
            if c.closed:
                raise UpstreamError("the engine closed the connection")
            await c.wait(deadline)

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def push(
        self,
        on_body: Callable[[bytes], None] | None,
        relay: tuple[
            StreamRelay, Send, Callable[[RelayChunk | BaseException | Awaitable[None]], None], type
        ]
        | None = None,
    ) -> None:
        """Deliver the body to `on_body` as it arrives (None: back to `read`). Called with
        b"" once when the body ends or the connection breaks; what is already buffered is
        delivered at once.

        With `relay` (a `StreamRelay`, an ASGI `send` that completes when called, its
        `on_report`, and the type `send` returns when it sent at once), later reads go
        through the relay to `send` natively instead; only reports with more than output,
        an exception from `send`, or a send that did not go at once reach `on_report`.
        """
        c = self._conn
        c.on_body = on_body
        if on_body is None:
            c.reader.stop_relay()
            return
        if c.body:
            on_body(c.take())
        d = c.decoder
        if c.on_body is not None and (
            c.error is not None or c.closed or (d is not None and d.complete)
        ):
            on_body(b"")
        elif relay is not None and c.on_body is not None:
            c.reader.start_relay(*relay)

    def relay_natively(
        self,
        relay: tuple[
            StreamRelay, Send, Callable[[RelayChunk | BaseException | Awaitable[None]], None], type
        ]
        | None,
    ) -> None:
        """While pushing: start (or stop) relaying reads in Rust; reads go to `on_body`
        otherwise."""
        if relay is None:
            self._conn.reader.stop_relay()
        else:
            self._conn.reader.start_relay(*relay)

    def complete(self) -> bool:
        """The whole response was read, well formed."""
        d = self._conn.decoder
        return d is not None and d.complete and self._conn.error is None

    @property
    def reads(self) -> int:
        """Socket reads on this exchange's connection so far."""
        return self._conn.reader.reads

    def hold(self, held: bool) -> None:
        """Stop (or resume) reading the engine's socket: backpressure from the client reaches
        the engine through TCP instead of piling up here."""
        c = self._conn
        if c.transport is None or c.closed or held == c.paused:
            return
        if held:
            c.transport.pause_reading()
        else:
            c.transport.resume_reading()
        c.paused = held

    def release(self, done: bool) -> None:
        """Hand the connection back; `done`: the relay saw the stream through to its end."""
        self._conn.finish(done)
