"""Admission and placement policies, one a module, chosen once at start (`choose.py`).

A policy judges a request before it is placed (refusing it, or saying which engine it
prefers and what it expects there: a `Plan`), hears where it was placed, and learns from
how it ended through the lease events it subscribed to at start.

- `open`: every request is admitted, to the least-loaded engine with a seat.
- `predictive`: TTFT projected per engine from learned profiles, counting only the prompt
  tokens each engine is expected to prefill (its prefix cache, `prefix_cache`), and the
  spec's 429s when no engine is projected to fit; conversations stay on their engine
  while it fits (`sessions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from narwhal._native import PromptBlocks
    from narwhal.router.decisions import Decision
    from narwhal.router.engines import Engine
    from narwhal.router.lease import Events, Lease
    from narwhal.router.peering.wire import Evicted, Picture, Placed
    from narwhal.router.policies.prefix_cache import Expectation
    from narwhal.router.policies.tpot import Charge, Streams
    from narwhal.router.request import Request


@dataclass(frozen=True)
class Plan:
    """What a policy decided for one request before placement."""

    prefer: Engine | None = None  # the engine it projects best, if any
    tokens: int = 0  # prompt tokens it expects `prefer` to prefill (cached ones not counted)
    predicted_s: float | None = None  # projected TTFT on `prefer`, for drift scoring
    blocks: PromptBlocks | None = None  # the prompt's block hashes (cache-aware placement)
    # Per engine name, what its prefix cache is expected to serve (engines expected to hold
    # nothing of it are absent).
    expected: dict[str, Expectation] = field(default_factory=dict)
    session: str | None = None
    # The prompt's prefill, charged to the TPOT ledger of `prefer` when it was judged, so
    # that a request judged before this one is placed does not count on the same headroom.
    charge: Charge | None = None
    own_s: float | None = None  # its own prefill's projected time on `prefer`

    def held_by(self, name: str) -> int:
        """The prompt tokens engine `name`'s prefix cache was expected to serve."""
        exp = self.expected.get(name)
        return exp.tokens if exp is not None else 0

    def settle(self) -> None:
        """The request is over: a charge its placement did not take up is let go."""
        if self.charge is not None:
            self.charge.settle()


OPEN_PLAN = Plan()


class PeerTally:
    """A peer's stream's output tokens, as that router last told them."""

    __slots__ = ("counted",)

    def __init__(self) -> None:
        self.counted = 0


@dataclass(frozen=True, slots=True)
class PeerHold:
    """What another active router's work holds of an engine's TPOT ledger here: its
    prefill's charge, its stream (None: an answer of one token), its tenant, and its tokens
    so far."""

    ledger: Streams
    charge: Charge
    entry: int | None
    tenant: str = ""
    tally: PeerTally = field(default_factory=PeerTally)


class Unheard(Protocol):
    """What this router placed that the other active routers may not have heard of yet
    (`peering.Exchange`)."""

    @property
    def routers(self) -> int:
        """The active routers placing on the engines, this one included."""

    def unheard_s(self, engine: str, now: float) -> float:
        """Prefill seconds this router charged `engine`'s TPOT ledger that some other router
        has not acknowledged yet."""


class Policy(Protocol):
    def judge(
        self, req: Request, engines: list[Engine], budget_s: float, record: Decision | None = None
    ) -> Plan:
        """The plan for `req`, or an ApiError refusing it, or `NoEngineKeepsPace` when it
        may wait for `room()`; `record`, where given, is told what was weighed and why."""

    async def room(self, timeout_s: float, order: int = 2) -> None:
        """Returns when placement may have changed its mind (a stream ended), or after
        `timeout_s`; waiters of a lower `order` (a higher class; within one, a tenant
        within its fair share: `Standing.order`) are woken first."""

    def placed(self, lease: Lease, plan: Plan) -> None:
        """`lease` was seated as `plan` said, or elsewhere (`lease.on`): the policy keeps
        what it needs of the plan until the lease is released."""

    def added(self, engine: Engine) -> None:
        """An engine joined the fleet (before it is placed on)."""

    def removed(self, engine: Engine) -> None:
        """An engine left the fleet (leases on it may still end after this)."""

    def watch(self, events: Events) -> None: ...

    def describe(self) -> dict[str, Any] | None:
        """What the policy holds, for `/ready` (None: nothing to show)."""

    def degraded(self, engines: list[Engine]) -> str | None:
        """Why the policy's predictions for these engines cannot be trusted now, or None."""

    def overrun(self, lease: Lease, engine: Engine, now: float) -> float | None:
        """How far past its TTFT budget the first token of a lease that waited for a seat
        would come if placed on `engine` now; None when in time (or nothing is projected)."""

    def instead(self, room: list[Engine]) -> Engine:
        """Where a seat is taken when the plan named no engine, or its engine has no seat
        free now: one of `room` (the engines that have one; never empty)."""

    def footprint(self, lease: Lease) -> tuple[float | None, int | None]:
        """What placing `lease` charged its engine besides a seat (for the other active
        routers): its prefill's seconds on the TPOT ledger, the length its stream is held
        to; Nones where nothing was."""

    def placed_elsewhere(self, p: Placed, e: Engine) -> PeerHold | None:
        """Another active router placed `p` on `e`: what it holds there (its blocks, its
        conversation, its prefill and stream) is held here too; what is given back when it
        decodes and ends (None: nothing)."""

    def elsewhere_decoding(self, w: PeerHold) -> None: ...

    def elsewhere_ended(
        self, w: PeerHold, output_tokens: int, decode_s: float, finished: bool
    ) -> None:
        """That work ended; `finished` where its answer ended on its own, short of its
        max_tokens (its length is one of the fleet's answer lengths)."""

    def evicted_elsewhere(self, d: Evicted) -> None:
        """Another router found an engine holding less of a prompt than the picture said."""

    def share_headroom(self, unheard: Unheard) -> None:
        """From now on, an engine's room for pace is shared with the other active routers:
        what this router places there before they have heard of it spends at most its share
        (a policy with no TPOT ledger shares nothing)."""

    def tell_evictions(self, told: Callable[[str, PromptBlocks, int], None]) -> None:
        """From now on, where an engine is found to hold less of a prompt than the picture
        said (engine, the prompt's blocks, how many it holds), `told` is told (the other
        active routers); a policy with no picture tells nothing."""

    def picture(self) -> Picture | None:
        """What this router holds of the fleet, for an active router that joins."""

    def take_picture(self, p: Picture) -> None: ...

    def warming(self, req: Request, engines: list[Engine]) -> Plan | None:
        """Where `req`, just refused for its TTFT, may be prefilled anyway (its answer
        discarded) so that its prompt is in cache when it comes again; None: nowhere."""


def least_loaded(room: list[Engine]) -> Engine:
    """The engine with the fewest prompts in prefill, then the fewest requests in flight."""
    return min(room, key=lambda e: (e.prefill, e.inflight))
