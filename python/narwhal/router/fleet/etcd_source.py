"""Engines registered in etcd: each key under a prefix is an engine (its last segment the
name, its value the engine as JSON); a key put adds it (or replaces it, when its value
changed), a key deleted or expired drains it.

The same watcher keeps the admin API's edits in step across routers (`ha`): there a key's
value is an engine added through the API, or `{"removed": true}` for one taken away (a
config-file engine too), written by the leader alone (`store`).

On start, and after any break in the watch (etcd down, the watch compacted away), the
whole prefix is read again and the fleet made to match it; until then the last good set
keeps serving, and `error` says why it may be stale (`/ready`).
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from narwhal.etcd import Change, Etcd, EtcdError, KeyValue
from narwhal.router.fleet import spec as specs
from narwhal.router.fleet.membership import Conflict, Membership

log = logging.getLogger("narwhal.fleet")

RETRY_S = 1.0


class EtcdSource:
    def __init__(
        self, etcd: Etcd, prefix: str, membership: Membership, source: str = "etcd"
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix.encode()
        self.membership = membership
        self.source = source
        self.error: str | None = "not read yet"

    async def follow_forever(self) -> None:
        while True:
            try:
                kvs, revision = await self.etcd.under_at(self.prefix)
                self._match(kvs)
                self.error = None
                async for changes in self.etcd.watch(self.prefix, revision + 1, prefix=True):
                    for change in changes:
                        self._apply(change)
            except EtcdError as e:
                if self.error is None:
                    log.warning("engines from etcd %s: %s", self.prefix.decode(), e)
                self.error = f"etcd {self.prefix.decode()}: {e}"
            await asyncio.sleep(RETRY_S)

    def _match(self, kvs: list[KeyValue]) -> None:
        """The fleet as the prefix holds it now."""
        seen = set()
        for kv in kvs:
            name = self._name(kv.key)
            if name is not None:
                seen.add(name)
                self._put(name, kv.value)
        if self.source != "admin":  # the admin store never lists config-file engines
            for name in self.membership.names(self.source) - seen:
                self.membership.drain(name, f"its key under {self.prefix.decode()} is gone")

    def _apply(self, change: Change) -> None:
        name = self._name(change.kv.key)
        if name is None:
            return
        if change.deleted:
            self._drain(name, "its key was deleted or expired")
        else:
            self._put(name, change.kv.value)

    def _name(self, key: bytes) -> str | None:
        name = key[len(self.prefix) :].rsplit(b"/", 1)[-1].decode("utf-8", "replace")
        if not specs.NAME.fullmatch(name):
            log.warning("engines from etcd: key %r does not name an engine", key[:200])
            return None
        return name

    def _put(self, name: str, value: bytes) -> None:
        if self.source == "admin" and _removed(value):
            self._drain(name, "removed through the admin API")
            return
        try:
            spec = specs.parse(value, name, self.membership.rules)
        except specs.BadSpec as e:
            log.warning("engines from etcd: %s: %s (ignored)", name, e)
            return
        try:
            self.membership.replace(spec, self.source)
        except Conflict as e:
            log.warning("engines from etcd: %s", e)

    def _drain(self, name: str, why: str) -> None:
        if self.membership.pool.named(name) is not None:
            self.membership.drain(name, why)


def _removed(value: bytes) -> bool:
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and body.get("removed") is True
