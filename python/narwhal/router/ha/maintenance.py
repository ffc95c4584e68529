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


class Maintenance:
    def __init__(self, pool: Pool, etcd: Etcd | None = None, key: str | None = None) -> None:
        self.pool = pool
        self.etcd = etcd
        self.key = key.encode() if key else b""
        self.names = frozenset(e.name for e in pool.engines)

    @property
    def wave(self) -> frozenset[str]:
        return self.pool.maintenance

    @property
    def whole(self) -> bool:
        return bool(self.names) and self.wave >= self.names

    async def set(self, engines: frozenset[str]) -> None:
        """The wave becomes `engines` (empty: it ends); stored first where it is shared."""
        if self.etcd is not None:
            await self.etcd.put(self.key, orjson.dumps(sorted(engines)))
        self._apply(engines)

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
                kv = await self.etcd.get(self.key)
                stored = orjson.loads(kv.value) if kv is not None and kv.value else []
                if isinstance(stored, list):
                    self._apply(frozenset(str(n) for n in stored))
            except (EtcdError, orjson.JSONDecodeError) as e:
                log.debug("maintenance wave not read: %s", e)
            await asyncio.sleep(interval_s)
