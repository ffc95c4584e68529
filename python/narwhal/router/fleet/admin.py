"""`/admin/engines`: engines added, drained and listed while the router runs.

`GET /admin/engines` lists every engine with its state (`serving`, `draining`,
`unhealthy`) and where it came from; `POST` adds one (`{"name", "url", "dialect",
"api_key_env"}`); `DELETE /admin/engines/NAME` drains it. With `ha` an edit is made on the
leader only, written to etcd under the leader's guard (the key it holds must still be its
own), and every router (and the next leader) applies it from there (`etcd_source`).
"""

from __future__ import annotations

from typing import Any

import orjson

from narwhal import asgi
from narwhal.asgi import Receive, Send
from narwhal.errors import ApiError, unavailable
from narwhal.etcd import Etcd, EtcdError
from narwhal.router.fleet import spec as specs
from narwhal.router.fleet.membership import Conflict, Membership, Unknown
from narwhal.router.ha.leadership import Leadership

PATH = "/admin/engines"


class EnginesAdmin:
    def __init__(
        self,
        membership: Membership,
        leadership: Leadership,
        etcd: Etcd | None = None,
        prefix: str | None = None,
    ) -> None:
        self.membership = membership
        self.leadership = leadership
        self.etcd = etcd
        self.prefix = prefix  # where the edits live in etcd (with `ha`)

    async def handle(self, path: str, method: str, receive: Receive, send: Send) -> None:
        name = path[len(PATH) + 1 :] if path.startswith(PATH + "/") else None
        if name is None:
            if method == "GET":
                await asgi.send_json(send, 200, {"engines": self.membership.describe()})
            elif method == "POST":
                raw = await asgi.read_body(receive, 64 * 1024, 10.0)
                await self._add(raw, send)
            else:
                raise asgi.method_not_allowed(method, path, "GET, POST")
            return
        if method == "GET":
            await asgi.send_json(send, 200, self._one(name))
        elif method == "DELETE":
            await self._drain(name, send)
        else:
            raise asgi.method_not_allowed(method, path, "GET, DELETE")

    def _one(self, name: str) -> dict[str, Any]:
        for d in self.membership.describe():
            if d["name"] == name:
                return d
        raise _not_found(name)

    async def _add(self, raw: bytes, send: Send) -> None:
        try:
            spec = specs.parse(raw, None, self.membership.rules)
        except specs.BadSpec as e:
            raise ApiError(400, f"bad engine: {e}", param=e.field, code="invalid_engine") from None
        existing = self.membership.pool.named(spec.name)
        if existing is not None and not existing.draining and existing.spec != spec:
            raise _exists(spec.name)
        await self._store(spec.name, specs.dump(spec))
        try:
            added = self.membership.add(spec, "admin")
        except Conflict:
            raise _exists(spec.name) from None
        if added is None:
            await asgi.send_json(
                send, 202, {"name": spec.name, "state": "waiting for its namesake to drain"}
            )
            return
        await asgi.send_json(send, 200 if added is existing else 201, added.describe())

    async def _drain(self, name: str, send: Send) -> None:
        if self.membership.pool.named(name) is None:
            raise _not_found(name)
        await self._store(name, _REMOVED)
        try:
            e = self.membership.drain(name, "removed through the admin API")
        except Unknown:
            raise _not_found(name) from None
        await asgi.send_json(send, 202, e.describe())

    async def _store(self, name: str, value: bytes) -> None:
        """With `ha`: the edit in etcd, on the leader only, under its guard."""
        if self.etcd is None or self.prefix is None:
            return
        lead = self.leadership
        why = lead.serving()
        if why is not None or lead.token is None or not lead.key:
            raise unavailable(
                f"engines are added and removed on the leader only ({why or 'not leading'})",
                "not_leader",
            )
        try:
            ok = await self.etcd.put_guarded(
                (self.prefix + name).encode(), value, lead.key, lead.token
            )
        except EtcdError as e:
            raise unavailable(
                f"the change could not be stored in etcd: {e}", "etcd_unavailable"
            ) from None
        if not ok:
            raise unavailable(
                "this router lost the lead before the change was stored", "not_leader"
            )


_REMOVED = orjson.dumps({"removed": True})


def _not_found(name: str) -> ApiError:
    return ApiError(404, f"no engine named {name[:128]!r}", code="engine_not_found")


def _exists(name: str) -> ApiError:
    return ApiError(
        409,
        f"engine {name!r} exists with another URL, dialect or key: remove it first "
        "(DELETE /admin/engines/NAME)",
        code="engine_exists",
    )
