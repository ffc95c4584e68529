"""Self-registration: an engine's key in etcd, kept under a lease while the engine is
healthy, for routers that follow the prefix (`engines_from: {etcd: ...}`).

LexiEngine runs it in-process (`lexi-engine serve --register-etcd ...`): healthy means
its model is loaded and it is not shutting down; on shutdown the key is deleted before
the engine drains, so routers stop placing there first. For engines we do not write
(vLLM, SGLang, llama-server) `narwhal register` runs it beside the engine, healthy while
the engine's `/health` answers 200. A registrar that dies (or a machine that goes away)
stops renewing the lease: the key expires within its TTL and routers drain the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from narwhal.etcd import Etcd, EtcdError

log = logging.getLogger("narwhal.registrar")

DEFAULT_TTL_S = 10


def value(url: str, dialect: str, name: str) -> bytes:
    """The key's value: the engine as `engines_from.etcd` reads it."""
    return orjson.dumps({"name": name, "url": url, "dialect": dialect})


class Registrar:
    def __init__(
        self,
        endpoints: list[str],
        key: str,
        value: bytes,
        healthy: Callable[[], Awaitable[bool]],
        ttl_s: int = DEFAULT_TTL_S,
    ) -> None:
        self.etcd = Etcd(endpoints)
        self.key = key.encode()
        self.value = value
        self.healthy = healthy
        self.ttl_s = ttl_s
        self.every_s = max(0.5, ttl_s / 3)  # renewed three times a TTL: one miss is no lapse
        self.lease = 0
        self.registered = False
        # The engine is stopping: nothing registers it again (a renewal in flight when the
        # stop began would otherwise put the key back after it was withdrawn).
        self.retired = False

    async def run_forever(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.every_s)

    async def step(self) -> None:
        """One look at the engine's health, and the key made to match it."""
        ok = await self.healthy()
        try:
            if ok:
                await self._hold()
            elif self.registered:
                log.info("engine unhealthy: its key %s is withdrawn", self.key.decode())
                await self.withdraw()
        except EtcdError as e:
            log.warning("registration of %s: %s", self.key.decode(), e)

    async def _hold(self) -> None:
        if self.lease and await self.etcd.keep_alive(self.lease) > 0:
            if not self.registered:
                await self._put()
            return
        if self.retired:
            return
        self.lease = await self.etcd.grant(self.ttl_s)
        self.registered = False
        await self._put()

    async def _put(self) -> None:
        if self.retired:
            return
        await self.etcd.put(self.key, self.value, self.lease)
        if self.retired:  # the stop began while the key went in: it goes again
            await self.withdraw()
            return
        if not self.registered:
            log.info("registered %s in etcd (lease TTL %ds)", self.key.decode(), self.ttl_s)
        self.registered = True

    async def retire(self) -> None:
        """The engine stops: the key goes now, and is not put back."""
        self.retired = True
        await self.withdraw()

    async def withdraw(self) -> None:
        """The key goes now (its lease revoked), not at the lease's expiry."""
        lease, self.lease, self.registered = self.lease, 0, False
        if lease:
            await self.etcd.revoke(lease)

    async def close(self) -> None:
        with contextlib.suppress(EtcdError):
            await self.retire()
        await self.etcd.close()


def http_health(url: str, timeout_s: float = 2.0) -> Callable[[], Awaitable[bool]]:
    """Healthy while `url/health` answers 200 (the sidecar's test)."""
    session: aiohttp.ClientSession | None = None

    async def healthy() -> bool:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        try:
            async with session.get(url.rstrip("/") + "/health") as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    return healthy


async def sidecar(registrar: Registrar, stop: asyncio.Event) -> None:
    """`narwhal register`: hold the key until `stop`, then withdraw it."""
    task = asyncio.create_task(registrar.run_forever())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # it failed: the process says why and exits
    finally:
        stopped.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await registrar.close()
