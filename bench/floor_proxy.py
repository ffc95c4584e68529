"""The least a Python proxy on Granian can do per relayed read: an ASGI app that forwards
each chat request to one engine and hands every socket read of the answer to `send`
untouched — no admission, no placement, no SSE parsing, no token accounting, no metrics.

It uses Narwhal's own upstream client (`narwhal.router.upstream`, the leanest reader this
project has), so Narwhal's CPU per token minus this door's is what Narwhal's own logic
costs; this door's minus the Rust routers' is what Granian + asyncio cost as a proxy.

    NARWHAL_FLOOR_ENGINE=http://127.0.0.1:PORT \
        granian --interface asgi --loop uvloop bench.floor_proxy:app
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from bench.floor_app import answered_alone
from narwhal import asgi
from narwhal.router.upstream import Upstream

_upstream: Upstream | None = None


async def app(scope: dict[str, Any], receive: asgi.Receive, send: asgi.Send) -> None:
    global _upstream
    if await answered_alone(scope, receive, send):
        return
    if _upstream is None:
        _upstream = Upstream(os.environ["NARWHAL_FLOOR_ENGINE"])
    body = await asgi.read_body(receive, 1 << 20)
    resp = await _upstream.request("/v1/chat/completions", body)
    await asgi.start_stream(send)
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_body(chunk: bytes) -> None:
        if ended.done():
            return
        if chunk:
            send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            send({"type": "http.response.body", "body": b"", "more_body": False})
            ended.set_result(None)

    resp.push(on_body)
    try:
        await ended
    finally:
        resp.push(None)
        resp.release(True)
