"""Admission: the retention limit, the admission queue and per-engine phase concurrency.

A request holds a retention seat from intake to its last byte. `place()` gives it a lease on
an engine (a prefill seat; the first token moves it to decode) and takes it back at the
lease's exit: this module is the only writer of an engine's seat counters. Requests that
find no room wait in a queue of bounded size and bounded wait, placed in the order
`tenants.fair_queue` gives: higher classes first, tenants taking turns within a class,
the earliest deadline first within a tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from narwhal.errors import ApiError, unavailable
from narwhal.router.endings import End
from narwhal.router.engines import Engine, Pool
from narwhal.router.lease import Events, Lease, PeerSeat, Phase
from narwhal.router.request import Request
from narwhal.router.tenants.fair_queue import FairQueue


def retry_after(message: str, code: str) -> ApiError:
    """429, to retry in a second: the router is full now (the 503 is `errors.unavailable`)."""
    return ApiError(429, message, type="rate_limit_error", code=code, headers={"retry-after": "1"})


class Expired(Exception):
    """The admission wait or the request deadline ran out before placement."""


class BudgetSpent(Exception):
    """A request waiting for a seat can no longer have its first token within its TTFT
    budget: it is refused rather than placed late (`overrun_s`: by how much it would miss)."""

    def __init__(self, overrun_s: float) -> None:
        super().__init__(f"over the TTFT budget by {overrun_s:.2f}s")
        self.overrun_s = overrun_s


# Whether a waiting lease placed on an engine now still makes its TTFT budget (the policy's
# projection; None: every placement does).
Overrun = Callable[[Lease, Engine, float], float | None]


class Admission:
    def __init__(
        self,
        pool: Pool,
        retention_limit: int,
        queue_size: int,
        wait_s: float,
        events: Events | None = None,
        *,
        instead: Callable[[list[Engine]], Engine],
    ) -> None:
        self.pool = pool
        # The policy's choice where its plan's engine has no seat free (`Policy.instead`):
        # admission takes seats where it is told, and picks none itself.
        self.instead = instead
        self.events = events or Events()
        self.retention_limit = retention_limit
        self.queue_size = queue_size
        self.wait_s = wait_s
        self.retained = 0
        self._queue: FairQueue[tuple[asyncio.Future[None], Lease]] = FairQueue()
        # Set by a policy that holds a TTFT budget: how far past its budget a waiting
        # lease's first token would come if placed on an engine now (None: in time).
        self.overrun: Overrun | None = None

    @property
    def queued(self) -> int:
        if not len(self._queue):  # every request asks: the common case is none waiting
            return 0
        return sum(1 for f, _ in self._queue.items() if not f.done())

    def retain(self) -> None:
        if self.retained >= self.retention_limit:
            raise retry_after(
                "the router holds as many requests as it may; retry shortly", code="retention_full"
            ).ended(End.RETENTION)
        self.retained += 1

    def release_retention(self) -> None:
        self.retained -= 1

    def place(
        self,
        request: Request,
        arrived: float,
        deadline: float,
        *,
        prefer: Engine | None = None,
        tokens: int = 0,
        predicted_s: float | None = None,
        exclude: frozenset[str] = frozenset(),
        ttft_by: float | None = None,
        own_s: float | None = None,
    ) -> Placing:
        """A lease on an engine with room (waiting in the queue for one if need be), given
        back when the block exits; or `Expired`, `BudgetSpent` (its first token can no
        longer come by `ttft_by`), or a refusal. `predicted_s` is kept only if the lease
        lands on `prefer` (the engine it was projected for)."""
        lease = Lease(
            self,
            self.events,
            request,
            arrived,
            deadline,
            tokens=tokens,
            predicted_s=predicted_s,
            prefer=prefer,
            exclude=exclude,
            ttft_by=ttft_by,
            own_s=own_s,
        )
        return Placing(self, lease)

    @contextlib.asynccontextmanager
    async def place_on(
        self,
        e: Engine,
        request: Request,
        arrived: float,
        deadline: float,
        tokens: int = 0,
        predicted_s: float | None = None,
    ) -> AsyncIterator[Lease | None]:
        """A lease on `e` now, or None when it has no room or others are waiting."""
        lease = Lease(
            self,
            self.events,
            request,
            arrived,
            deadline,
            tokens=tokens,
            predicted_s=predicted_s,
            prefer=e,
        )
        if self.queued or self._pick(e) is not e:
            yield None
            return
        self._take(lease, e)
        try:
            yield lease
        finally:
            lease.release()

    async def _seat(self, lease: Lease) -> None:
        if not any(e.name not in lease.exclude for e in self.pool.eligible()):
            raise unavailable("no engine can take work now", "backend_unavailable").ended(
                End.BACKEND_UNAVAILABLE
            )
        if not self.queued:
            e = self._pick(lease.prefer, lease.exclude)
            if e is not None:
                self._take(lease, e)
                return
        if self.queued >= self.queue_size:
            full = retry_after("the admission queue is full; retry shortly", code="queue_full")
            raise full.ended(End.QUEUE_FULL)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cost = lease.tokens or lease.request.estimated_prompt_tokens()
        st = lease.request.standing
        self._queue.push((fut, lease), st.rank, st.tenant, lease.deadline, cost)
        self._enqueue(lease)
        self._drain()
        now = time.monotonic()
        timeout = min(self.wait_s, lease.deadline - now)
        # The last moment a seat could still give it its first token in time: its own
        # prefill has to fit between the seat and `ttft_by`.
        give_up = None if lease.ttft_by is None else lease.ttft_by - (lease.own_s or 0.0) - now
        if give_up is not None:
            timeout = min(timeout, give_up)
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(timeout, 0))
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                lease.release()  # placed just as we gave up
            else:
                fut.cancel()
            if isinstance(e, asyncio.TimeoutError):
                if give_up is not None and timeout == give_up:
                    raise BudgetSpent(lease.own_s or 0.0) from None
                raise Expired from None
            raise
        finally:
            self._unqueue(lease)

    def _pick(
        self, prefer: Engine | None = None, exclude: frozenset[str] = frozenset()
    ) -> Engine | None:
        """Where a seat is taken now: `prefer` (the policy's choice) if it has phase room,
        else where the policy says among the eligible engines that have (none named in
        `exclude`); None when none has. The seat counters it reads are this module's."""
        pool = self.pool
        room = [
            e
            for e in pool.eligible()
            if e.prefill < pool.prefill_limit
            and e.decode < pool.decode_limit
            and e.name not in exclude
        ]
        if not room:
            return None
        if prefer is not None and prefer in room:
            return prefer
        return self.instead(room)

    def _enqueue(self, lease: Lease) -> None:
        """A waiting lease's prompt counts as prefill ahead on the engine it was judged
        for, in its class, until it leaves the queue."""
        e = lease.prefer
        if e is not None and lease.tokens:
            e.queued_tokens[lease.request.standing.rank] += lease.tokens
            e.queued_sq[lease.request.standing.rank] += lease.tokens * lease.tokens
            lease.queued_on = e

    def _unqueue(self, lease: Lease) -> None:
        e, lease.queued_on = lease.queued_on, None
        if e is not None:
            e.queued_tokens[lease.request.standing.rank] -= lease.tokens
            e.queued_sq[lease.request.standing.rank] -= lease.tokens * lease.tokens

    def _take(self, lease: Lease, e: Engine) -> None:
        """The one place a seat is taken."""
        _into_prefill(e, lease.tokens)
        lease.engine = e
        lease.ahead = e.prefill - 1
        lease.firsts_seen = e.firsts
        lease.phase = Phase.PREFILL
        if e is not lease.prefer:
            lease.predicted_s = None  # projected for another engine
        if lease.predicted_s is not None:
            # Due when its projection said, which counted its wait in the router's queue
            # (not that again from now), and no sooner than its own prefill from now.
            e.prefill_due[lease] = max(
                lease.projected_at + lease.predicted_s, time.monotonic() + (lease.own_s or 0.0)
            )

    def to_decode(self, lease: Lease) -> None:
        e = lease.on
        _out_of_prefill(e, lease, lease.tokens)
        e.decode += 1
        m = lease.measured
        # Prefill is first come, first served: where every prompt ahead of it had its first
        # token before it (and no later one did), its own prefill began at the last of
        # those or when it was sent. Under load no prompt has its engine alone, and its own
        # time is still measured, long prompts included. (A step the two share counts for
        # the earlier prompt: one sample long by as much as the next is short.)
        if m.sent_at and m.first_at:
            self._own_prefill(lease, m.first_at)
        e.firsts += 1
        e.first_at = max(e.first_at, m.first_at)
        lease.phase = Phase.DECODE
        self._drain()

    @staticmethod
    def _own_prefill(lease: Lease, until: float) -> bool:
        """How long its own prefill ran until `until` (`lease.prefill_s`), where that can be
        told: every prompt ahead of it there had its first token."""
        e, m = lease.on, lease.measured
        if e.firsts - lease.firsts_seen != lease.ahead:
            return False
        lease.queued = lease.ahead > 0 and e.first_at > m.sent_at
        lease.prefill_s = until - (e.first_at if lease.queued else m.sent_at)
        return True

    def release(self, lease: Lease) -> None:
        """The one place a seat is given back (a lease's exit, once)."""
        e = lease.on
        if lease.phase is Phase.PREFILL:
            # Cut before its first token: its prefill takes longer than it ran.
            if lease.measured.sent_at:
                lease.prefill_cut = self._own_prefill(lease, time.monotonic())
            _out_of_prefill(e, lease, lease.tokens)
        elif lease.phase is Phase.DECODE:
            e.decode -= 1
        lease.phase = Phase.DONE
        self._drain()

    # -- seats another active router took (router/peering) ------------------------------
    def seat_elsewhere(self, w: PeerSeat, predicted_s: float | None) -> None:
        """Another router placed work on `w.on`: it holds a seat there as this router's own
        would, and its prompt is prefill ahead of what this router places next."""
        e = w.on
        _into_prefill(e, w.tokens)
        if predicted_s is not None:
            e.prefill_due[w] = time.monotonic() + predicted_s
        w.phase = Phase.PREFILL

    def elsewhere_decoding(self, w: PeerSeat) -> None:
        """Its first token came (as the other router saw it)."""
        if w.phase is not Phase.PREFILL:
            return
        e = w.on
        _out_of_prefill(e, w, w.tokens)
        e.decode += 1
        e.firsts += 1  # the prompts ahead of this router's own had their first token
        e.first_at = max(e.first_at, time.monotonic())
        w.phase = Phase.DECODE

    def elsewhere_done(self, w: PeerSeat) -> None:
        """It ended, or its router is gone: its seat is free."""
        e = w.on
        if w.phase is Phase.PREFILL:
            _out_of_prefill(e, w, w.tokens)
        elif w.phase is Phase.DECODE:
            e.decode -= 1
        w.phase = Phase.DONE
        self._drain()

    def _drain(self) -> None:
        q = self._queue
        while len(q):
            top = q.peek()
            assert top is not None
            fut, lease = top
            if fut.done():
                q.pop(served=False)
                continue
            e = self._pick(lease.prefer, lease.exclude)
            if e is None:
                return  # the next in turn waits for room it may take, and the rest behind it
            self._unqueue(lease)
            late = self.overrun(lease, e, time.monotonic()) if self.overrun else None
            if late is not None:
                # Its wait spent its budget: refused now, never placed to miss it.
                q.pop(served=False)
                fut.set_exception(BudgetSpent(late))
                continue
            q.pop()
            self._take(lease, e)
            fut.set_result(None)

    def turn_away(self, refusal: Callable[[], ApiError]) -> None:
        """Everyone waiting in the queue is refused now (this router stopped leading: a
        wait that outlasted the shutdown's grace would end in a reset instead)."""
        while len(self._queue):
            fut, _ = self._queue.pop(served=False)
            if not fut.done():
                fut.set_exception(refusal())

    async def drain_forever(self) -> None:
        """Place queued requests when an engine recovers (capacity changes without a release)."""
        while True:
            await self.pool.changed.wait()
            self.pool.changed.clear()
            self._drain()


def _into_prefill(e: Engine, tokens: int) -> None:
    """A prompt of `tokens` takes a prefill seat on `e`."""
    e.prefill += 1
    e.prefill_tokens += tokens
    e.prefill_sq += tokens * tokens


def _out_of_prefill(e: Engine, seat: Lease | PeerSeat, tokens: int) -> None:
    """It leaves its prefill seat on `e` (its first token came, or it ended)."""
    e.prefill -= 1
    e.prefill_tokens -= tokens
    e.prefill_sq -= tokens * tokens
    e.prefill_due.pop(seat, None)


class Placing:
    """`async with admission.place(...) as lease`: seated on entry, given back on exit. A
    class, not a generator-based context manager: one of these per request, and the
    generator machinery cost more than the seat (bench/router_profile.py)."""

    __slots__ = ("admission", "lease")

    def __init__(self, admission: Admission, lease: Lease) -> None:
        self.admission = admission
        self.lease = lease

    async def __aenter__(self) -> Lease:
        await self.admission._seat(self.lease)
        return self.lease

    async def __aexit__(self, *exc: object) -> None:
        self.lease.release()
