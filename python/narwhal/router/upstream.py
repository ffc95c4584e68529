"""Upstream HTTP/1.1 client for completion requests: keep-alive connections to one engine.

An engine's streamed answer is one chunked response with (usually) one SSE frame per
chunk, so a general-purpose client spends a few Python calls per token de-framing it; each
connection here (`connection.py`) de-frames a whole socket read natively. Connections are
kept alive and reused, most recently used first; health probes and other rare calls stay
on aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from narwhal.router.connection import Connection, Exchange, UpstreamError
from narwhal.router.fleet.rules import Refused, Rules
from narwhal.router.urls import authorization

# An idle connection older than this is closed rather than reused.
_IDLE_S = 60.0


class Upstream:
    """Keep-alive connections to one engine base URL (http or https)."""

    def __init__(
        self,
        url: str,
        connect_timeout: float = 5.0,
        api_key: str | None = None,
        rules: Rules | None = None,
    ) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"unsupported engine URL {url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if u.scheme == "https" else None
        )
        self.prefix = u.path.rstrip("/")
        netloc = u.netloc.rpartition("@")[2]
        self._head = f"Host: {netloc}\r\nUser-Agent: narwhal\r\nContent-Type: application/json\r\n"
        auth = authorization(url, api_key)
        if auth is not None:
            self._head += f"Authorization: {auth}\r\n"
        self.rules = rules  # a runtime engine: only to the addresses they allow
        self.connect_timeout = connect_timeout
        self._free: list[Connection] = []
        self._all: set[Connection] = set()

    async def request(
        self,
        path: str,
        body: bytes,
        deadline: float | None = None,
        headers: str = "",
        before_send: Callable[[], None] | None = None,
    ) -> Exchange:
        """POST `body` to `path`; returns once the response head arrived. `headers`: more
        header lines, each ending in CRLF. `before_send` runs once a connection is ready,
        just before the request's bytes go (it may raise: nothing is sent).

        A reused connection that breaks before any response byte is retried once on a
        fresh one: the engine closed it while idle, so it never saw the request.
        """
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}{headers}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        for attempt in range(2):
            conn = self._reuse() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(deadline)
            if before_send is not None:
                try:
                    before_send()
                except BaseException:
                    self.idle(conn)  # nothing was sent on it: another request may use it
                    raise
            conn.start(head + body)
            try:
                while True:
                    d = conn.decoder
                    assert d is not None
                    if d.head_done:
                        return Exchange(conn)
                    if conn.error is not None:
                        raise conn.error
                    if conn.closed:
                        raise UpstreamError("the engine closed the connection before answering")
                    await conn.wait(deadline)
            except UpstreamError:
                conn.close()
                if reused and not conn.received:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _reuse(self) -> Connection | None:
        now = time.monotonic()
        while self._free:
            conn = self._free.pop()
            if not conn.closed and now - conn.idle_since < _IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, deadline: float | None) -> Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout
        if deadline is not None:
            timeout = min(timeout, max(deadline - loop.time(), 0.0))
        host = self.host
        if self.rules is not None:
            try:
                host = (await self.rules.resolve(self.host, self.port))[0]
            except Refused as e:
                raise UpstreamError(f"destination refused: {e}") from None
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(self),
                    host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                timeout,
            )
        except asyncio.TimeoutError:
            if deadline is not None and loop.time() >= deadline:
                raise
            raise UpstreamError(f"connecting to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._all.add(proto)
        return proto

    def idle(self, conn: Connection) -> None:
        conn.decoder = None
        conn.idle_since = time.monotonic()
        self._free.append(conn)
        # The oldest idle connections sit at the bottom; retire those past their time.
        while self._free and conn.idle_since - self._free[0].idle_since > _IDLE_S:
            self._free.pop(0).close()

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        if conn in self._free:
            self._free.remove(conn)

    @property
    def connections(self) -> int:
        """Open connections, busy and idle."""
        return len(self._all)

    def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._free.clear()
