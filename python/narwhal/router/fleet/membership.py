"""Membership: the one owner of which engines serve, while the router runs.

Engines come from the config file, the admin API, etcd and DNS (`source`); once running
they are the same kind of thing. Adding one puts it in the pool, tells the policy (a
predictive one starts its profile from the fleet's median) and probes it at once.
Draining one takes it out of placement; the drain loop removes it once nothing is in
flight on it, or past `drain_timeout_s`, when the streams still running there are cut
(each ends with an `engine_removed` error event). A name that is added again while its
engine drains is added once the old one is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from narwhal.router.config import EngineSpec
from narwhal.router.engines import Engine, Pool
from narwhal.router.fleet.rules import Rules
from narwhal.router.urls import redact

log = logging.getLogger("narwhal.fleet")

DRAIN_TICK_S = 0.1  # how often draining engines are looked at


class Conflict(ValueError):
    """An engine of that name exists with another URL, dialect or key."""


class Unknown(KeyError):
    """No engine of that name."""


class Hooks:
    """Who hears of an engine that joined, was cut (its streams must end now) or left
    (wired once, at start)."""

    def __init__(self) -> None:
        self.added: list[Callable[[Engine], None]] = []
        self.cut: list[Callable[[Engine], None]] = []
        self.removed: list[Callable[[Engine], None]] = []


@dataclass
class _Draining:
    engine: Engine
    deadline: float
    cut: bool = False


class Membership:
    def __init__(
        self,
        pool: Pool,
        drain_timeout_s: float,
        hooks: Hooks | None = None,
        rules: Rules | None = None,
    ) -> None:
        self.pool = pool
        self.rules = rules or Rules()  # for engines from any source but the config file
        self.drain_timeout_s = drain_timeout_s
        self.hooks = hooks or Hooks()
        self._draining: dict[str, _Draining] = {}
        self._next: dict[str, tuple[EngineSpec, str]] = {}  # re-added while draining
        self._changed = asyncio.Event()

    def add(self, spec: EngineSpec, source: str) -> Engine | None:
        """The engine `spec` names, serving: added, or the one already there (the same
        spec). None when its name is still draining: it is added once that one is gone.
        Raises Conflict when a serving engine of that name has another spec."""
        assert spec.url is not None, "engines added at runtime are called, not launched"
        e = self.pool.named(spec.name)
        if e is not None:
            if e.draining:
                self._next[spec.name] = (spec, source)
                return None
            if e.spec != spec:
                raise Conflict(
                    f"engine {spec.name!r} exists with another URL, dialect or key: drain it "
                    "first (DELETE /admin/engines/NAME)"
                )
            return e
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        rules = None if source == "config" else self.rules
        e = Engine(spec, spec.url.rstrip("/"), api_key=key, source=source, rules=rules)
        for hook in self.hooks.added:
            hook(e)
        self.pool.add(e)
        log.info("engine %s added (%s, %s)", e.name, source, redact(e.url))
        self.pool.notify()
        return e

    def drain(self, name: str, why: str) -> Engine:
        """Nothing new for `name`; removed when idle or after the drain timeout."""
        e = self.pool.named(name)
        if e is None:
            raise Unknown(name)
        self._next.pop(name, None)  # a re-add before this drain is void too
        if not e.draining:
            e.draining = True
            self._draining[name] = _Draining(e, time.monotonic() + self.drain_timeout_s)
            log.info("engine %s draining (%s): %d in flight", name, why, e.inflight)
            self._changed.set()
        return e

    def replace(self, spec: EngineSpec, source: str) -> None:
        """`spec` for an engine a source changed (a key's new value): the old one drains and
        the new one is added once it is gone."""
        e = self.pool.named(spec.name)
        if e is not None and e.spec != spec and not e.draining:
            self.drain(spec.name, "its registration changed")
        self.add(spec, source)

    def names(self, source: str) -> set[str]:
        """The serving (not draining) engines a source added."""
        return {e.name for e in self.pool.engines if e.source == source and not e.draining}

    def describe(self) -> list[dict[str, object]]:
        out = []
        for e in self.pool.engines:
            d = e.describe(detail=True)
            drain = self._draining.get(e.name)
            if drain is not None:
                d["drain_left_s"] = round(max(0.0, drain.deadline - time.monotonic()), 1)
            out.append(d)
        return out

    async def drain_forever(self) -> None:
        """Removes drained engines: idle ones at once, the rest at their deadline (their
        streams cut first)."""
        while True:
            if not self._draining:
                self._changed.clear()
                await self._changed.wait()
            await asyncio.sleep(DRAIN_TICK_S)
            now = time.monotonic()
            for name, d in list(self._draining.items()):
                e = d.engine
                if e.inflight and now < d.deadline:
                    continue
                if e.inflight and not d.cut:
                    d.cut = True
                    e.cut = True
                    log.warning(
                        "engine %s: drain timeout (%gs) passed with %d in flight: cutting them",
                        name,
                        self.drain_timeout_s,
                        e.inflight,
                    )
                    for hook in self.hooks.cut:
                        hook(e)  # the relay closes its connections: the streams end
                    continue
                if e.inflight and now < d.deadline + CUT_GRACE_S:
                    continue  # cut streams end within a read
                await self._remove(name, d)

    async def _remove(self, name: str, d: _Draining) -> None:
        del self._draining[name]
        e = d.engine
        self.pool.remove(e)
        for hook in self.hooks.removed:
            hook(e)
        if e.managed is not None:
            await e.managed.stop()  # a LexiEngine this router ran: its process goes too
        log.info("engine %s removed", name)
        nxt = self._next.pop(name, None)
        if nxt is not None:
            self.add(*nxt)


# After the cut, streams still counted in flight (a client slow to take its error event)
# no longer hold the engine's removal back.
CUT_GRACE_S = 5.0
