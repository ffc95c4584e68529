"""The least a Python front door on Granian can do per streamed chunk: an ASGI app that
answers the harness's chat requests itself, emitting the scripted engine's frames at the
same pace, with no upstream at all. Its CPU per token is the floor under Narwhal's.

    granian --interface asgi --loop uvloop bench.floor_app:app
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from narwhal import asgi


def _frame(i: int) -> bytes:
    return (
        b"data: "
        + orjson.dumps(
            {
                "id": "x-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "scripted",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"w{i} "},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
        + b"\n\n"
    )


async def answered_alone(scope: dict[str, Any], receive: asgi.Receive, send: asgi.Send) -> bool:
    """Lifespan and `/health`, which every bench door answers the same way."""
    if scope["type"] == "lifespan":

        async def nothing() -> None:
            return None

        await asgi.lifespan(receive, send, nothing, nothing)
        return True
    if scope["path"] == "/health":
        await asgi.send_json(send, 200, {"ok": True})
        return True
    return False


async def app(scope: dict[str, Any], receive: asgi.Receive, send: asgi.Send) -> None:
    if await answered_alone(scope, receive, send):
        return
    body = orjson.loads(await asgi.read_body(receive, 1 << 20))
    _, name, *args = body["messages"][-1]["content"].split(":")
    n, pace = int(args[0]), (float(args[1]) / 1000 if name == "paced" else 0.0)
    await asgi.start_stream(send)
    for i in range(n):
        if pace:
            await asyncio.sleep(pace)
        await send({"type": "http.response.body", "body": _frame(i), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
