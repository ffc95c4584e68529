"""The admin API: maintenance waves, behind a Bearer token (`admin: {token_env: NAME}`).

Without an admin token configured there are no admin routes (404). The token is compared in
constant time; a missing or wrong one is 401 in the envelope.
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal import asgi, bearer
from narwhal.asgi import Receive, Scope, Send
from narwhal.errors import ApiError, invalid
from narwhal.etcd import EtcdError
from narwhal.router.ha.maintenance import Maintenance

ROUTES = frozenset({"/admin/maintenance"})


class Admin:
    def __init__(self, token: str, maintenance: Maintenance) -> None:
        self.token = token.encode()
        self.maintenance = maintenance

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        if method not in ("GET", "POST", "DELETE"):
            raise asgi.method_not_allowed(method, scope["path"], "GET, POST, DELETE")
        bearer.require(scope, (self.token,), "admin token")
        m = self.maintenance
        try:
            if method == "POST":
                raw = await asgi.read_body(receive, 64 * 1024, 10.0)
                await m.set(self._engines(raw))
            elif method == "DELETE":
                await m.set(frozenset())
        except EtcdError as e:
            raise ApiError(
                503,
                f"the wave could not be stored in etcd: {e}",
                type="server_error",
                code="etcd_unavailable",
                headers={"retry-after": "1"},
            ) from None
        await asgi.send_json(send, 200, self.describe())

    def describe(self) -> dict[str, Any]:
        return {"engines": sorted(self.maintenance.wave), "whole_wave": self.maintenance.whole}

    def _engines(self, raw: bytes) -> frozenset[str]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise invalid('the body must be JSON: {"engines": [...] or "all"}', None) from None
        engines = body.get("engines") if isinstance(body, dict) else None
        if engines == "all":
            return self.maintenance.names
        if not isinstance(engines, list) or not all(isinstance(n, str) for n in engines):
            raise invalid("'engines' must be a list of engine names or \"all\"", "engines")
        unknown = sorted(set(engines) - self.maintenance.names)
        if unknown:
            raise invalid(f"no engine named {unknown[0]!r}", "engines")
        return frozenset(engines)
