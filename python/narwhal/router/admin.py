"""The admin API: maintenance waves, the fleet's engines (`router/fleet/admin.py`) and the
requests' decision records (`/admin/requests`, `router/decisions.py`), behind a Bearer
token (`admin: {token_env: NAME}`).

Without an admin token configured there are no admin routes (404). The token is compared in
constant time; a missing or wrong one is 401 in the envelope.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from narwhal import asgi, bearer
from narwhal.asgi import Receive, Scope, Send
from narwhal.errors import ApiError, invalid, unavailable
from narwhal.etcd import EtcdError
from narwhal.router.decisions import Decisions
from narwhal.router.fleet import admin as engines_admin
from narwhal.router.ha.maintenance import Maintenance, WaveChanged

REQUESTS = "/admin/requests"
ROUTES = frozenset({"/admin/maintenance", "/admin/reload", engines_admin.PATH, REQUESTS})
LIST_LIMIT = 1000  # decision records a listing returns at most


def routes(path: str) -> bool:
    return (
        path in ROUTES
        or path.startswith(engines_admin.PATH + "/")
        or path.startswith(REQUESTS + "/")
    )


class Admin:
    def __init__(
        self,
        token: str,
        maintenance: Maintenance,
        engines: engines_admin.EnginesAdmin,
        reload: Callable[[], str | None],
        decisions: Decisions | None = None,
    ) -> None:
        self.token = token.encode()
        self.maintenance = maintenance
        self.engines = engines
        self.reload = reload
        self.decisions = decisions

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if path == "/admin/reload":
            if method != "POST":
                raise asgi.method_not_allowed(method, path, "POST")
            bearer.require(scope, (self.token,), "admin token")
            refused = self.reload()
            if refused is not None:
                raise ApiError(
                    400,
                    f"the config file was not reloaded (the running config stays): {refused}",
                    code="invalid_config",
                )
            await asgi.send_json(send, 200, {"reloaded": True})
            return
        if path == REQUESTS or path.startswith(REQUESTS + "/"):
            if method != "GET":
                raise asgi.method_not_allowed(method, path, "GET")
            bearer.require(scope, (self.token,), "admin token")
            await asgi.send_json(send, 200, self._requests(path, scope.get("query_string", b"")))
            return
        if path != "/admin/maintenance":
            bearer.require(scope, (self.token,), "admin token")
            await self.engines.handle(path, method, receive, send)
            return
        if method not in ("GET", "POST", "DELETE"):
            raise asgi.method_not_allowed(method, path, "GET, POST, DELETE")
        bearer.require(scope, (self.token,), "admin token")
        m = self.maintenance
        try:
            if method == "POST":
                raw = await asgi.read_body(receive, 64 * 1024, 10.0)
                await m.edit(**self._edit(raw))
            elif method == "DELETE":
                await m.edit(replace=frozenset())
        except WaveChanged as e:
            raise ApiError(
                409,
                f"the wave changed since the revision this edit was made against (it is "
                f"at {e.revision} now): read it and try again",
                code="wave_changed",
            ) from None
        except EtcdError as e:
            raise unavailable(
                f"the wave could not be stored in etcd: {e}", "etcd_unavailable"
            ) from None
        await asgi.send_json(send, 200, self.describe())

    def _requests(self, path: str, query: bytes) -> dict[str, Any]:
        """One request's decision record (`/admin/requests/ID`), or the newest ones, those
        that ended as `outcome` if given, at most `limit` (50 unless said)."""
        if self.decisions is None:
            raise ApiError(
                404, "decision records are not kept (admin.decision_records: 0)", code="not_found"
            )
        if path != REQUESTS:
            rid = path[len(REQUESTS) + 1 :]
            d = self.decisions.get(rid)
            if d is None:
                raise ApiError(
                    404,
                    f"no decision record for request {rid!r}: it was not judged, or it is "
                    f"older than the last {self.decisions.capacity} kept",
                    code="not_found",
                )
            return d.describe()
        try:
            q = parse_qs(query.decode("ascii"), strict_parsing=bool(query))
        except (UnicodeDecodeError, ValueError):
            raise invalid("the query string is not valid") from None
        outcome = q.get("outcome", [None])[-1]
        raw = q.get("limit", ["50"])[-1]
        if not raw.isdigit() or not 1 <= int(raw) <= LIST_LIMIT:
            raise invalid(f"limit must be an integer from 1 to {LIST_LIMIT}", param="limit")
        found = self.decisions.newest(outcome, int(raw))
        return {"object": "list", "data": [d.describe() for d in found]}

    def describe(self) -> dict[str, Any]:
        m = self.maintenance
        return {"engines": sorted(m.wave), "whole_wave": m.whole, "revision": m.revision}

    def _edit(self, raw: bytes) -> dict[str, Any]:
        """`{"engines": [...] | "all"}` replaces the wave, `{"add": [...]}` and
        `{"remove": [...]}` edit it; `"revision"` makes the edit conditional on it."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise invalid(_SHAPE, None) from None
        if not isinstance(body, dict) or not ({"engines", "add", "remove"} & body.keys()):
            raise invalid(_SHAPE, None)
        out: dict[str, Any] = {}
        if "engines" in body:
            if "add" in body or "remove" in body:
                raise invalid("'engines' replaces the wave: no 'add' or 'remove' with it", None)
            out["replace"] = self._names(body["engines"], "engines")
        for field in ("add", "remove"):
            if field in body:
                out[field] = self._names(body[field], field)
        rev = body.get("revision")
        if rev is not None:
            if not isinstance(rev, int) or isinstance(rev, bool) or rev < 0:
                raise invalid(
                    "'revision' must be a revision of the wave (GET shows it)", "revision"
                )
            out["revision"] = rev
        return out

    def _names(self, engines: Any, field: str) -> frozenset[str]:
        if engines == "all":
            return self.maintenance.names
        if not isinstance(engines, list) or not all(isinstance(n, str) for n in engines):
            raise invalid(f"'{field}' must be a list of engine names or \"all\"", field)
        unknown = sorted(set(engines) - self.maintenance.names)
        if unknown:
            raise invalid(f"no engine named {unknown[0][:100]!r}", field)
        return frozenset(engines)


_SHAPE = (
    'the body must be JSON: {"engines": [...] or "all"} to replace the wave, '
    '{"add": [...]} or {"remove": [...]} to edit it, with an optional "revision"'
)
