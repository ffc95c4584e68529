"""Maintenance waves: engines taken out of placement while their in-flight requests finish.

An operator puts engines in the wave (`POST /admin/maintenance`), takes them out (`DELETE`)
and lists them (`GET`). Engines in the wave get nothing new; a wave that covers every engine
is whole-wave maintenance, and completion routes refuse with 503. With `ha` the wave lives
in etcd, next to the leader key, so a new leader inherits it; every router follows it.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from narwhal.etcd import Etcd, EtcdError
from narwhal.router.engines import Pool

log = logging.getLogger("narwhal.maintenance")


class WaveChanged(Exception):
    """The wave is no longer at the revision an edit was made against."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"the wave is at revision {revision}")
        self.revision = revision


class Maintenance:
    def __init__(self, pool: Pool, etcd: Etcd | None = None, key: str | None = None) -> None:
        self.pool = pool
        self.etcd = etcd
        self.key = key.encode() if key else b""
        self.revision = 0  # of the wave as last read or written (etcd's mod revision)

    @property
    def names(self) -> frozenset[str]:
        """The engines there are now (engines join and leave: router/fleet/)."""
        return frozenset(e.name for e in self.pool.engines)

    @property
    def wave(self) -> frozenset[str]:
        return self.pool.maintenance

    @property
    def whole(self) -> bool:
        return bool(self.names) and self.wave >= self.names

    async def edit(
        self,
        replace: frozenset[str] | None = None,
        add: frozenset[str] = frozenset(),
        remove: frozenset[str] = frozenset(),
        revision: int | None = None,
    ) -> None:
        """The wave replaced, or engines added to it and removed from it; stored first
        where it is shared, as a compare-and-set on the wave's revision, so two edits
        never silently overwrite each other (an addition and a removal both land). With
        `revision`, the edit is made only against that revision of the wave (else
        WaveChanged)."""
        for _ in range(_ATTEMPTS):
            current, rev = await self._stored()
            if revision is not None and rev != revision:
                raise WaveChanged(rev)
            wave = replace if replace is not None else (current | add) - remove
            if self.etcd is None:
                self.revision = rev + 1
                self._apply(wave)
                return
            put = await self.etcd.put_if(self.key, orjson.dumps(sorted(wave)), self.key, "MOD", rev)
            if put is not None:
                self.revision = put
                self._apply(wave)
                return
            if revision is not None:
                raise WaveChanged(rev)
        raise WaveChanged(rev)

    async def _stored(self) -> tuple[frozenset[str], int]:
        if self.etcd is None:
            return self.pool.maintenance, self.revision
        kv = await self.etcd.get(self.key)
        if kv is None:
            return frozenset(), 0
        try:
            return _names(kv.value), kv.mod_revision
        except ValueError:  # not a list of names: an edit starts it afresh
            return frozenset(), kv.mod_revision

    def _apply(self, engines: frozenset[str]) -> None:
        engines = engines & self.names
        if engines != self.pool.maintenance:
            log.info("maintenance wave: %s", ", ".join(sorted(engines)) or "none")
            self.pool.maintenance = engines
            self.pool.notify()  # an engine back from the wave may take queued requests

    async def follow_forever(self, interval_s: float = 0.5) -> None:
        """Keep to the wave stored in etcd (set by any router, kept across failovers)."""
        if self.etcd is None:
            return
        while True:
            try:
                await self.refresh()
            except (EtcdError, ValueError) as e:
                log.debug("maintenance wave not read: %s", e)
            await asyncio.sleep(interval_s)

    async def refresh(self) -> None:
        """The wave as stored now (a new leader reads it before its first placement)."""
        if self.etcd is None:
            return
        kv = await self.etcd.get(self.key)
        self.revision = kv.mod_revision if kv is not None else 0
        self._apply(_names(kv.value) if kv is not None else frozenset())


_ATTEMPTS = 8  # edits racing on one wave: each retry reads the wave another edit left


def _names(raw: bytes) -> frozenset[str]:
    """The engine names a stored wave holds; ValueError when it is not a list."""
    stored = orjson.loads(raw) if raw else []
    if not isinstance(stored, list):
        raise ValueError("the stored wave is not a list")
    return frozenset(str(n) for n in stored)
