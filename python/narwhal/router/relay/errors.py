"""How a relayed answer fails: the exceptions the pipeline acts on, the engine's own
refusals passed on as they are, and the error event that ends a stream."""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson

from narwhal import asgi
from narwhal.asgi import Send
from narwhal.errors import ApiError


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


def error_event(message: str, code: str) -> bytes:
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


def engine_refusal(chunk: bytes) -> tuple[int, bytes] | None:
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


def deadline_passed() -> ApiError:
    """Before any byte went to the client, a passed deadline is still an HTTP 504."""
    return ApiError(
        504,
        "the request deadline passed before the engine answered",
        type="timeout_error",
        code="deadline_exceeded",
    )


def past(deadline: float) -> bool:
    # The loop's timers run on a millisecond clock that may fire a hair before
    # time.monotonic() (the deadlines' clock) reaches the deadline.
    return time.monotonic() >= deadline - 0.005
