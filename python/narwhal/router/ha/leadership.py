"""Leadership among several routers: an etcd lease, a leader key, a fencing token.

Without `ha` a router is its own leader. With it, routers campaign for one key on an etcd
lease: whoever creates the key leads, the others stand by and try again as soon as it is
gone (the lease lapsed, or the leader resigned). The leader's fencing token is the key's
creation revision, which only grows across elections; every request placed carries it to
the engine (`x-narwhal-fence`), and LexiEngine with `--fence` refuses a lower one.

A leader knows its lease only as of its last renewal: it places work only while
`renewed_at + TTL - margin` has not passed (on CLOCK_BOOTTIME, which keeps counting while the
machine is suspended, as etcd's clock does; the margin covers the request's
time on the wire and clock-rate skew), so it stops before etcd could have let the lease go
and a new leader could exist. Past that, or when etcd says the lease or the key is gone, or
when an engine refuses its token, it is fenced: it places nothing new, and campaigns again.

Every router, leading or not, says on its lease whether it reaches a healthy engine (a key
under `<key's folder>/routers/`). A leader that has reached none for `resign_unhealthy_s`
while another router does steps aside: it revokes its lease, so that router takes the key
at once, and stays out of elections for a cooldown unless no other router stands by. A
leader that nobody could replace better keeps the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable

import orjson

from narwhal.etcd import Etcd, EtcdError, KeyValue
from narwhal.router.config import HA

log = logging.getLogger("narwhal.leadership")

# CLOCK_MONOTONIC stops while the machine is suspended, etcd's lease does not: a leader
# woken from a suspend longer than its TTL would believe in a lease long gone.
_BOOT: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def _now() -> float:
    return time.clock_gettime(_BOOT) if _BOOT is not None else time.monotonic()


class Role(enum.Enum):
    LEADER = "leader"
    ACTIVE = "active"  # `mode: active`: placing beside the other routers
    STANDBY = "standby"
    FENCED = "fenced"
    STOPPING = "stopping"


class Leadership:
    def __init__(
        self,
        ha: HA | None,
        name: str | None = None,
        on_lead: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.ha = ha
        self.on_lead = on_lead  # run before a new leader places its first request
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.token: int | None = None  # the fencing token while leading
        self.key = ha.key.encode() if ha is not None else b""
        if ha is None:
            self.role, self.reason = Role.LEADER, ""
            self._valid_until = math.inf
        elif ha.active:
            self.role, self.reason = Role.STANDBY, "standby: joining the active routers"
            self._valid_until = 0.0
        else:
            self.role, self.reason = Role.STANDBY, "standby: campaigning for leadership"
            self._valid_until = 0.0
        self.url = ""  # `mode: active`: where the other routers reach this one
        self.etcd = Etcd(list(ha.etcd)) if ha is not None else None
        self.reaches: Callable[[], bool] = lambda: True  # whether a healthy engine answers
        self.on_step_aside: Callable[[], None] | None = None  # after stepping aside
        self._peers = ha.sibling("routers").encode() + b"/" if ha is not None else b""
        self._me = self._peers + self.name.encode()  # this router's member key
        if ha is not None and ha.active:
            # What guards this router's writes to etcd (admin edits): the key its token is
            # the creation revision of.
            self.key = self._me
        self._said: tuple[int, bool] | None = None  # (lease, reaches) last put in etcd
        self._unreached_since: float | None = None  # leading, and no healthy engine since
        self._out_until = 0.0  # stepped aside: no campaigning before this, if others stand by
        self._aside_reason = ""
        self._lease = 0
        self._woken = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None  # the leader key, while leading

    def serving(self) -> str | None:
        """None when this router may place work now; else why not (for 503 and /ready)."""
        if self.role is Role.LEADER or self.role is Role.ACTIVE:
            if _now() < self._valid_until:
                return None
            self.fence("the etcd lease could not be renewed in time")
        return self.reason

    def fence(self, why: str) -> None:
        if self.ha is None:
            # Its own leader, with no token: an engine with --fence refuses it every time
            # (a misconfiguration), and nothing would ever lift a latched fence.
            log.warning(
                "an engine refused this router's requests: %s (engines with --fence "
                "serve only routers with an `ha` section)",
                why,
            )
            return
        if self.role in (Role.LEADER, Role.ACTIVE, Role.STANDBY):
            log.warning("router fenced (token %s): %s", self.token, why)
            self.role, self.reason = Role.FENCED, f"fenced: {why}"
            self._valid_until = 0.0
            self._woken.set()

    @property
    def stopping(self) -> bool:
        return self.role is Role.STOPPING

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"role": self.role.value, "fencing_token": self.token}
        if self.ha is not None:
            out["mode"] = self.ha.mode
            out["key"] = self._me.decode(errors="replace") if self.ha.active else self.ha.key
        return out

    async def resign(self) -> None:
        """Stop leading at once (SIGTERM): the key goes with the lease, so a standby takes
        over without waiting for the TTL. In-flight streams carry on."""
        if self.ha is None:
            self.role, self.reason = Role.STOPPING, "stopping"
            return
        was = self.role
        self.role, self.reason = Role.STOPPING, "stopping: shutting down"
        self._valid_until = 0.0
        self._woken.set()
        if self._lease and self.etcd is not None:
            try:
                await self.etcd.revoke(self._lease)
                log.info("resigned (was %s): lease revoked", was.value)
            except EtcdError as e:
                log.warning(
                    "could not revoke the lease (it lapses in %ds): %s", self.ha.lease_ttl_s, e
                )

    async def run_forever(self) -> None:
        if self.ha is None or self.etcd is None:
            return
        ha, etcd = self.ha, self.etcd
        key, me = ha.key.encode(), self.name.encode()
        every = ha.lease_ttl_s / 3
        while not self.stopping:
            try:
                if not self._lease:
                    sent = _now()
                    self._lease = await etcd.grant(ha.lease_ttl_s)
                    lease_until = sent + ha.lease_ttl_s - ha.margin_s
                else:
                    sent = _now()
                    ttl = await etcd.keep_alive(self._lease)
                    if ttl <= 0:
                        self._lease = 0
                        if self.role in (Role.LEADER, Role.ACTIVE):
                            self.fence("the etcd lease expired")
                        continue
                    lease_until = sent + ttl - ha.margin_s
                if self.stopping:  # resigned while the grant was out: nobody else revokes it
                    await self._revoke_quietly()
                    break
                reaches = self.reaches()
                if ha.active:
                    await self._stand(lease_until, reaches)
                    await self._pause(every if self.role is Role.ACTIVE else min(every, 0.25))
                    continue
                await self._say(reaches)
                if await self._sitting_out():
                    continue
                created, kv = await etcd.create(key, me, self._lease)
                ours = created or (kv is not None and kv.lease == self._lease)
                if self.stopping:  # resigned while this round was out
                    await self._revoke_quietly()
                    break
                if ours and kv is not None and await self._steps_aside(reaches):
                    continue
                if ours and kv is not None:
                    if self.role is not Role.LEADER or self.token != kv.create_revision:
                        log.info("leading with fencing token %d", kv.create_revision)
                        if self.on_lead is not None and self.role is not Role.LEADER:
                            await self.on_lead()
                            if self.stopping:  # resigned during the hook: never LEADER
                                await self._revoke_quietly()
                                break
                    self.token = kv.create_revision
                    self._valid_until = lease_until
                    self.role, self.reason = Role.LEADER, ""
                    self._watch_key(key, kv.create_revision)
                else:
                    if self.role is Role.LEADER:
                        self.fence("another router holds the leader key")
                    self.token = None
                    self.role, self.reason = Role.STANDBY, _standby_reason(ha.key, kv)
            except EtcdError as e:
                if self.role is Role.STANDBY:
                    self.reason = f"standby: etcd unreachable ({e})"
                # A leader keeps leading until its proven lease runs out (serving()).
            # A standby looks again soon (it takes over as the key goes); a leader
            # renews at a third of its TTL.
            await self._pause(every if self.role is Role.LEADER else min(every, 0.25))

    async def _stand(self, lease_until: float, reaches: bool) -> None:
        """`mode: active`: this router's member key on its lease; while it holds it, it
        places, under the key's creation revision as its fencing token."""
        assert self.etcd is not None
        value = orjson.dumps({"reaches_engines": reaches, "url": self.url})
        created, kv = await self.etcd.create(self._me, value, self._lease)
        if kv is None:
            return  # deleted between the compare and the read: created next round
        if not created and kv.lease != self._lease:
            # Its name is another process's (a copy of its config with the same name?), or
            # its old lease's key has not lapsed yet: it waits for the key to be its own.
            if self.role is Role.ACTIVE:
                self.fence("another lease holds this router's member key")
            self.token = None
            self.role, self.reason = Role.STANDBY, "standby: another lease holds this router's name"
            return
        if not created and kv.value != value:
            await self.etcd.put(self._me, value, self._lease)
        token = kv.create_revision
        if self.role is not Role.ACTIVE or self.token != token:
            log.info("active with fencing token %d", token)
            if self.on_lead is not None:
                await self.on_lead()  # the others' picture, before the first placement
            if self.stopping:
                await self._revoke_quietly()
                return
        self.token = token
        self._valid_until = lease_until
        self.role, self.reason = Role.ACTIVE, ""
        self._watch_key(self._me, token)

    async def peers(self) -> dict[str, str]:
        """`mode: active`: the other routers standing now, by name: where each is reached.
        Where two keys say one address, only the newer is a router: one address is one
        listening process, and the older key is a dead router's that has not lapsed yet
        (a router restarted at its address has a new name)."""
        assert self.etcd is not None
        newest: dict[str, tuple[int, str]] = {}  # url -> (create revision, name)
        for k, kv in await self.etcd.under(self._peers):
            name = k[len(self._peers) :].decode(errors="replace")
            try:
                url = orjson.loads(kv.value).get("url")
            except (orjson.JSONDecodeError, AttributeError):
                continue
            if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                continue
            if url not in newest or newest[url][0] < kv.create_revision:
                newest[url] = (kv.create_revision, name)
        return {name: url for url, (_, name) in newest.items() if name != self.name}

    async def _revoke_quietly(self) -> None:
        assert self.etcd is not None
        lease, self._lease = self._lease, 0
        if lease:
            with contextlib.suppress(EtcdError):  # else it lapses with its TTL
                await self.etcd.revoke(lease)

    async def _say(self, reaches: bool) -> None:
        """Tells the other routers, on this router's lease, whether it reaches an engine."""
        assert self.etcd is not None
        if self._said != (self._lease, reaches):
            value = orjson.dumps({"reaches_engines": reaches})
            await self.etcd.put(self._peers + self.name.encode(), value, self._lease)
            self._said = (self._lease, reaches)

    async def _others(self) -> dict[str, bool]:
        """The other routers standing now: whether each reaches an engine."""
        assert self.etcd is not None
        out = {}
        for k, kv in await self.etcd.under(self._peers):
            name = k[len(self._peers) :].decode(errors="replace")
            if name != self.name:
                try:
                    out[name] = orjson.loads(kv.value).get("reaches_engines") is True
                except (orjson.JSONDecodeError, AttributeError):
                    out[name] = False
        return out

    async def _sitting_out(self) -> bool:
        """Stepped aside a moment ago, with another router standing by: not campaigning."""
        if self.role is Role.LEADER or _now() >= self._out_until:
            return False
        others = await self._others()
        if not others:
            self._out_until = 0.0  # nobody else to lead: campaign after all
            return False
        assert self.ha is not None
        self.token = None
        self.role, self.reason = Role.STANDBY, self._aside_reason
        await self._pause(min(self.ha.lease_ttl_s / 3, 0.25))
        return True

    async def _steps_aside(self, reaches: bool) -> bool:
        """Leading: when no healthy engine has answered for `resign_unhealthy_s` and another
        router reaches one, revokes the lease (the key goes with it) and returns True."""
        assert self.ha is not None and self.etcd is not None
        now = _now()
        if reaches:
            self._unreached_since = None
            return False
        if self._unreached_since is None:
            self._unreached_since = now
        if now - self._unreached_since < self.ha.resign_unhealthy_s:
            return False
        better = sorted(n for n, reaches in (await self._others()).items() if reaches)
        if not better:
            return False  # nobody would do better: keep the key
        waited = now - self._unreached_since
        log.warning(
            "no healthy engine for %.0fs while %s reaches one: stepping aside", waited, better[0]
        )
        self._aside_reason = (
            f"standby: stepped aside, no healthy engine for {waited:.0f}s while {better[0]} "
            "reaches one"
        )
        self._unreached_since = None
        self._out_until = now + max(self.ha.resign_unhealthy_s, 2 * self.ha.lease_ttl_s)
        self.token = None
        self.role, self.reason = Role.STANDBY, self._aside_reason
        self._valid_until = 0.0
        if self._watch is not None:
            self._watch.cancel()
        await self._revoke_quietly()  # the key goes with it
        if self.on_step_aside is not None:
            self.on_step_aside()
        return True

    async def _pause(self, seconds: float) -> None:
        self._woken.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._woken.wait(), seconds)

    def _watch_key(self, key: bytes, token: int) -> None:
        """While leading with `token`, a change to the leader key (an operator deleted it,
        something put over it) ends this router's leadership at once, not at the next
        renewal a third of a TTL later, by when a standby has long taken over."""
        if self._watch is not None and not self._watch.done():
            if self._watch.get_name() == f"leader-key-{token}":
                return
            self._watch.cancel()
        self._watch = asyncio.create_task(self._watching(key, token), name=f"leader-key-{token}")

    async def _watching(self, key: bytes, token: int) -> None:
        assert self.etcd is not None
        while self.role in (Role.LEADER, Role.ACTIVE) and self.token == token:
            try:
                async for changes in self.etcd.watch(key, token + 1):
                    for c in changes:
                        if c.deleted or c.kv.create_revision != token:
                            what = "was deleted" if c.deleted else "was put over"
                            self.fence(f"the {self._kind} key {what}")
                            return
            except EtcdError as e:
                log.warning("watching the leader key: %s; reading it instead", e)
                with contextlib.suppress(EtcdError):
                    kv = await self.etcd.get(key)
                    if kv is None or kv.create_revision != token:
                        self.fence(f"the {self._kind} key changed")
                        return
            except Exception:  # a bug: said, and the watch goes on (renewal still checks)
                log.exception("watching the leader key failed")
            await asyncio.sleep(0.5)

    @property
    def _kind(self) -> str:
        return "member" if self.ha is not None and self.ha.active else "leader"

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.etcd is not None:
            await self.etcd.close()


def _standby_reason(key: str, kv: KeyValue | None) -> str:
    if kv is None:
        return "standby: campaigning for leadership"
    holder = kv.value.decode(errors="replace")[:200]
    if not kv.lease:
        # A router always puts it with a lease; this one never goes away by itself.
        return (
            f"standby: the leader key {key} is held without a lease by {holder!r}, which "
            "is not a router: delete it to let a router lead"
        )
    return f"standby: {holder} leads"
