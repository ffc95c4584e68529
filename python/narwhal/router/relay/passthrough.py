"""Pass-through: an answer relayed as the engine sends it (the Responses API)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from narwhal import asgi
from narwhal.asgi import Send
from narwhal.router.connection import Exchange, UpstreamError
from narwhal.router.lease import Lease
from narwhal.router.relay.errors import EngineFailed, past

if TYPE_CHECKING:
    from narwhal.router.relay.reading import Reading


async def passthrough(rl: Reading, lease: Lease, resp: Exchange, send: Send) -> bool:
    """An answer relayed as the engine sends it (the Responses API: its events are the
    engine's, neither validated nor assembled here). The deadline and the idle gap
    bound it as any other; whether it ended well is the engine's HTTP framing's word."""
    first = await rl.read(lease, resp)
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
            chunk = await resp.read(min(lease.deadline, loop.time() + rl.idle_s))
        except UpstreamError:
            chunk = b""
        except asyncio.TimeoutError:
            rl.timed_out(lease)  # reported; the body just ends
            chunk = b""
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            continue
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        lease.measured.answered = resp.complete()
        if resp.complete():
            lease.finished(0)  # output tokens are counted only where the router parses
            return True
        if not past(lease.deadline):
            lease.fault("engine_disconnected", "stream ended early")
        return False
