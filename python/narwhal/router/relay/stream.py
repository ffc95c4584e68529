"""Streamed answers: each socket read's body through `StreamRelay` (Rust), the lease told of
first output, usage, the end and faults; pulled by the request's coroutine read by read
until the first bytes are out (a fault can still be an HTTP error then), and after that
where the server's `send` must be awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from narwhal import asgi
from narwhal._native import RelayChunk, StreamRelay
from narwhal.asgi import Send
from narwhal.router.connection import Exchange, UpstreamError
from narwhal.router.lease import Lease
from narwhal.router.relay.errors import EngineFailed, error_event
from narwhal.router.relay.push import done_at_call, push

if TYPE_CHECKING:
    from narwhal.router.relay.relayer import Relayer


class Stream:
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
        """The engine closed the stream without `[DONE]`: it broke mid-stream (or the router
        cut it: its engine was drained past the timeout)."""
        self.ended = True
        if self.lease.on.cut:
            self.lease.fault("engine_removed")
            return error_event(
                "the engine was removed from the fleet before the answer ended",
                "engine_removed",
            )
        self.lease.fault("engine_disconnected", "stream ended early")
        return error_event("the engine stream ended early", "engine_disconnected")

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
        lease.measured.prompt_tokens = (
            self.prompt_ids or rep.prompt_tokens or lease.measured.prompt_tokens
        )
        if rep.cached_tokens is not None:
            lease.measured.cached_tokens = rep.cached_tokens
        if rep.fault_reason is not None:
            self.ended = True
            lease.fault(rep.fault_reason)
            return (
                rep.forward,
                error_event(f"engine stream rejected: {rep.fault_message}", rep.fault_reason),
                False,
            )
        if rep.done:
            self.ended = True
            lease.finished(self.relay.counted)
            return rep.forward, b"", True
        return rep.forward, None, None


async def stream(rl: Relayer, lease: Lease, resp: Exchange, send: Send) -> bool:
    """A streamed answer: pulled read by read until its first bytes are out, then pushed
    from the read callback (`push`) where the server's `send` allows, else pulled to the end."""
    e = lease.on
    relay = StreamRelay(
        strip_token_ids=not lease.request.wants_token_ids,
        require_token_ids=e.spec.token_ids,
        drop_usage=not lease.request.include_usage,
    )
    lease.measured.tally = relay
    st = Stream(lease, relay, resp.complete)
    # Until the first bytes are out, a fault can still be an HTTP error and the deadline
    # applies: the stream is pulled read by read.
    sent_type: type | None = None  # what `send` returns when it sent at once
    while True:
        chunk = await rl.read(lease, resp)
        if not chunk:
            st.broken()
            raise EngineFailed("stream ended before any output")
        forward, final, outcome = st.step(chunk)
        if forward or final is not None:
            sent_type, rest = done_at_call(send(asgi.stream_head()))
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
    if rl.native:
        if sent_type is not None:
            rl.count_path("native")
            return await push(rl, st, resp, send, sent_type)
        rl.warn_not_native()
    rl.count_path("awaited")
    read = resp.read  # bound once: this loop runs once per socket read (often a token)
    loop = asyncio.get_running_loop()
    while True:
        try:
            chunk = await read(min(lease.deadline, loop.time() + rl.idle_s))
        except UpstreamError:
            chunk = b""
        except asyncio.TimeoutError:
            await asgi.stream_chunk(send, rl.timed_out(lease), more=False)
            return False
        forward, final, outcome = st.step(chunk)
        if forward:
            await send({"type": "http.response.body", "body": forward, "more_body": True})
        if final is not None:
            await asgi.stream_chunk(send, final, more=False)
        if outcome is not None:
            return outcome
