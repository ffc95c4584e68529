"""`--fence`: refuse work from a router that is no longer the leader.

Each router request carries the leader's fencing token (`x-narwhal-fence`: the leader key's
creation revision in etcd, which only grows across elections). The engine remembers the
highest it has accepted and refuses a lower one, or none, with 409 `fenced` before a slot is
taken: a deposed leader that has not noticed yet cannot have its requests served here once
the new leader has been. With `--fence-etcd URL --fence-key KEY` the engine also reads the
current holder from etcd itself, so it refuses a deposed leader even before the new one has
sent it anything.

Who may raise the floor: a token is a number anyone can write, and one of 2^63-1 would
fence every real leader out. So a token above the floor counts only once it is verified:
in etcd (`--fence-etcd`: it must be the leader key's), or carried with the routers' fence
secret (`--fence-secret`, sent as `x-narwhal-fence-secret`). `--fence` needs one of them.

Active routers (`ha.mode: active`) each place under a token of their own, the creation
revision of their member key (`<key's folder>/routers/<name>`), and name themselves beside
it (`x-narwhal-fence-router`). The engine keeps a floor per router name: a router's older
token is refused once a newer one of the same name was accepted, and with --fence-etcd a
token counts only while it is the member key's in etcd: the follower reads the routers'
folder too, and a router whose key is gone (its lease lapsed: it is partitioned or dead) is
refused from then on, whatever it still believes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from narwhal import asgi
from narwhal.asgi import Scope
from narwhal.errors import ApiError, unavailable
from narwhal.etcd import Etcd, EtcdError

log = logging.getLogger("lexi.fence")


MAX_TOKEN = 2**63 - 1  # etcd revisions are int64
# Active routers' floors kept (the least recently used forgotten first: with --fence-etcd
# a forgotten one is verified again; without, only the fence secret raises it).
MAX_ROUTERS = 4096
MAX_ROUTER_NAME = 256


def router_name(raw: str | None) -> str | None:
    """An active router's name as it says it (`x-narwhal-fence-router`): printable ASCII
    without spaces, at most MAX_ROUTER_NAME characters; None when it is not one."""
    if raw is None or not (0 < len(raw) <= MAX_ROUTER_NAME) or not raw.isascii():
        return None
    return raw if all(33 <= ord(c) < 127 for c in raw) else None


def parse(raw: str | None) -> int | None:
    """A fencing token: ASCII digits only (`str.isdigit` takes `²` and other digits int()
    refuses), 1 to 2^63-1 (etcd revisions start at 1 and are int64)."""
    if raw is None or not (0 < len(raw) <= 19 and raw.isascii() and raw.isdigit()):
        return None
    token = int(raw)
    return token if 0 < token <= MAX_TOKEN else None


def _read_state(path: Path) -> int:
    """The floor a previous run kept; 0 when there is none yet. A file that is there but
    unreadable stops the engine: serving with a forgotten floor is what it exists to avoid."""
    try:
        raw = path.read_text().strip()
    except FileNotFoundError:
        return 0
    token = parse(raw)
    if token is None:
        raise ValueError(f"--fence-state {path}: not a fencing token: {raw[:40]!r}")
    return token


def _write_state(path: Path, token: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{token}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fenced(message: str) -> ApiError:
    return ApiError(409, message, type="invalid_request_error", code="fenced")


def _unknown(message: str) -> ApiError:
    """The engine cannot judge the token now (etcd not read): retry, not a refusal."""
    return unavailable(message, "fence_unknown")


class Fence:
    def __init__(
        self,
        on_token: Callable[[int], None] | None = None,
        state: str | None = None,
        etcd: Etcd | None = None,
        key: str = "",
        secret: str | None = None,
    ) -> None:
        self._secret = secret.encode() if secret else None
        self.on_token = on_token or (lambda _: None)
        self.state = Path(state) if state else None
        self.highest = _read_state(self.state) if self.state else 0
        if self.highest:
            self.on_token(self.highest)
        # With --fence-etcd, the floor is unknown until etcd has been read once: fenced
        # work waits (503) rather than be judged against a floor a restart forgot.
        self.unsure: str | None = (
            "the leader's token has not been read from etcd yet" if etcd is not None else None
        )
        self._etcd = etcd
        self._key = key.encode()
        self._routers_key = key.rsplit("/", 1)[0].encode() + b"/routers/"
        # Active routers: the floor of each name, and the names whose member key went (with
        # the highest token seen of each: that one and below are refused).
        self._floors: OrderedDict[str, int] = OrderedDict()
        self._gone: OrderedDict[str, int] = OrderedDict()

    def check(self, scope: Scope) -> int:
        """The request's token, refused (409 `fenced`) when it is missing, not a token, or
        older than the highest accepted. It does not raise the floor: `raise_to` does, once
        the request is otherwise accepted (a garbage body must not fence the leader)."""
        if self.unsure is not None:
            raise _unknown(f"this engine cannot judge fencing tokens yet: {self.unsure}")
        raw = asgi.header(scope, b"x-narwhal-fence")
        token = parse(raw)
        if token is None:
            raise _fenced(
                "this engine serves only the leading router (--fence): the request carries "
                "no fencing token (x-narwhal-fence: ASCII digits, 1 to 2^63-1)"
            )
        router = asgi.header(scope, b"x-narwhal-fence-router")
        if router is not None:
            self._check_router(router, token)
        elif token < self.highest:
            raise _fenced(
                f"fencing token {token} is older than {self.highest}: another router leads now"
            )
        return token

    def _check_router(self, raw: str, token: int) -> None:
        name = router_name(raw)
        if name is None:
            raise _fenced(
                "x-narwhal-fence-router is not a router's name (printable ASCII, no spaces, "
                f"at most {MAX_ROUTER_NAME} characters)"
            )
        gone = self._gone.get(name)
        if gone is not None and token <= gone:
            raise _fenced(f"router {name}'s member key is gone from etcd: its lease lapsed")
        floor = self._floors.get(name, 0)
        if token < floor:
            raise _fenced(f"fencing token {token} is older than router {name}'s {floor}")

    async def take(self, token: int, scope: Scope | None = None) -> None:
        """The floor rises to `token`, for a request the engine has accepted. With
        --fence-etcd, a token above the floor counts only once etcd says it is the leader
        key's (a newer election than the follower has seen): a token nobody was issued is
        refused and raises nothing. Without etcd, only a request that carries the fence
        secret may raise it."""
        router = router_name(asgi.header(scope, b"x-narwhal-fence-router")) if scope else None
        if router is not None:
            await self._take_router(router, token, scope)
            return
        if self._etcd is None and token > self.highest and not self._trusted(scope):
            raise _fenced(
                f"fencing token {token} is above the floor {self.highest}, and only a router "
                "that carries the fence secret (x-narwhal-fence-secret) may raise it"
            )
        if self._etcd is not None and token > self.highest:
            try:
                kv = await self._etcd.get(self._key)
            except EtcdError as e:
                why = f"fencing token {token} could not be checked against etcd: {e}"
                raise _unknown(why) from None
            current = kv.create_revision if kv is not None else 0
            self.raise_to(current)
            if token != current:
                raise _fenced(f"fencing token {token} is not the leader's in etcd ({current})")
        self.raise_to(token)

    async def _take_router(self, name: str, token: int, scope: Scope | None) -> None:
        """An active router's floor rises to `token`: verified as its member key's in etcd,
        or carried with the fence secret."""
        floor = self._floors.get(name, 0)
        if token <= floor:
            self._floors.move_to_end(name)
            return
        if self._etcd is None:
            if not self._trusted(scope):
                raise _fenced(
                    f"fencing token {token} of router {name} is above its floor {floor}, and "
                    "only a router that carries the fence secret may raise it"
                )
        else:
            try:
                kv = await self._etcd.get(self._routers_key + name.encode())
            except EtcdError as e:
                why = f"router {name}'s token {token} could not be checked against etcd: {e}"
                raise _unknown(why) from None
            if kv is None or kv.create_revision != token:
                if kv is None:
                    self._bury(name, token)
                elif kv.create_revision > token:
                    self._floor(name, kv.create_revision)
                held = "no member key" if kv is None else f"token {kv.create_revision}"
                raise _fenced(f"fencing token {token} is not router {name}'s in etcd ({held})")
        self._floor(name, token)

    def _floor(self, name: str, token: int) -> None:
        if token > self._floors.get(name, 0):
            log.info("fence: router %s accepted at token %d and above", name, token)
            self._floors[name] = token
        self._floors.move_to_end(name)
        while len(self._floors) > MAX_ROUTERS:
            self._floors.popitem(last=False)

    def _bury(self, name: str, token: int) -> None:
        """Router `name`'s member key is gone: its tokens up to `token` are refused."""
        if token > self._gone.get(name, 0):
            self._gone[name] = token
        self._gone.move_to_end(name)
        while len(self._gone) > MAX_ROUTERS:
            self._gone.popitem(last=False)

    def _trusted(self, scope: Scope | None) -> bool:
        if self._secret is None or scope is None:
            return False
        given = (asgi.header(scope, b"x-narwhal-fence-secret") or "").encode("latin-1")
        return hmac.compare_digest(given, self._secret)

    def raise_to(self, token: int) -> None:
        if token > self.highest:
            log.info("fence: accepting fencing token %d and above (was %d)", token, self.highest)
            if self.state is not None:
                _write_state(self.state, token)  # on disk before any request is judged by it
            self.highest = token
            self.on_token(token)

    async def _follow_routers(self, etcd: Etcd) -> None:
        """Active routers whose member key went are refused from now on."""
        if not self._floors:
            return
        standing = {
            k[len(self._routers_key) :].decode(errors="replace"): kv.create_revision
            for k, kv in await etcd.under(self._routers_key)
        }
        for name, floor in list(self._floors.items()):
            now = standing.get(name)
            if now is None:
                log.info("fence: router %s left etcd: its token %d is refused", name, floor)
                del self._floors[name]
                self._bury(name, floor)
            elif now > floor:
                self._floor(name, now)

    async def follow_etcd_forever(self, interval_s: float = 0.5) -> None:
        """The current leader key's token from etcd, as the floor."""
        etcd = self._etcd
        if etcd is None:
            return
        try:
            while True:
                try:
                    kv = await etcd.get(self._key)
                    if kv is not None:
                        self.raise_to(kv.create_revision)
                    await self._follow_routers(etcd)
                    self.unsure = None
                except EtcdError as e:
                    log.debug("fence: etcd not read: %s", e)
                await asyncio.sleep(interval_s)
        finally:
            await etcd.close()
