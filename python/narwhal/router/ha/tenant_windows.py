"""The leader's tenant windows (requests and tokens of the last minute), kept in etcd so a
new leader holds every tenant to the limits the last one was counting: hitting another
router, or waiting out a failover, does not double a tenant's quota."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from narwhal.etcd import EtcdError
from narwhal.router.config import HA
from narwhal.router.ha.leadership import Leadership
from narwhal.router.tenants.registry import Tenants

log = logging.getLogger("narwhal.router")

# Published this often: a failover takes a lease's TTL (seconds), so what the new leader
# misses is the last half second of the old one's admissions at most.
EVERY_S = 0.5


class SharedTenantWindows:
    def __init__(self, ha: HA, leadership: Leadership, tenants: Tenants) -> None:
        assert leadership.etcd is not None
        self.etcd = leadership.etcd
        self.key = ha.sibling("tenants").encode()
        self.leadership = leadership
        self.tenants = tenants

    async def publish_forever(self) -> None:
        while True:
            await asyncio.sleep(EVERY_S)
            token = self.leadership.token
            if self.leadership.serving() is None and token is not None:
                with contextlib.suppress(EtcdError):
                    guard = self.leadership.key
                    await self.etcd.put_if(self.key, self.tenants.export(), guard, "CREATE", token)

    async def take_over(self) -> None:
        try:
            kv = await self.etcd.get(self.key)
        except EtcdError as e:
            log.warning("the last leader's tenant windows could not be read: %s", e)
            return
        if kv is not None:
            n = self.tenants.load(kv.value)
            log.info("took over the last leader's tenant windows (%d tenants)", n)
