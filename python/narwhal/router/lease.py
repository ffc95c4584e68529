"""A placed request's seat on an engine, and what happens to it on the way through.

`Admission.place()` hands out a `Lease`; its exit is the one place the seat is given back.
The rule it keeps: a placed request holds one seat (prefill, then decode) on one engine,
and releases it exactly once, however the request ends.

The relay reports to the lease (`first_byte`, `first_output`, `finished`, `fault`); the
lease moves its own seat and tells `Events`, where the predictor, the pool's health and the
metrics subscribed once, at start. Nothing else touches an engine's counters.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from narwhal.router.engines import Engine
    from narwhal.router.policies.tpot import Tally
    from narwhal.router.request import Request


class Phase(enum.Enum):
    QUEUED = "queued"  # waiting for a seat
    PREFILL = "prefill"  # placed, before the first output token
    DECODE = "decode"  # streaming output tokens
    DONE = "done"  # the seat is given back


class Seats(Protocol):
    """What a lease needs from its owner (Admission): its seat moved and given back."""

    def to_decode(self, lease: Lease) -> None: ...

    def release(self, lease: Lease) -> None: ...


Listener = Callable[["Lease"], None]
FaultListener = Callable[["Lease", str, "str | None"], None]


class Events:
    """Subscribers to what happens to leases, registered once at start."""

    def __init__(self) -> None:
        self.first_byte: list[Listener] = []
        self.first_output: list[Listener] = []
        self.finished: list[Listener] = []
        self.fault: list[FaultListener] = []
        self.released: list[Listener] = []  # a placed lease gave its seat back (once)

    def subscribe(
        self,
        *,
        first_byte: Listener | None = None,
        first_output: Listener | None = None,
        finished: Listener | None = None,
        fault: FaultListener | None = None,
        released: Listener | None = None,
    ) -> None:
        for hooks, hook in (
            (self.first_byte, first_byte),
            (self.first_output, first_output),
            (self.finished, finished),
            (self.released, released),
        ):
            if hook is not None:
                hooks.append(hook)
        if fault is not None:
            self.fault.append(fault)


class Measured:
    """What the relay measured of a placed request: written by the relay alone (directly,
    or through the lease's `first_output` and `finished`), read by the subscribers."""

    __slots__ = (
        "answered",
        "cached_tokens",
        "decode_s",
        "first_at",
        "first_byte_at",
        "natural",
        "output_tokens",
        "prompt_tokens",
        "sent_at",
        "tally",
    )

    def __init__(self) -> None:
        self.sent_at = 0.0  # the request went to the engine
        self.first_at = 0.0  # the engine's first output token
        self.first_byte_at = 0.0  # the first bytes of the answer went to the client
        self.decode_s = 0.0  # first output token to the last
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None  # of those, what the engine's cache served
        self.output_tokens = 0
        # The engine answered in full, short of the request's max_tokens: the answer's
        # length is where answers end, not where a client's limit stopped it.
        self.natural = False
        self.tally: Tally | None = None  # the relay's count of output tokens, while it runs
        # The answer's last bytes went to the client (True: it ended well; False: with an
        # error event): a client that hangs up after them does not change its outcome.
        self.answered: bool | None = None


class Lease:
    """One request's seat, from the queue to its release: where it was placed and how
    (set as it is placed), and what the relay measured of it (`measured`)."""

    __slots__ = (
        "_events",
        "_seats",
        "ahead",
        "arrived",
        "cached_expected",
        "deadline",
        "engine",
        "exclude",
        "faulted",
        "fence",
        "firsts_seen",
        "measured",
        "own_s",
        "phase",
        "predicted_s",
        "prefer",
        "prefill_cut",
        "prefill_s",
        "probe",
        "projected_at",
        "queued",
        "queued_on",
        "request",
        "tokens",
        "ttft_by",
        "warm",
    )

    def __init__(
        self,
        seats: Seats,
        events: Events,
        request: Request,
        arrived: float,
        deadline: float,
        *,
        tokens: int = 0,
        predicted_s: float | None = None,
        prefer: Engine | None = None,
        exclude: frozenset[str] = frozenset(),
        ttft_by: float | None = None,
        own_s: float | None = None,
    ) -> None:
        self._seats = seats
        self._events = events
        self.request = request
        self.arrived = arrived
        self.deadline = deadline
        self.tokens = tokens  # sized prompt tokens, in engine.prefill_tokens while in prefill
        self.predicted_s = predicted_s  # projected TTFT on `prefer`, for drift scoring
        # When it was projected: the projection counts the router's queue ahead of it, so
        # its first token is scored from here, not from when it was sent after that wait.
        self.projected_at = time.monotonic()
        self.prefer = prefer
        self.exclude = exclude  # engine names not to place on (they refused it already)
        # When its first token is due (monotonic; None: no TTFT budget is held), and its own
        # prefill's projected time: a request still waiting for a seat at ttft_by - own_s
        # can no longer make it.
        self.ttft_by = ttft_by
        self.own_s = own_s
        self.queued_on: Engine | None = None  # whose queued_tokens count it while it waits
        self.phase = Phase.QUEUED
        self.engine: Engine | None = None
        # Its own prefill as measured (Admission's, at its first token; None where it cannot
        # be told apart): from when it was sent, or, where it waited behind prompts in
        # prefill there, from the first token of the last of them. `queued`: the latter,
        # whose fixed overhead ran while it waited. `prefill_cut`: it left its seat before
        # its first token (its client gone, its deadline passed), and `prefill_s` is how long
        # its own prefill had run: a lower bound.
        self.prefill_s: float | None = None
        self.queued = False
        self.prefill_cut = False
        self.faulted: str | None = None  # the first fault's kind (Lease.fault)
        self.ahead = 0  # prompts in prefill on its engine when it took its seat
        self.firsts_seen = 0  # the engine's first tokens seen by then
        self.fence: int | None = None  # the leader's fencing token it was placed under
        # What placement expected the engine's prefix cache to serve of its prompt, where
        # a cache-aware plan sized it (written by placement once seated; None: no such plan).
        self.cached_expected: int | None = None
        self.probe = False  # the router's own profiling probe, not a client's request
        # The router's warm of a refused prompt (router/warming.py): its one output token
        # says nothing of how long answers run.
        self.warm = False
        self.measured = Measured()

    @property
    def projected_ttft_s(self) -> float | None:
        """Its first token as its projection (`predicted_s`) counted it: from when it was
        projected, its wait in the router's queue included; None before the first token."""
        first = self.measured.first_at
        return first - self.projected_at if first else None

    @property
    def on(self) -> Engine:
        """The engine the lease holds a seat on."""
        assert self.engine is not None, "the lease is not placed"
        return self.engine

    def first_byte(self) -> None:
        """The first bytes of the answer went to the client."""
        self.measured.first_byte_at = time.monotonic()
        for hook in self._events.first_byte:
            hook(self)

    def first_output(self) -> None:
        """The engine's first output token: the seat moves from prefill to decode."""
        if self.phase is not Phase.PREFILL:
            return
        self.measured.first_at = time.monotonic()
        self._seats.to_decode(self)
        for hook in self._events.first_output:
            hook(self)

    def finished(self, output_tokens: int) -> None:
        """The engine answered in full."""
        m = self.measured
        m.output_tokens = output_tokens
        cap = self.request.max_tokens
        m.natural = cap is None or output_tokens < cap
        if m.first_at:
            m.decode_s = time.monotonic() - m.first_at
        for hook in self._events.finished:
            hook(self)

    def fault(self, kind: str, against_engine: str | None = None) -> None:
        """The answer ended in a fault of `kind`; `against_engine` says why it counts as
        evidence that the engine is broken (a reset, a truncation, a stall), None when it
        does not (the engine's own error event, a frame the relay refused)."""
        if self.faulted is None:
            self.faulted = kind
        for hook in self._events.fault:
            hook(self, kind, against_engine)

    def release(self) -> None:
        if self.phase not in (Phase.PREFILL, Phase.DECODE):
            self.phase = Phase.DONE  # never seated: nothing to give back
            return
        self._seats.release(self)  # its owner moves the seat, and the phase with it
        for hook in self._events.released:
            hook(self)


class PeerSeat:
    """A seat another active router holds on an engine (`ha.mode: active`): counted by
    Admission beside this router's own, moved by what that router tells (router/peering)."""

    __slots__ = ("engine", "phase", "tokens")

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.engine = engine
        self.tokens = tokens  # sized prompt tokens, in engine.prefill_tokens while in prefill
        self.phase = Phase.QUEUED

    @property
    def on(self) -> Engine:
        return self.engine
