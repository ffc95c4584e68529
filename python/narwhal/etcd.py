"""A small etcd v3 client over etcd's own JSON gateway (`/v3/...` over HTTP).

Only what leadership, fencing and maintenance waves need: leases (grant, keep alive,
revoke), a create-if-absent transaction, range (of a key or a prefix), put, delete and a
watch of one key. The gateway is part of every etcd v3 server (3.4+), so this needs no
gRPC stack: aiohttp is already here. int64s travel as JSON strings, keys and values as
base64, and proto3 leaves out fields at their default.
Every call is bounded by `timeout_s`; endpoints are tried in turn, from the one that last
answered, until one answers (a member that hangs costs one timeout, not one per call).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

T = TypeVar("T")


class EtcdError(Exception):
    """No endpoint answered, or one answered with an error."""


@dataclass(frozen=True)
class Change:
    """One event of a watched key: put (with the key as it now is) or deleted."""

    deleted: bool
    kv: KeyValue


@dataclass(frozen=True)
class KeyValue:
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int
    key: bytes = b""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw.get("value", "")),
        int(raw.get("create_revision", 0)),
        int(raw.get("mod_revision", 0)),
        int(raw.get("lease", 0)),
        base64.b64decode(raw.get("key", "")),
    )


class Etcd:
    def __init__(self, endpoints: list[str], timeout_s: float = 1.0) -> None:
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._first = 0  # the endpoint that answered last

    async def close(self) -> None:
        """Closes its connections; a later call opens new ones."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        data = orjson.dumps(body)
        failure = "no etcd endpoint"
        for i in self._order():
            e = self.endpoints[i]
            try:
                async with self._session.post(e + path, data=data) as r:
                    raw = await r.read()
                    if r.status != 200:
                        failure = f"{e}{path} answered {r.status}: {raw[:200]!r}"
                        continue
                    out: dict[str, Any] = orjson.loads(raw)
                    self._first = i
                    return out
            except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError) as exc:
                failure = f"{e}: {type(exc).__name__}: {exc}"
        raise EtcdError(failure)

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._first + k) % n for k in range(n)]

    async def _answer(self, path: str, body: dict[str, Any], parse: Callable[[Any], T]) -> T:
        """`_call`, then `parse` of its answer: an answer that is not what etcd sends (a
        proxy's page, a field of the wrong type) is an EtcdError like no answer at all, so
        a caller's one `except EtcdError` covers every way etcd can fail it."""
        r = await self._call(path, body)
        try:
            return parse(r)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EtcdError(f"malformed answer to {path}: {type(e).__name__}: {e}") from None

    async def grant(self, ttl_s: int) -> int:
        return await self._answer("/v3/lease/grant", {"TTL": ttl_s}, lambda r: int(r["ID"]))

    async def keep_alive(self, lease: int) -> int:
        """The lease's TTL after the renewal; 0 when the lease is gone."""
        return await self._answer(
            "/v3/lease/keepalive",
            {"ID": str(lease)},
            lambda r: int(r.get("result", {}).get("TTL", 0)),
        )

    async def revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    async def create(self, key: bytes, value: bytes, lease: int) -> tuple[bool, KeyValue | None]:
        """Put `key` only if it does not exist: (whether we created it, the key as it is)."""
        k = _b64(key)

        def parse(r: Any) -> tuple[bool, KeyValue | None]:
            if r.get("succeeded"):
                rev = int(r["header"]["revision"])
                return True, KeyValue(value, rev, rev, lease)
            kvs = r.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
            return False, _kv(kvs[0]) if kvs else None

        return await self._answer(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
                ],
                "success": [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}],
                "failure": [{"request_range": {"key": k}}],
            },
            parse,
        )

    async def put_if(
        self, key: bytes, value: bytes, guard: bytes, target: str, revision: int
    ) -> int | None:
        """Put `key` only if `guard`'s `target` revision ("CREATE" or "MOD") is still
        `revision` (0: `guard` does not exist); the revision of the put, or None."""
        field = "create_revision" if target == "CREATE" else "mod_revision"
        return await self._answer(
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(guard),
                        "result": "EQUAL",
                        "target": target,
                        field: str(revision),
                    }
                ],
                "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            },
            lambda r: int(r["header"]["revision"]) if r.get("succeeded") else None,
        )

    async def under_at(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` and the store's revision they were read at (a watch
        from the next revision misses nothing)."""
        end = _prefix_end(prefix)

        def parse(r: Any) -> tuple[list[KeyValue], int]:
            return [_kv(kv) for kv in r.get("kvs", [])], int(r["header"]["revision"])

        return await self._answer(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)}, parse
        )

    async def put_guarded(
        self, key: bytes, value: bytes, guard: bytes, create_revision: int
    ) -> bool:
        """Put `key` only while `guard` is the key created at `create_revision` (the
        leader key this router holds)."""
        answer = await self.put_if(key, value, guard, "CREATE", create_revision)
        return answer is not None

    async def get(self, key: bytes) -> KeyValue | None:
        def parse(r: Any) -> KeyValue | None:
            kvs = r.get("kvs", [])
            return _kv(kvs[0]) if kvs else None

        return await self._answer("/v3/kv/range", {"key": _b64(key)}, parse)

    async def under(self, prefix: bytes) -> list[tuple[bytes, KeyValue]]:
        """Every key that starts with `prefix` (`prefix` not empty), with its value."""
        kvs, _ = await self.under_at(prefix)
        return [(kv.key, kv) for kv in kvs]

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self._call("/v3/kv/put", body)

    async def delete(self, key: bytes) -> None:
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    async def watch(
        self, key: bytes, start_revision: int, prefix: bool = False
    ) -> AsyncIterator[list[Change]]:
        """The changes to `key` (every key under it, with `prefix`) from `start_revision`
        on, as etcd reports them, for as long as the caller reads (the gateway streams one
        JSON object a line). Connecting is bounded by `timeout_s`; the wait for changes is
        not. Raises EtcdError when no endpoint streams, or when the stream breaks."""
        request = {"key": _b64(key), "start_revision": str(start_revision)}
        if prefix:
            request["range_end"] = _b64(_prefix_end(key))
        body = orjson.dumps({"create_request": request})
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeout.total, sock_connect=self.timeout.total
        )
        failure = "no etcd endpoint"
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for i in self._order():
                e = self.endpoints[i]
                try:
                    async with session.post(e + "/v3/watch", data=body) as r:
                        if r.status != 200:
                            failure = f"{e}/v3/watch answered {r.status}"
                            continue
                        async for line in r.content:
                            changes = _changes(line)
                            if changes:
                                yield changes
                        failure = f"{e}/v3/watch: the stream ended"
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    failure = f"{e}: {type(exc).__name__}: {exc}"
        raise EtcdError(failure)


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end)."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"  # every key from `prefix` on
    b[-1] += 1
    return bytes(b)


def _changes(line: bytes) -> list[Change]:
    """The events in one line of a watch stream (none for its acknowledgements)."""
    if not line.strip():
        return []
    try:
        msg = orjson.loads(line)
        result = msg.get("result") or {}
        if result.get("canceled"):
            raise EtcdError(f"the watch was canceled: {result.get('cancel_reason', '')}")
        return [
            Change(ev.get("type") == "DELETE", _kv(ev.get("kv") or {}))
            for ev in result.get("events") or []
        ]
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise EtcdError(f"malformed watch event: {type(exc).__name__}: {exc}") from None
