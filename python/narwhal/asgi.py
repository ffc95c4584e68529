"""Small ASGI helpers shared by both servers: bounded body reads and plain responses."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import orjson

from narwhal.errors import ApiError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
SSE = b"text/event-stream"


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int, timeout: float | None = None) -> bytes:
    """Read the request body, stopping as soon as it passes `limit` bytes.

    `timeout` bounds the whole body: a client that stops sending mid-body gets a 408
    instead of holding its connection and the router's seat forever. A body the server
    cannot read (a malformed chunked encoding) is a 400, never the server's bare 500.
    """
    if timeout is None:
        return await _read_body(receive, limit, None)
    try:
        if sys.version_info >= (3, 11):
            # One timer for the whole body: `wait_for` around each `receive` cost a future
            # and its callbacks on every request (bench/router_profile.py).
            async with asyncio.timeout(timeout):
                return await _read_body(receive, limit, None)
        return await _read_body(receive, limit, asyncio.get_running_loop().time() + timeout)
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            type="invalid_request_error",
            code="request_timeout",
        ) from None


async def _read_body(receive: Receive, limit: int, end: float | None) -> bytes:
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    while True:
        try:
            if end is None:
                msg = await receive()
            else:
                msg = await asyncio.wait_for(receive(), max(end - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise
        except Exception as exc:
            raise ApiError(
                400, f"the request body could not be read: {exc}", code="bad_request_body"
            ) from None
        if msg["type"] == "http.disconnect":
            raise ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        if not msg.get("more_body", False):
            if not parts:
                return bytes(chunk)  # the usual case: the whole body in one message
            parts.append(chunk)
            return b"".join(parts)
        parts.append(chunk)


def method_not_allowed(method: str, path: str, allow: str) -> ApiError:
    """405 for a known route asked with the wrong method, with `Allow` (RFC 9110)."""
    return ApiError(
        405,
        f"{method} is not allowed on {path}; use {allow}",
        code="method_not_allowed",
        headers={"allow": allow},
    )


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v).decode("latin-1")
    return None


class Record:
    """What the access log says of one request: its ID (every response head carries it as
    `x-request-id`) and the status it was answered with. One per request, in a context
    variable: each ASGI request runs in a task of its own."""

    __slots__ = ("fields", "id", "status")

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.status = 0  # 0: nothing was sent (the client left first)
        self.fields: dict[str, Any] = {}  # what the app adds (engine, tokens, outcome)


current: contextvars.ContextVar[Record | None] = contextvars.ContextVar("record", default=None)


def _headers(
    ctype: bytes, extra: Iterable[tuple[str, str]], status: int = 200
) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", ctype)]
    out.extend((k.lower().encode(), v.encode()) for k, v in extra)
    rec = current.get()
    if rec is not None:
        rec.status = status
        out.append((b"x-request-id", rec.id.encode()))
    return out


def begin(scope: Scope) -> Record:
    """This request's record: the client's `x-request-id` (printable ASCII, at most 128
    characters) or a new ID."""
    raw = header(scope, b"x-request-id")
    if raw is None or not (0 < len(raw) <= 128) or not all(33 <= ord(c) < 127 for c in raw):
        raw = os.urandom(16).hex()
    rec = Record(raw)
    current.set(rec)
    return rec


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    ctype: bytes = JSON,
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    hs = _headers(ctype, headers, status)
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any) -> None:
    await send_bytes(send, status, orjson.dumps(obj))


async def in_envelope(send: Send, handle: Awaitable[None], log: logging.Logger, what: str) -> None:
    """Run a route's handler: whatever it raises reaches the client in the OpenAI error
    envelope (a bug as a 500, its trace in the log), never as the server's bare 500."""
    try:
        await handle
    except ApiError as e:
        await send_error(send, e)
    except ClientGone:
        # The server ends the body with a disconnect both when the client left and when the
        # body's framing is broken (a chunk size that is not hex or overflows, a body shorter
        # than its Content-Length): answer the second kind, which the server would otherwise
        # answer with its own bare 500; to a client that left, the answer goes nowhere.
        with contextlib.suppress(Exception):
            await send_error(send, _UNREADABLE)
    except BodyTooLarge:
        await send_error(send, ApiError(413, "request body too large", code="request_too_large"))
    except Exception:
        log.exception("unhandled error on %s", what)
        with contextlib.suppress(Exception):  # unless the response had started
            await send_error(
                send, ApiError(500, "internal error", type="server_error", code="internal_error")
            )


_UNREADABLE = ApiError(
    400,
    "the request body could not be read: the connection ended or its framing is malformed",
    code="bad_request_body",
    headers={"connection": "close"},
)


async def send_error(send: Send, err: ApiError) -> None:
    await send_bytes(send, err.status, err.body(), headers=err.headers.items())


def response_head(status: int, ctype: bytes) -> Message:
    """The `http.response.start` of a body sent in pieces."""
    return {"type": "http.response.start", "status": status, "headers": _headers(ctype, (), status)}


def stream_head(headers: Iterable[tuple[str, str]] = ()) -> Message:
    """The `http.response.start` of an event stream."""
    hs = _headers(SSE, [("cache-control", "no-cache"), *headers])
    return {"type": "http.response.start", "status": 200, "headers": hs}


async def start_stream(send: Send, headers: Iterable[tuple[str, str]] = ()) -> None:
    await send(stream_head(headers))


async def stream_chunk(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def watch_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    """Cancel a request's task when its client disconnects (run after the body is read)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            task.cancel()
            return


async def lifespan(
    receive: Receive,
    send: Send,
    startup: Callable[[], Awaitable[None]],
    shutdown: Callable[[], Awaitable[None]],
) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await startup()
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
