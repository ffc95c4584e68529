"""`--fence`: refuse work from a router that is no longer the leader.

Each router request carries the leader's fencing token (`x-narwhal-fence`: the leader key's
creation revision in etcd, which only grows across elections). The engine remembers the
highest it has accepted and refuses a lower one, or none, with 409 `fenced` before a slot is
taken: a deposed leader that has not noticed yet cannot have its requests served here once
the new leader has been. With `--fence-etcd URL --fence-key KEY` the engine also reads the
current holder from etcd itself, so it refuses a deposed leader even before the new one has
sent it anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from narwhal import asgi
from narwhal.asgi import Scope
from narwhal.errors import ApiError
from narwhal.etcd import Etcd, EtcdError

log = logging.getLogger("lexi.fence")


MAX_TOKEN = 2**63 - 1  # etcd revisions are int64


def parse(raw: str | None) -> int | None:
    """A fencing token: ASCII digits only (`str.isdigit` takes `²` and other digits int()
    refuses), 1 to 2^63-1 (etcd revisions start at 1 and are int64)."""
    if raw is None or not (0 < len(raw) <= 19 and raw.isascii() and raw.isdigit()):
        return None
    token = int(raw)
    return token if 0 < token <= MAX_TOKEN else None


def _fenced(message: str) -> ApiError:
    return ApiError(409, message, type="invalid_request_error", code="fenced")


class Fence:
    def __init__(self, on_token: Callable[[int], None] | None = None) -> None:
        self.highest = 0
        self.on_token = on_token or (lambda _: None)

    def check(self, scope: Scope) -> int:
        """The request's token, refused (409 `fenced`) when it is missing, not a token, or
        older than the highest accepted. It does not raise the floor: `raise_to` does, once
        the request is otherwise accepted (a garbage body must not fence the leader)."""
        raw = asgi.header(scope, b"x-narwhal-fence")
        token = parse(raw)
        if token is None:
            raise _fenced(
                "this engine serves only the leading router (--fence): the request carries "
                "no fencing token (x-narwhal-fence: ASCII digits, 1 to 2^63-1)"
            )
        if token < self.highest:
            raise _fenced(
                f"fencing token {token} is older than {self.highest}: another router leads now"
            )
        return token

    def raise_to(self, token: int) -> None:
        if token > self.highest:
            log.info("fence: accepting fencing token %d and above (was %d)", token, self.highest)
            self.highest = token
            self.on_token(token)

    async def follow_etcd_forever(self, etcd: Etcd, key: str, interval_s: float = 0.5) -> None:
        """The current leader key's token from etcd, as the floor."""
        try:
            while True:
                try:
                    kv = await etcd.get(key.encode())
                    if kv is not None:
                        self.raise_to(kv.create_revision)
                except EtcdError as e:
                    log.debug("fence: etcd not read: %s", e)
                await asyncio.sleep(interval_s)
        finally:
            await etcd.close()
