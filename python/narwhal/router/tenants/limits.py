"""Per-tenant limits: requests a minute, tokens a minute, requests at once.

A request is let in when its tenant is under all three; it then counts against the
minute from when it was let in: one request, and its prompt's estimated tokens at once
(so a burst cannot pass the limit before the first answers come), replaced by what the
router measured (prompt and output tokens, the engine's token IDs where it gives them)
when the request ends. A request that ends after its entry left the window (a stream
longer than a minute) is charged then, at its end, what its entry did not hold: every
measured token counts in some minute. A tenant past a limit is refused with 429
`tenant_rate_limited` and `Retry-After`: the seconds until its window lets the request in.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from narwhal.errors import ApiError
from narwhal.router.endings import End

WINDOW_S = 60.0


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


class TenantLimited(ApiError):
    def __init__(self, tenant: str, reason: str, retry_after_s: float, detail: str) -> None:
        super().__init__(
            429,
            f"tenant {tenant!r} is over its {detail}; retry in {math.ceil(retry_after_s)} s",
            type="rate_limit_error",
            code="tenant_rate_limited",
            headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
        )
        self.reason = reason
        self.ended(End.TENANT)


class _Entry:
    __slots__ = ("at", "live", "requests", "tokens")

    def __init__(self, at: float, tokens: int, requests: int = 1) -> None:
        self.at = at
        self.tokens = tokens
        self.requests = requests  # 0: tokens charged late, at a long request's end
        self.live = True  # still in the window


class Tenant:
    """One tenant's last minute: an entry per request let in (when, its tokens)."""

    def __init__(self, name: str, limits: Limits) -> None:
        self.name = name
        self.limits = limits
        self.window: deque[_Entry] = deque()
        self.tokens = 0  # in the window
        self.requests = 0  # in the window
        self.inflight = 0

    def _expire(self, now: float) -> None:
        while self.window and now - self.window[0].at >= WINDOW_S:
            gone = self.window.popleft()
            gone.live = False
            self.tokens -= gone.tokens
            self.requests -= gone.requests

    def admit(self, estimate: int, now: float | None = None) -> Ticket:
        now = time.monotonic() if now is None else now
        self._expire(now)
        lim = self.limits
        if lim.max_concurrent is not None and self.inflight >= lim.max_concurrent:
            raise TenantLimited(
                self.name, "concurrency", 1.0, f"{lim.max_concurrent} requests at once"
            )
        if lim.rpm is not None and self.requests >= lim.rpm:
            wait = self._requests_free_in(now)
            raise TenantLimited(self.name, "rpm", wait, f"{lim.rpm} requests a minute")
        if lim.tpm is not None and self.tokens + estimate > lim.tpm:
            raise TenantLimited(
                self.name, "tpm", self._tokens_free_in(estimate, now), f"{lim.tpm} tokens a minute"
            )
        return self.count(estimate, now)

    def count(self, estimate: int, now: float | None = None) -> Ticket:
        """A request let in, counted in the window without a limit's check (one another
        active router let in: its limits were checked there, against this same count)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        entry = _Entry(now, estimate)
        self.window.append(entry)
        self.tokens += estimate
        self.requests += 1
        self.inflight += 1
        return Ticket(self, entry)

    def charge_late(self, tokens: int, now: float | None = None) -> None:
        """Tokens of a request whose entry already left the window, counted from now."""
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        self._expire(now)
        self.window.append(_Entry(now, tokens, 0))
        self.tokens += tokens

    def _requests_free_in(self, now: float) -> float:
        """Seconds until the window holds one request fewer than the limit."""
        assert self.limits.rpm is not None
        over = self.requests - self.limits.rpm
        for e in self.window:
            over -= e.requests
            if over < 0:
                return e.at + WINDOW_S - now
        return WINDOW_S

    def export(self, now: float) -> list[list[float]]:
        """The window as [seconds ago, tokens, requests] per second of it (clocks differ
        between routers; a second's grain keeps it 60 entries at most, whatever the
        request rate, and Retry-After is in whole seconds anyway)."""
        self._expire(now)
        buckets: dict[int, list[float]] = {}
        for e in self.window:
            age = int(now - e.at)
            b = buckets.setdefault(age, [age, 0, 0])
            b[1] += e.tokens
            b[2] += e.requests
        return sorted(buckets.values(), reverse=True)

    def load(self, buckets: list[list[float]], now: float) -> None:
        """Take over another router's window (its requests count here from now on)."""
        taken: list[_Entry] = []
        # A second a bucket: more than a minute's is no window of ours (etcd's value is
        # anyone's who can write there), and each bucket is one entry whatever its count.
        for b in buckets[: int(WINDOW_S) + 1]:
            if not (isinstance(b, list) and len(b) == 3):
                continue
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b):
                continue
            age, tokens, count = b
            if not (0 <= age < WINDOW_S and 0 <= tokens < 2**53 and 0 <= count <= 100_000):
                continue
            # The bucket's requests as one entry, as old as its oldest could be: they leave
            # the window no later than they would have on the last leader.
            taken.append(_Entry(now - age, int(tokens), int(count)))
        for e in self.window:
            e.live = False
        taken.sort(key=lambda e: e.at)
        self.window = deque(taken)
        self.tokens = sum(e.tokens for e in taken)
        self.requests = sum(e.requests for e in taken)

    def _tokens_free_in(self, estimate: int, now: float) -> float:
        """Seconds until the window holds room for `estimate` more tokens (a minute when
        it never will: a prompt larger than the limit itself)."""
        assert self.limits.tpm is not None
        need = self.tokens + estimate - self.limits.tpm
        for e in self.window:
            need -= e.tokens
            if need <= 0:
                return e.at + WINDOW_S - now
        return WINDOW_S


class Ticket:
    """A request let in: `end` with what it measured, once."""

    __slots__ = ("entry", "tenant")

    def __init__(self, tenant: Tenant, entry: _Entry) -> None:
        self.tenant = tenant
        self.entry: _Entry | None = entry

    def end(self, tokens: int | None, now: float | None = None) -> None:
        entry, self.entry = self.entry, None
        if entry is None:
            return
        t = self.tenant
        t.inflight -= 1
        if tokens is None:
            return
        t._expire(time.monotonic() if now is None else now)  # is its entry still in?
        if entry.live:
            t.tokens += tokens - entry.tokens
            entry.tokens = tokens
        else:  # it outlived its minute: what its entry did not hold is charged now
            t.charge_late(tokens - entry.tokens, now)
