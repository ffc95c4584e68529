"""Generation slots and the wait queue in front of them (`--parallel`, `--queue-wait`)."""

from __future__ import annotations

import asyncio
from collections import deque


class Busy(Exception):
    """No slot freed up within `--queue-wait`."""


class Slots:
    def __init__(self, total: int, queue_wait: float) -> None:
        self.total = total
        self.queue_wait = queue_wait
        self.busy = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        """Take a slot, waiting at most `queue_wait`; raises `Busy`. Oldest waiter first."""
        if self.busy < self.total and not self.waiting:
            self.busy += 1
            return
        if self.queue_wait <= 0:
            raise Busy
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_wait)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we gave up
            else:
                fut.cancel()
            self._prune()
            if isinstance(e, asyncio.TimeoutError):
                raise Busy from None
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; `busy` is unchanged
                return
        self.busy -= 1

    def _prune(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
