"""Streamed answers: each socket read's body through `StreamRelay` (Rust), the lease told of
first output, usage, the end and faults; pulled by the request's coroutine read by read
until the first bytes are out (a fault can still be an HTTP error then), and after that
where the server's `send` must be awaited."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from narwhal import asgi
from narwhal._native import StreamRelay
from narwhal.asgi import Send
from narwhal.router.connection import Exchange, UpstreamError
from narwhal.router.lease import Lease
from narwhal.router.relay.accounting import Stream
from narwhal.router.relay.errors import EngineFailed
from narwhal.router.relay.push import done_at_call, push

if TYPE_CHECKING:
    from narwhal.router.relay.reading import Reading


async def stream(rl: Reading, lease: Lease, resp: Exchange, send: Send) -> bool:
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
            lease.measured.answered = outcome
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
            lease.measured.answered = False
            return False
        forward, final, outcome = st.step(chunk)
        if forward:
            await send({"type": "http.response.body", "body": forward, "more_body": True})
        if final is not None:
            await asgi.stream_chunk(send, final, more=False)
            lease.measured.answered = outcome
        if outcome is not None:
            return outcome
