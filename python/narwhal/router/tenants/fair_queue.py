"""The order the admission queue places waiting requests in.

Higher classes first (`critical`, then `standard`, then `sheddable`). Within a class,
tenants take turns by the tokens they have been placed (start-time fair queuing, equal
weights): the next request is the backlogged tenant's that has been served least since it
last became backlogged, so one tenant's burst waits behind its own requests, not
everyone's. Within a tenant, the earliest deadline first. Requests without a tenant share
one tenant's turn.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

T = TypeVar("T")

CLASSES = ("critical", "standard", "sheddable")
RANK = {name: i for i, name in enumerate(CLASSES)}


class _Class(Generic[T]):
    __slots__ = ("served", "tenants", "vtime")

    def __init__(self) -> None:
        # Per backlogged tenant: its waiting requests, (deadline, seq, cost, item).
        self.tenants: dict[str, list[tuple[float, int, int, T]]] = {}
        self.served: dict[str, float] = {}  # tokens placed, in virtual time
        self.vtime = 0.0  # where the last placed request's turn began


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._classes: list[_Class[T]] = [_Class() for _ in CLASSES]
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, item: T, rank: int, tenant: str, deadline: float, cost: int) -> None:
        c = self._classes[rank]
        waiting = c.tenants.get(tenant)
        if waiting is None:
            # Newly backlogged: its turn starts now, not where it left off (a tenant idle
            # for an hour does not get an hour's worth of turns).
            waiting = c.tenants[tenant] = []
            c.served[tenant] = max(c.served.get(tenant, 0.0), c.vtime)
        heapq.heappush(waiting, (deadline, next(self._seq), max(1, cost), item))
        self._len += 1

    def peek(self) -> T | None:
        found = self._next()
        return None if found is None else found[1][0][3]

    def pop(self, served: bool = True) -> T:
        """The next item, out of the queue; `served=False`: it was not placed (its wait
        had ended), so its tenant's turn is not charged for it."""
        found = self._next()
        assert found is not None, "pop from an empty queue"
        c, waiting, tenant = found
        _, _, cost, item = heapq.heappop(waiting)
        if served:
            c.vtime = c.served[tenant]
            c.served[tenant] += cost
        if not waiting:
            del c.tenants[tenant]
        self._len -= 1
        return item

    def _next(self) -> tuple[_Class[T], list[tuple[float, int, int, T]], str] | None:
        for c in self._classes:
            if c.tenants:
                tenant = min(c.tenants, key=lambda t: (c.served[t], c.tenants[t][0][:2]))
                return c, c.tenants[tenant], tenant
        return None

    def items(self) -> list[T]:
        return [w[3] for c in self._classes for waiting in c.tenants.values() for w in waiting]
