"""Admission: the retention limit, the admission queue and per-engine phase concurrency.

A request holds a retention seat from intake to its last byte. Placement takes a prefill
seat on an engine; the first token moves it to decode. Requests that find no room wait in
a FIFO queue of bounded size and bounded wait, oldest placed first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from narwhal.errors import ApiError
from narwhal.router.engines import Engine, Pool


def retry_after(message: str, status: int = 429, code: str = "rate_limited",
                type: str = "rate_limit_error") -> ApiError:
    return ApiError(status, message, type=type, code=code, headers={"retry-after": "1"})


class Expired(Exception):
    """The admission wait or the request deadline ran out before placement."""


class Admission:
    def __init__(self, pool: Pool, retention_limit: int, queue_size: int, wait_s: float) -> None:
        self.pool = pool
        self.retention_limit = retention_limit
        self.queue_size = queue_size
        self.wait_s = wait_s
        self.retained = 0
        self._queue: deque[asyncio.Future[Engine]] = deque()

    @property
    def queued(self) -> int:
        return sum(1 for f in self._queue if not f.done())

    def retain(self) -> None:
        if self.retained >= self.retention_limit:
            raise retry_after("the router holds as many requests as it may; retry shortly",
                              code="retention_full")
        self.retained += 1

    def release_retention(self) -> None:
        self.retained -= 1

    async def place(self, deadline: float, prefer: Engine | None = None) -> Engine:
        """An engine with a prefill seat taken, or `Expired`, or a refusal."""
        if not self.pool.eligible():
            raise retry_after("no engine can take work now", status=503,
                              code="backend_unavailable", type="server_error")
        if not self.queued:
            e = self.pool.pick(prefer)
            if e is not None:
                e.prefill += 1
                return e
        if self.queued >= self.queue_size:
            raise retry_after("the admission queue is full; retry shortly", code="queue_full")
        fut: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        self._drain()
        timeout = min(self.wait_s, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(timeout, 0))
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():
                self.leave_prefill(fut.result())  # placed just as we gave up
            else:
                fut.cancel()
            if isinstance(e, asyncio.TimeoutError):
                raise Expired from None
            raise

    def _drain(self) -> None:
        while self._queue:
            if self._queue[0].done():
                self._queue.popleft()
                continue
            e = self.pool.pick()
            if e is None:
                return
            e.prefill += 1
            self._queue.popleft().set_result(e)

    def to_decode(self, e: Engine) -> None:
        e.prefill -= 1
        e.decode += 1
        self._drain()

    def leave_prefill(self, e: Engine) -> None:
        e.prefill -= 1
        self._drain()

    def leave_decode(self, e: Engine) -> None:
        e.decode -= 1
        self._drain()

    async def drain_forever(self) -> None:
        """Place queued requests when an engine recovers (capacity changes without a release)."""
        while True:
            await self.pool.changed.wait()
            self.pool.changed.clear()
            self._drain()
