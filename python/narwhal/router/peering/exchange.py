"""The picture exchange between active routers (`ha.mode: active`).

Every router tells every other what it places, when each first token comes and when each
request ends, and which tenants' requests it lets in and when they end: compact deltas
(`wire`), batched while a send is out, posted straight to each peer's
`/internal/v1/picture` with the routers' shared secret. Each peer gets them in order, each
numbered in this router's term (its fencing token); a peer that missed one answers 409 and
gets a snapshot of everything live here instead. A peer not reached keeps its deltas
queued up to a bound, then a snapshot replaces them.

Routers find each other in etcd (their member keys say where each is reached, `Leadership`);
one whose key is gone is dropped, and what it held here with it. A router that joins (or
starts a new term) takes, before it places anything, every peer's live work and one peer's
whole picture (each engine's cached blocks, the conversations' engines, the predictor's
profiles): its first placements see what the fleet holds.

How old the others' picture of this router's work is, at most, is measured per delta from
its placement to the peer's acknowledgement (`narwhal_peer_lag_seconds`).

Requests waiting for an engine to keep pace are told too (`Waiting`, `Waited`): one here
that finds room waits a moment first, once, where an older one that the room would fit
waits at another router (`older`), about twice the measured lag, so that one is placed
first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque

import aiohttp

from narwhal import asgi, bearer
from narwhal._native import PromptBlocks
from narwhal.asgi import Receive, Scope, Send
from narwhal.errors import ApiError, unavailable
from narwhal.etcd import EtcdError
from narwhal.router.ha.leadership import Leadership
from narwhal.router.lease import Events, Lease
from narwhal.router.metrics import RouterMetrics
from narwhal.router.peering.elsewhere import Elsewhere
from narwhal.router.peering.wire import (
    MAX_BODY,
    MAX_DELTAS,
    Admitted,
    Batch,
    Delta,
    Ended,
    Evicted,
    First,
    Picture,
    Placed,
    Progress,
    Released,
    Snapshot,
    Waited,
    Waiting,
    WireError,
    decode,
    encode_batch,
    encode_snapshot,
)
from narwhal.router.policies import Plan, Policy
from narwhal.router.tenants.limits import Ticket

log = logging.getLogger("narwhal.peering")

PATH = "/internal/v1/picture"
# Deltas queued for one peer at most; past it they are dropped and a snapshot sent instead.
MAX_PENDING = 100_000
# A send's timeout, and the pauses after sends that failed in a row (then the last again).
SEND_TIMEOUT_S = 2.0
RETRY_S = (0.05, 0.1, 0.25, 0.5, 1.0)
# A joiner's wait for one peer's picture (it may be megabytes: every engine's blocks).
JOIN_TIMEOUT_S = 5.0
# How often the routers' keys are read (a peer that joined is sent to from then on; one
# whose key went is dropped).
DISCOVER_S = 0.5
# Work a peer never said the end of is let go after the longest a request may run and this.
SWEEP_SLACK_S = 60.0
# Each decoding stream's tokens so far are told this often (where they changed): the peers'
# ledgers measure it as this router's does, at most this much behind.
PROGRESS_S = 0.1
# How much of the lag's last measurement a new one is (an EWMA): a yield to an older waiter
# elsewhere lasts about twice the lag, at least the first and at most the second bound.
LAG_ALPHA = 0.1
YIELD_BOUNDS_S = (0.005, PROGRESS_S)
# A placement the peers have not acknowledged spends only this router's share of an
# engine's room for pace (`unheard_s`), for at most this long.
UNHEARD_MAX_S = 1.0


class Outbox:
    """The deltas one peer has not acknowledged yet, and its sender."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url.rstrip("/") + PATH
        self.pending: deque[tuple[int, float, Delta]] = deque()  # (seq, made at, delta)
        self.resync = True  # a snapshot goes first: the peer holds nothing of this term yet
        self.heard = 0  # the last delta of this term the peer acknowledged
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class Exchange:
    def __init__(
        self,
        leadership: Leadership,
        policy: Policy,
        elsewhere: Elsewhere,
        metrics: RouterMetrics,
        secret: str,
        request_timeout_s: float,
    ) -> None:
        self.leadership = leadership
        self.policy = policy
        self.elsewhere = elsewhere
        self.metrics = metrics
        self._keys = (secret.encode(),)
        self._auth = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
        self.request_timeout_s = request_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.outboxes: dict[str, Outbox] = {}
        # This router's live work and tenants' requests, by the id its deltas give them.
        self._ids = itertools.count(1)
        self._seq = 1  # the next delta's number in this term
        self._term: int | None = None
        self._live: dict[Lease, tuple[Placed, bool]] = {}  # (its placement, decoding)
        self._told: dict[Lease, int] = {}  # decoding: the tokens last told
        self._tickets: dict[Ticket, Admitted] = {}
        # This router's requests waiting for pace: (id, order, prompt bytes, since).
        self._waiting: dict[object, tuple[int, int, int, float]] = {}
        self.lag_s = YIELD_BOUNDS_S[0]  # a delta's time to a peer's acknowledgement (EWMA)
        self._placed_here = metrics.placements.labels(leadership.name)  # looked up once
        # Per engine, this router's placements the peers may not have heard of: (the delta's
        # number, when, the prefill seconds charged to its TPOT ledger).
        self._unheard: dict[str, deque[tuple[int, float, float]]] = {}

    # -- this router's work, as it happens ------------------------------------------------
    def watch(self, events: Events) -> None:
        events.subscribe(first_output=self._first, released=self._released)

    def placed(self, lease: Lease, plan: Plan) -> None:
        """`lease` was seated (after the policy heard of it)."""
        req = lease.request
        stall_s, n = self.policy.footprint(lease)
        p = Placed(
            next(self._ids),
            lease.on.name,
            lease.tokens,
            lease.predicted_s,
            plan.blocks.packed() if plan.blocks is not None else None,
            plan.session,
            stall_s,
            n,
            req.standing.rank,
            req.max_tokens,
            req.standing.tenant or None,
        )
        self._live[lease] = (p, False)
        self._placed_here.inc()
        seq = self._seq
        self._tell(p)
        if stall_s and self.outboxes:
            now = time.monotonic()
            self.unheard_s(p.engine, now)  # what every peer has heard by now leaves
            self._unheard.setdefault(p.engine, deque()).append((seq, now, stall_s))

    @property
    def routers(self) -> int:
        return len(self.outboxes) + 1

    def unheard_s(self, engine: str, now: float) -> float:
        """Prefill seconds this router charged `engine`'s TPOT ledger that some peer has
        not acknowledged yet (for at most UNHEARD_MAX_S: a peer that cannot be reached is
        placing nothing there from what it heard of this router)."""
        unheard = self._unheard.get(engine)
        if not unheard:
            return 0.0
        heard = min((box.heard for box in self.outboxes.values()), default=self._seq)
        while unheard and (unheard[0][0] <= heard or unheard[0][1] < now - UNHEARD_MAX_S):
            unheard.popleft()
        return sum(stall for _, _, stall in unheard)

    def _first(self, lease: Lease) -> None:
        held = self._live.get(lease)
        if held is not None:
            self._live[lease] = (held[0], True)
            self._told[lease] = 0
            self._tell(First(held[0].id))

    def _released(self, lease: Lease) -> None:
        held = self._live.pop(lease, None)
        self._told.pop(lease, None)
        if held is not None:
            m = lease.measured
            # A warm's answer is thrown away at its first token, and one cut by its client
            # or stopped at its max_tokens is not where answers end: no length to teach.
            natural = m.natural and not lease.warm
            self._tell(Ended(held[0].id, m.output_tokens, m.decode_s, natural))

    async def progress_forever(self) -> None:
        """Every decoding stream's tokens so far, told where they changed."""
        while True:
            await asyncio.sleep(PROGRESS_S)
            if not self.outboxes:
                continue
            counts: list[int] = []
            for lease, told in self._told.items():
                tally = lease.measured.tally
                if tally is not None and tally.counted != told:
                    self._told[lease] = tally.counted
                    counts += (self._live[lease][0].id, tally.counted)
            if counts:
                self._tell(Progress(counts))

    def evicted(self, engine: str, blocks: PromptBlocks, keep: int) -> None:
        """This router found `engine` holding only `keep` of `blocks` (its picture dropped
        the rest): the others' pictures drop them too."""
        self._tell(Evicted(engine, blocks.packed(), keep))

    def admitted(self, ticket: Ticket, tenant: str, estimate: int) -> None:
        a = Admitted(next(self._ids), tenant, estimate)
        self._tickets[ticket] = a
        self._tell(a)

    def ended(self, ticket: Ticket, tokens: int | None) -> None:
        a = self._tickets.pop(ticket, None)
        if a is not None:
            self._tell(Released(a.id, tokens))

    def waiting(self, key: object, order: int, size: int) -> None:
        """A request of `order` and a prompt of `size` bytes (`key`: its wait) began to
        wait for pace here."""
        w = (next(self._ids), order, size, time.monotonic())
        self._waiting[key] = w
        self._tell(Waiting(w[0], order, size))

    def waited(self, key: object) -> None:
        """That request no longer waits (placed, refused or gone)."""
        w = self._waiting.pop(key, None)
        if w is not None:
            self._tell(Waited(w[0]))

    def older(self, order: int, size: int, since: float) -> float | None:
        """How long a request of `order` and a prompt of `size` bytes, waiting here since
        `since`, that found room, gives way to an older one waiting at another router that
        the room would fit too (None: none)."""
        if not self.elsewhere.older_waiter(order, size, since):
            return None
        self.metrics.peer_yields.inc()
        return min(YIELD_BOUNDS_S[1], max(YIELD_BOUNDS_S[0], 2 * self.lag_s))

    def _tell(self, d: Delta) -> None:
        seq, self._seq = self._seq, self._seq + 1
        now = time.monotonic()
        for box in self.outboxes.values():
            if box.resync:
                continue  # its snapshot, when it goes, holds this
            if len(box.pending) >= MAX_PENDING:
                self.metrics.peer_deltas.labels("dropped").inc(len(box.pending))
                box.pending.clear()
                box.resync = True
            else:
                box.pending.append((seq, now, d))
            box.wake.set()

    def _snapshot(self) -> Snapshot:
        """Everything live here now; the next delta is numbered `seq`."""
        token = self._term or 0
        placed = [p for p, _ in self._live.values()]
        decoding = [p.id for p, dec in self._live.values() if dec]
        now = time.monotonic()
        waiting = [(i, o, size, now - at) for i, o, size, at in self._waiting.values()]
        return Snapshot(
            self.leadership.name,
            token,
            self._seq,
            placed,
            decoding,
            list(self._tickets.values()),
            waiting,
        )

    # -- sending ----------------------------------------------------------------------
    async def _send_forever(self, box: Outbox) -> None:
        failures = 0
        while True:
            if not box.pending and not box.resync:
                box.wake.clear()
                await box.wake.wait()
            if self._term is None:
                await asyncio.sleep(RETRY_S[-1])
                continue
            if box.resync:
                # Built and the queue cleared at one moment: what is told while it is out is
                # queued behind it, numbered from where it ends.
                snap = self._snapshot()
                box.pending.clear()
                box.resync = False
                body, sent = encode_snapshot(snap), None
                holds = snap.seq - 1  # every delta told before it, once it lands
            else:
                sent = [box.pending[i] for i in range(min(MAX_DELTAS, len(box.pending)))]
                holds = sent[-1][0]
                batch = Batch(self.leadership.name, self._term, sent[0][0], [d for _, _, d in sent])
                body = encode_batch(batch)
            term = self._term
            status = await self._post(box, body)
            if status == 200:
                failures = 0
                if term == self._term:  # numbers of the term it was sent in
                    box.heard = max(box.heard, holds)
                if sent is None:
                    self.metrics.peer_snapshots.labels("sent").inc()
                    continue
                now = time.monotonic()
                for _ in sent:
                    _, made, _ = box.pending.popleft()
                    self.metrics.peer_lag.observe(now - made)
                    self.lag_s += LAG_ALPHA * (now - made - self.lag_s)
                self.metrics.peer_deltas.labels("sent").inc(len(sent))
            elif status == 409:
                box.resync = True  # it missed some, or holds nothing of this term
            else:
                if sent is None:
                    box.resync = True  # the snapshot did not land: another, when it can
                await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1

    async def _post(self, box: Outbox, body: bytes) -> int:
        assert self.session is not None
        try:
            async with self.session.post(
                box.url,
                data=body,
                headers=self._auth,
                timeout=aiohttp.ClientTimeout(total=SEND_TIMEOUT_S),
            ) as resp:
                await resp.read()
                if resp.status not in (200, 409):
                    log.warning("peer %s answered the picture exchange %d", box.name, resp.status)
                return resp.status
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, ConnectionRefusedError) and box.name in self.elsewhere.peers:
                # Nothing listens where it was: the process is gone, and its streams with it
                # (the engines saw its connections close). Its seats are let go now, not when
                # its key lapses a TTL later; were it alive after all, its next batch finds
                # nothing held of it and a snapshot puts its work back.
                log.info("router %s refuses connections: what it held here is let go", box.name)
                self.elsewhere.drop(box.name)
            return 0
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.debug("peer %s not reached: %s", box.name, e)
            return 0

    # -- who the peers are ------------------------------------------------------------
    async def run_forever(self) -> None:
        """Follows the routers' keys: a sender for each peer standing, and what a peer
        whose key went held here let go; work never ended swept."""
        while True:
            await asyncio.sleep(DISCOVER_S)
            self._term_check()
            self.elsewhere.sweep(self.request_timeout_s + SWEEP_SLACK_S)
            if self._term is None:
                continue
            try:
                peers = await self.leadership.peers()
            except EtcdError as e:
                log.debug("the routers' keys could not be read: %s", e)
                continue
            self._follow(peers)

    def _follow(self, peers: dict[str, str]) -> None:
        for name, url in peers.items():
            box = self.outboxes.get(name)
            if box is not None and box.url == url.rstrip("/") + PATH:
                continue
            if box is not None and box.task is not None:
                box.task.cancel()
            box = self.outboxes[name] = Outbox(name, url)
            box.task = asyncio.create_task(self._supervised(box), name=f"peer-{name}")
            box.wake.set()
            log.info("exchanging the picture with router %s at %s", name, url)
        for name in [n for n in self.outboxes if n not in peers]:
            box = self.outboxes.pop(name)
            if box.task is not None:
                box.task.cancel()
            log.info("router %s left: what it held here is let go", name)
        for name in [n for n in self.elsewhere.peers if n not in peers]:
            self.elsewhere.drop(name)
        self.metrics.peers.set(len(self.outboxes))

    async def _supervised(self, box: Outbox) -> None:
        """A sender that raises is said, counted, and started again."""
        while True:
            try:
                await self._send_forever(box)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sending to router %s failed", box.name)
                self.metrics.background_errors.labels(f"peer_sender:{box.name}"[:64]).inc()
                box.resync = True
                await asyncio.sleep(RETRY_S[-1])

    def _term_check(self) -> None:
        """A new fencing token is a new term: every peer gets a snapshot first."""
        token = self.leadership.token if self.leadership.serving() is None else None
        if token == self._term:
            return
        self._term = token
        self._seq = 1
        for box in self.outboxes.values():
            box.pending.clear()
            box.resync = True
            box.heard = 0
            box.wake.set()

    async def join(self) -> None:
        """Before this router places in a new term: every peer's live work, and one peer's
        whole picture of the fleet."""
        self._term = None  # the term starts when its token is in hand (`_term_check`)
        try:
            peers = await self.leadership.peers()
        except EtcdError as e:
            log.warning("joining: the routers' keys could not be read: %s", e)
            return
        pictured = False
        for name, url in peers.items():
            got = await self._fetch(url, picture=not pictured)
            if got is None:
                continue
            snap, picture = got
            if snap.sender != name:
                continue
            self.elsewhere.snapshot(snap)
            if picture is not None:
                self.policy.take_picture(picture)
                pictured = True
                log.info("took router %s's picture of the fleet", name)

    async def _fetch(self, url: str, picture: bool) -> tuple[Snapshot, Picture | None] | None:
        assert self.session is not None
        target = url.rstrip("/") + PATH + ("?picture=1" if picture else "")
        try:
            async with self.session.get(
                target, headers=self._auth, timeout=aiohttp.ClientTimeout(total=JOIN_TIMEOUT_S)
            ) as resp:
                if resp.status != 200:
                    return None
                # The whole body, at most MAX_BODY (`read(n)` returns what has arrived: a
                # picture of a loaded fleet came in pieces, and the first alone is no JSON).
                chunks, size = [], 0
                async for chunk in resp.content.iter_any():
                    size += len(chunk)
                    if size > MAX_BODY:
                        raise WireError(f"a picture is at most {MAX_BODY} bytes")
                    chunks.append(chunk)
                raw = b"".join(chunks)
            msg, pic = decode(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, WireError) as e:
            log.warning("joining: %s's picture not taken: %s", url, e)
            return None
        return (msg, pic) if isinstance(msg, Snapshot) else None

    # -- receiving --------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`/internal/v1/picture`: POST folds a peer's deltas or snapshot in; GET answers
        with what is live here (and, with `?picture=1`, this router's whole picture)."""
        bearer.require(scope, self._keys, "peer secret (ha.peer_secret_env)")
        method = scope["method"]
        self._term_check()
        if method == "GET":
            if self._term is None:
                raise unavailable("this router is not placing yet", "standby")
            picture = b"picture=1" in scope.get("query_string", b"")
            body = encode_snapshot(self._snapshot(), self.policy.picture() if picture else None)
            await asgi.send_bytes(send, 200, body)
            return
        if method != "POST":
            raise asgi.method_not_allowed(method, PATH, "GET, POST")
        try:
            raw = await asgi.read_body(receive, MAX_BODY, SEND_TIMEOUT_S * 5)
        except asgi.BodyTooLarge:
            raise ApiError(
                413, "a picture message is too large", code="request_too_large"
            ) from None
        try:
            msg, _ = decode(raw)
        except WireError as e:
            raise ApiError(400, f"not a picture message: {e}", code="invalid_request") from None
        if msg.sender == self.leadership.name:
            raise ApiError(400, "a router does not send itself its picture", code="invalid_request")
        if isinstance(msg, Snapshot):
            self.elsewhere.snapshot(msg)
            await asgi.send_bytes(send, 200, b'{"ok":true}')
            return
        expected = self.elsewhere.batch(msg)
        if expected is None:
            await asgi.send_bytes(send, 200, b'{"ok":true}')
            return
        raise ApiError(
            409,
            f"deltas from {msg.sender[:64]} start at {msg.seq}, not {expected}: send a snapshot",
            code="picture_out_of_order",
        )

    def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def close(self) -> None:
        for box in self.outboxes.values():
            if box.task is not None:
                box.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await box.task
        self.outboxes.clear()
