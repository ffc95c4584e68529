"""Generation slots and the wait queue in front of them (`--parallel`, `--queue-wait`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

# A held prefix at least this long decides the pick on its own; shorter ones only break
# ties between slots that keep the busy ones equally packed (see `Slots`).
REUSE_WORTH = 128


class Busy(Exception):
    """No slot freed up within `--queue-wait`."""


class Slots:
    """Slot indices, handed out on the event loop.

    A free slot is picked by `prefer` (the prompt tokens it already holds) when that prefix
    is worth `REUSE_WORTH` tokens or more; otherwise by keeping the busy slots' indices
    close together, then by the prefix. llama.cpp's per-sequence KV decodes a step over the
    whole range of sequence IDs in it: 4 streams on slots 0,2,5,7 run ~25% slower than on
    0-3 (bench/README.md), which a short prefix's saved prefill does not pay back. A slot
    released while requests wait goes to the oldest waiter, whatever it holds.
    """

    def __init__(self, total: int, queue_wait: float) -> None:
        self.total = total
        self.queue_wait = queue_wait
        self.free = list(range(total))
        self._waiters: deque[asyncio.Future[int]] = deque()

    @property
    def busy(self) -> int:
        return self.total - len(self.free)

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self, prefer: Callable[[int], int]) -> int:
        """Take a slot, waiting at most `queue_wait`; raises `Busy`. Oldest waiter first."""
        if self.free and not self.waiting:
            slot = self._pick(prefer)
            self.free.remove(slot)
            return slot
        if self.queue_wait <= 0:
            raise Busy
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.queue_wait)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # the slot was handed over just as we gave up
            else:
                fut.cancel()
            self._prune()
            if isinstance(e, asyncio.TimeoutError):
                raise Busy from None
            raise

    def _pick(self, prefer: Callable[[int], int]) -> int:
        free = set(self.free)
        busy = [s for s in range(self.total) if s not in free]
        lo, hi = (min(busy), max(busy)) if busy else (self.total, -1)

        def key(slot: int) -> tuple[bool, int, int, int]:
            held = prefer(slot)
            span = max(hi, slot) - min(lo, slot)
            return (held >= REUSE_WORTH, -span, held, -slot)

        return max(self.free, key=key)

    def release(self, slot: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)  # hand the slot over
                return
        self.free.append(slot)

    def _prune(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
