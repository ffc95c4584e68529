"""The other active routers' work, folded into this router's picture of the fleet.

Each peer's live work is kept by its id until that router says it ended, or the router is
gone: a seat on its engine (Admission counts it beside this router's own), its prefill and
stream in the engine's TPOT ledger and its blocks in the engine's cache picture (the
policy), its tenant's request in the tenant's window. A peer's deltas are folded in only in
order: a batch that does not start where the last one ended (a delta lost, the peer
restarted under a new token) is refused, and the peer sends a snapshot of everything it
has live instead, which replaces what was held of it.

Each peer's requests waiting for an engine to keep pace are kept too, with their prompts'
sizes and when this router heard they began: a request of this router that finds room
gives it first to an older one waiting elsewhere that the room would fit as well
(`older_waiter`), so the fleet's oldest waiter is served first, as one router's own
waiters are.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from narwhal.router.admission import Admission
from narwhal.router.engines import Pool
from narwhal.router.lease import PeerSeat
from narwhal.router.metrics import RouterMetrics
from narwhal.router.peering.wire import (
    Admitted,
    Batch,
    Ended,
    Evicted,
    First,
    Placed,
    Progress,
    Released,
    Snapshot,
    Waited,
    Waiting,
)
from narwhal.router.policies import PeerHold, Policy
from narwhal.router.tenants.limits import Ticket
from narwhal.router.tenants.registry import Tenants

log = logging.getLogger("narwhal.peering")

# A peer's work and tenants' requests held at most: past it, the oldest go (a peer that
# never says its work ended cannot grow this router's memory).
MAX_HELD = 1_000_000


@dataclass
class Work:
    """One piece of a peer's work held here."""

    seat: PeerSeat | None  # None: its engine is not in this router's pool
    held: PeerHold | None  # what the policy holds of it
    at: float  # when it was placed, as this router heard


@dataclass
class Peer:
    """What this router holds of one other router: its term, the next delta it expects
    of it, and its live work and tenants' requests by id."""

    token: int
    next_seq: int
    work: dict[int, Work] = field(default_factory=dict)
    tickets: dict[int, tuple[Ticket, float]] = field(default_factory=dict)  # (it, when)
    waiting: dict[int, tuple[int, int, float]] = field(default_factory=dict)  # order, size, since


class Elsewhere:
    """Every peer's work held here (one owner: the exchange feeds it, in order)."""

    def __init__(
        self,
        pool: Pool,
        admission: Admission,
        policy: Policy,
        tenants: Tenants,
        metrics: RouterMetrics,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.policy = policy
        self.tenants = tenants
        self.metrics = metrics
        self.peers: dict[str, Peer] = {}

    def batch(self, b: Batch) -> int | None:
        """Folds `b` in; None when it was, else the sequence number it should have
        started at (0: a snapshot must come first)."""
        peer = self.peers.get(b.sender)
        if peer is None or peer.token != b.token:
            return 0
        if b.seq != peer.next_seq:
            return peer.next_seq
        for d in b.deltas:
            self._fold(b.sender, peer, d)
        peer.next_seq += len(b.deltas)
        self.metrics.peer_deltas.labels("received").inc(len(b.deltas))
        return None

    def snapshot(self, s: Snapshot) -> None:
        """What router `s.sender` has live now replaces what was held of it."""
        old = self.peers.pop(s.sender, None)
        if old is not None:
            self._let_go(old)
        peer = self.peers[s.sender] = Peer(s.token, s.seq)
        for p in s.placed:
            self._placed(s.sender, peer, p)
        for i in s.decoding:
            self._first(peer, i)
        for a in s.admitted:
            self._admitted(peer, a)
        now = time.monotonic()
        for i, order, size, age_s in s.waiting[:MAX_HELD]:
            peer.waiting[i] = (order, size, now - age_s)
        self.metrics.peer_snapshots.labels("received").inc()

    def older_waiter(self, order: int, size: int, since: float) -> bool:
        """Whether a peer has a request waiting for pace that goes before one of `order`
        waiting here since `since` (a lower order, or the same and longer waiting) and
        that room for a prompt of `size` bytes would fit too (its prompt no larger: one
        the room cannot fit would only hold it from this one)."""
        for peer in self.peers.values():
            for o, n, at in peer.waiting.values():
                if n <= size and (o < order or (o == order and at < since)):
                    return True
        return False

    def drop(self, sender: str) -> None:
        """Router `sender` is gone (or starts again): everything held of it is let go."""
        peer = self.peers.pop(sender, None)
        if peer is not None:
            self._let_go(peer)
        with contextlib.suppress(KeyError):  # a series per router standing, not per one ever
            self.metrics.placements.remove(sender)

    def _let_go(self, peer: Peer) -> None:
        for w in peer.work.values():
            self._end(w, 0, 0.0)
        for t, _ in peer.tickets.values():
            self.tenants.ended_elsewhere(t, None)

    def sweep(self, older_than_s: float) -> None:
        """Work and tenants' requests a peer has not said the end of within `older_than_s`
        (longer than any request may run) are let go: a lost delta never holds a seat, or
        a place among a tenant's requests at once, for good."""
        cut = time.monotonic() - older_than_s
        for peer in self.peers.values():
            for i in [i for i, w in peer.work.items() if w.at < cut]:
                self._end(peer.work.pop(i), 0, 0.0)
            for i in [i for i, (_, at) in peer.tickets.items() if at < cut]:
                self.tenants.ended_elsewhere(peer.tickets.pop(i)[0], None)
            for i in [i for i, (_, _, at) in peer.waiting.items() if at < cut]:
                del peer.waiting[i]

    # -- one delta ------------------------------------------------------------------------
    def _fold(self, sender: str, peer: Peer, d: object) -> None:
        if isinstance(d, Placed):
            self._placed(sender, peer, d)
        elif isinstance(d, First):
            self._first(peer, d.id)
        elif isinstance(d, Progress):
            work, c = peer.work, d.counts
            for i in range(0, len(c), 2):
                w = work.get(c[i])
                if w is not None and w.held is not None and c[i + 1] > w.held.tally.counted:
                    w.held.tally.counted = c[i + 1]
        elif isinstance(d, Ended):
            w = peer.work.pop(d.id, None)
            if w is not None:
                self._end(w, d.output_tokens, d.decode_s, d.finished)
        elif isinstance(d, Evicted):
            self.policy.evicted_elsewhere(d)
        elif isinstance(d, Admitted):
            self._admitted(peer, d)
        elif isinstance(d, Released):
            held = peer.tickets.pop(d.id, None)
            if held is not None:
                self.tenants.ended_elsewhere(held[0], d.tokens)
        elif isinstance(d, Waiting):
            if len(peer.waiting) < MAX_HELD:
                peer.waiting[d.id] = (d.order, d.size, time.monotonic())
        elif isinstance(d, Waited):
            peer.waiting.pop(d.id, None)

    def _placed(self, sender: str, peer: Peer, p: Placed) -> None:
        self.metrics.placements.labels(sender).inc()
        if p.id in peer.work or len(peer.work) >= MAX_HELD:
            return
        e = self.pool.named(p.engine)
        if e is None:  # not one of this router's engines (configs differ): no seat here
            peer.work[p.id] = Work(None, None, time.monotonic())
            return
        seat = PeerSeat(e, p.tokens)
        self.admission.seat_elsewhere(seat, p.predicted_s)
        peer.work[p.id] = Work(seat, self.policy.placed_elsewhere(p, e), time.monotonic())

    def _first(self, peer: Peer, i: int) -> None:
        w = peer.work.get(i)
        if w is None or w.seat is None:
            return
        self.admission.elsewhere_decoding(w.seat)
        if w.held is not None:
            self.policy.elsewhere_decoding(w.held)

    def _admitted(self, peer: Peer, a: Admitted) -> None:
        if a.id in peer.tickets or len(peer.tickets) >= MAX_HELD:
            return
        t = self.tenants.admitted_elsewhere(a.tenant, a.tokens)
        if t is not None:
            peer.tickets[a.id] = (t, time.monotonic())

    def _end(self, w: Work, output_tokens: int, decode_s: float, finished: bool = False) -> None:
        if w.seat is not None:
            self.admission.elsewhere_done(w.seat)
        if w.held is not None:
            self.policy.elsewhere_ended(w.held, output_tokens, decode_s, finished)
