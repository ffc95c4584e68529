"""The OpenAI error envelope shared by the router and the engine."""

from __future__ import annotations

from typing import Any

import orjson


class ApiError(Exception):
    """An error answered to the client; never a traceback."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # The router's own: how the request it answers ended (a row of
        # `narwhal.router.endings.End`, which this module shared with the engine does not
        # know).
        self.cause: object | None = None
        # What the access line says of it beyond its code (a refusal's projection, say).
        self.fields: dict[str, object] = {}

    def ended(self, cause: object) -> ApiError:
        """This error, saying how the request ended; the stage nearest the cause says it
        first, and a later one does not overwrite it."""
        if self.cause is None:
            self.cause = cause
        return self

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.envelope())


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body parsed as a JSON object, or a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def unavailable(message: str, code: str) -> ApiError:
    """503, to retry in a second: who answers cannot serve it now (a standby, a fenced
    router, etcd unreachable, no engine), which is no refusal of the request itself."""
    return ApiError(503, message, type="server_error", code=code, headers={"retry-after": "1"})
