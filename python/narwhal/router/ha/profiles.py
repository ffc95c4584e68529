"""The leader's predictor profiles, kept in etcd so the next leader admits as sharply on its
first request as this one does now."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from narwhal.etcd import EtcdError
from narwhal.router.config import HA
from narwhal.router.ha.leadership import Leadership
from narwhal.router.predict import Predictor

log = logging.getLogger("narwhal.router")


class SharedProfiles:
    def __init__(self, ha: HA, leadership: Leadership, predictor: Predictor) -> None:
        assert leadership.etcd is not None
        self.etcd = leadership.etcd
        self.key = ha.sibling("profiles").encode()
        self.leadership = leadership
        self.predictor = predictor

    async def publish_forever(self, every_s: float = 2.0) -> None:
        """While leading, what the predictor learned goes to etcd every `every_s`."""
        while True:
            await asyncio.sleep(every_s)
            token = self.leadership.token
            if self.leadership.serving() is None and token is not None:
                with contextlib.suppress(EtcdError):
                    # Only while the leader key is still the one this router created: a
                    # deposed leader's late put must not land over its successor's.
                    guard = self.leadership.key
                    if None is await self.etcd.put_if(
                        self.key, self.predictor.export(), guard, "CREATE", token
                    ):
                        self.leadership.fence("the leader key changed (profiles not stored)")

    async def take_over(self) -> None:
        """On taking the lead: start from what the last leader published."""
        try:
            kv = await self.etcd.get(self.key)
        except EtcdError as e:
            log.warning("the last leader's predictor profiles could not be read: %s", e)
            return
        if kv is not None:
            n = self.predictor.load(kv.value)
            log.info("took over the last leader's predictor profiles (%d engines)", n)
