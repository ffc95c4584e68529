"""`admission: predictive`: admit and place by projected TTFT, knowing each engine's cache.

For every eligible engine the projection counts only the prompt tokens that engine is
expected to prefill (the prompt less what its prefix cache holds, `prefix_cache`), plus the
prefill already queued there, at the engine's learned rate (`predict`). Placement takes the
lowest guarded projection, so cache affinity and load balance are one decision; a
conversation stays on its engine while that engine is projected within budget; the spec's
429s come only when no engine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from narwhal._native import PromptBlocks
from narwhal.router import decisions as why
from narwhal.router.decisions import Decision
from narwhal.router.engines import Engine
from narwhal.router.lease import Events, Lease
from narwhal.router.peering.wire import Evicted, Picture, Placed
from narwhal.router.policies import PeerHold, Plan, Unheard, least_loaded
from narwhal.router.policies.lengths import Histogram, Lengths
from narwhal.router.policies.prefix_cache import NOTHING_HELD, Expectation, PrefixCache
from narwhal.router.policies.sessions import Sessions
from narwhal.router.policies.tpot import Charge, Streams
from narwhal.router.policies.ttft import NoEngineKeepsPace, judge
from narwhal.router.predict import Predictor, Profile, Projection, bytes_per_token
from narwhal.router.request import Request
from narwhal.router.tenants.fair_queue import CLASSES
from narwhal.router.tenants.reserve import CriticalReserve

# Streams are kept within this share of the TPOT target: a charge is an estimate (a prompt's
# sizing is off by 10-20 % from one prompt to the next, an eviction the picture learns of
# only when the engine reports it), and the misses it lets through were all short streams
# a few per cent over the target (bench/README.md, "Fleet"). Learning the share from the
# streams served was tried and measured no better (bench/README.md, the A/B of 06b6088).
TPOT_AIM = 0.9
# Before anything is measured, a step without prefill is taken to cost this share of the
# aim: a stream's allowance then starts at half of what its target leaves, and grows as it
# decodes.
COLD_TAU0_SHARE = 0.5
# Places among requests waiting for pace: a class each (critical, standard, sheddable),
# and within one a tenant over its fair share after the rest.
ORDERS = 6
# A prompt refused for its TTFT is warmed (`warming`) where its own prefill takes at most
# this many TTFT budgets (beyond, an engine is held from new work too long for a turn that
# may never come), unless an engine holds this share of it already.
WARM_MAX = 4.0
WARM_HELD = 0.9
# ... and only while at least this share of the engines has nothing ahead of a new prompt
# (half was measured too: 2.5 points more misses at 2x in both of its runs; bench/README).
WARM_IDLE = 0.75


class PredictivePolicy:
    def __init__(
        self,
        predictor: Predictor,
        engines: list[Engine],
        cache: PrefixCache | None,
        tpot_target_s: float | None = None,
        reserve: CriticalReserve | None = None,
        budget_s: float = 0.0,
        sessions: Sessions | None = None,
    ) -> None:
        self.predictor = predictor
        # Lower classes leave critical streams the room a critical prompt of the reserve's
        # share of the TTFT budget would take (as they leave it in the budget).
        self.reserve = reserve
        self.budget_s = budget_s
        self.cache = cache
        self.tpot_target_s = tpot_target_s
        self.sessions = sessions or Sessions()
        self.lengths = Lengths()
        self.streams = {e.name: Streams(len(CLASSES)) for e in engines}
        # Placed requests, until released: their stream's entry in the ledger (None for an
        # answer of one token), their prompt's charge, and the length it is held to.
        self._entries: dict[Lease, tuple[int | None, Charge, int | None]] = {}
        # Per placed lease, the blocks placed and what the engine's cache was expected to
        # serve of them, until its engine reports what it did (or the lease is released).
        self._expected: dict[Lease, tuple[PromptBlocks, Expectation]] = {}
        # Per priority class, resolved when a stream ends: higher classes first, so their
        # waiters are judged (and charged) before lower ones take the room.
        self._ended: list[asyncio.Future[None] | None] = [None] * ORDERS
        self._waiting = [0] * ORDERS  # requests of each order waiting in room() now
        self._engines = {e.name: e for e in engines}
        # Per slot of the picture, its engine and that engine's profile (None: a slot an
        # engine left), so judging reads them without a lookup an engine.
        self._slots: list[Engine | None] = list(engines)
        self._profiles: list[Profile | None] = [predictor.profiles[e.name] for e in engines]
        # With other active routers: what this one placed that they may not hold yet.
        self._unheard: Unheard | None = None

    def added(self, engine: Engine) -> None:
        self.predictor.add(engine)
        self.streams.setdefault(engine.name, Streams(len(CLASSES)))
        self._engines[engine.name] = engine
        if self.cache is not None:
            self.cache.add(engine.name)
        self._align()

    def removed(self, engine: Engine) -> None:
        # Leases still on it end later: what they report finds no ledger, picture or
        # profile, and is dropped.
        self.predictor.remove(engine)
        self.streams.pop(engine.name, None)
        self._engines.pop(engine.name, None)
        if self.cache is not None:
            self.cache.remove(engine.name)
        self._align()

    def _align(self) -> None:
        names = self.cache.names if self.cache is not None else list(self._engines)
        self._slots = [self._engines.get(n) if n is not None else None for n in names]
        self._profiles = [
            self.predictor.profiles[e.name] if e is not None else None for e in self._slots
        ]

    def judge(
        self, req: Request, engines: list[Engine], budget_s: float, record: Decision | None = None
    ) -> Plan:
        # An engine that has not sized clients' text, or measured prompts of this size, is
        # judged by the fleet's measurements (`Predictor.lender`): its cache expectation is
        # sized as its projection is.
        lender = self.predictor.lender(engines, req.served)
        blocks, expected = self._expect(req, lender)
        cached = {name: x.tokens for name, x in expected.items()}
        if record is not None:
            record.expected = cached
            record.session = req.session
        home = self.sessions.engine(req.session)
        paced = self.tpot_target_s is not None
        proj = judge(
            self.predictor,
            req.prompt_bytes,
            engines,
            budget_s,
            cached,
            self._engines.get(home or ""),
            self._paced(req.standing.share, req.standing.rank) if paced else None,
            self._stall if paced else None,
            req.standing.rank,
            req.standing.share,
            record,
            not paced or self._pace_sure(req.standing.tenant, engines),
            req.served,
            lender,
        )
        if paced and any(self._waiting[: req.standing.order]):
            # A request of a higher class (or of a tenant within its fair share, where
            # this one's is over) waits for pace: this one would spend the allowance it
            # waits for. It waits behind it, as long as its own budget lets.
            if record is not None:
                record.chose(None, why.WAIT_CLASS)
            raise NoEngineKeepsPace(budget_s - (proj.guarded_s or 0.0))
        charge = None
        if paced:
            # Charged now, not once placed: requests woken together by a stream's end are
            # judged one after another before any is placed, and each would otherwise count
            # on the headroom the others take.
            stall = self._stall_s(proj)
            if stall is not None:
                charge = self.streams[proj.engine.name].charge(stall)
        return Plan(
            proj.engine,
            proj.tokens,
            proj.total_s,
            blocks,
            expected,
            req.session,
            charge,
            proj.own_s,
        )

    def _expect(
        self, req: Request, lender: Profile | None
    ) -> tuple[PromptBlocks | None, dict[str, Expectation]]:
        """The prompt's blocks, and per engine what its cache is expected to serve of them
        (engines expected to hold nothing are absent)."""
        if self.cache is None:
            return None, {}
        text = req.prefix_text()
        blocks = self.cache.blocks(text)
        if not len(blocks):
            return blocks, {}
        bpt = [bytes_per_token(p, lender) if p is not None else None for p in self._profiles]
        size = self.predictor.size
        sized = [size(req.prompt_bytes, e, lender) if e is not None else 0 for e in self._slots]
        held = self.cache.expect(blocks, len(text), sized, bpt)
        return blocks, {
            name: x
            for name, x in zip(self.cache.names, held, strict=True)
            if x.blocks and name is not None
        }

    def warming(self, req: Request, engines: list[Engine]) -> Plan | None:
        """Where a conversation's prompt just refused for its TTFT is prefilled anyway, its
        answer thrown away, so that the conversation's next turn finds its history in cache:
        while at least WARM_IDLE of the engines have nothing ahead, an engine with nothing
        ahead, a seat free, whose streams keep pace beside the prefill as beside a request of
        the lowest class, and whose prefill of it takes at most WARM_MAX budgets; the
        conversation's engine first, then the one that holds most of it, then the least
        loaded. None where there is no such room, or an engine holds most of the prompt
        already, or the request names no conversation (a client's retry of the 429 comes
        within a second or two, before a prompt too long for the budget is prefilled). At
        half load on the production trace at a 1 s budget, a conversation whose first long
        turn was refused had every later turn refused for its history's length, while a
        router that served the first turn late served the later ones from cache
        (bench/README.md)."""
        if req.passthrough or self.cache is None or req.session is None:
            return None  # no conversation to come back (a retry alone came too soon: below)
        idle = [e for e in engines if not e.prefill and not any(e.queued_tokens)]
        if len(idle) < WARM_IDLE * len(engines):
            return None  # the fleet's room is for the live requests coming now
        lender = self.predictor.lender(engines, req.served)
        blocks, expected = self._expect(req, lender)
        if blocks is None or not len(blocks):
            return None
        lowest = len(CLASSES) - 1
        paced = self._paced(1.0, lowest) if self.tpot_target_s is not None else None
        home = self.sessions.engine(req.session)
        best: tuple[tuple[bool, float, int], Projection] | None = None
        for e in engines:
            held = expected.get(e.name)
            p = self.predictor.project(
                req.prompt_bytes, e, held.tokens if held else 0, lowest, req.served, lender
            )
            if held is not None and held.tokens >= WARM_HELD * (p.tokens + held.tokens):
                return None  # there already
            if e.prefill or any(e.queued_tokens) or p.own_s is None:
                continue  # work ahead of it there, or nothing measured to size it by
            if p.own_s > WARM_MAX * self.budget_s or (paced is not None and not paced(p)):
                continue
            key = (e.name != home, -(held.tokens if held else 0), e.inflight)
            if best is None or key < best[0]:
                best = (key, p)
        if best is None:
            return None
        p = best[1]
        stall = self._stall_s(p) if self.tpot_target_s is not None else None
        charge = self.streams[p.engine.name].charge(stall) if stall is not None else None
        return Plan(p.engine, p.tokens, p.total_s, blocks, expected, req.session, charge, p.own_s)

    def _pace_sure(self, tenant: str, engines: list[Engine]) -> bool:
        """Whether the ledger's verdicts rest on measured answer lengths, so that a request
        may wait or be refused for pace: the router has seen enough answers, or every
        engine has a typical length. Before, every stream is held to two tokens (nothing
        says more), and a fresh router refused a tenth of a light load for pace in its
        first 20 s (bench/README.md, "A fresh router"); pace still ranks the engines."""
        if self.lengths.of(tenant) is not None:
            return True
        profiles = [self.predictor.profiles.get(e.name) for e in engines]
        return all(p is not None and p.output_tokens is not None for p in profiles)

    def _paced(self, share: float, rank: int) -> Callable[[Projection], bool]:
        # The reserve is read once a request, not once an engine.
        reserve_s = 0.0
        if rank > 0 and self.reserve is not None:
            reserve_s = self.reserve.share() * self.budget_s
        return lambda p: self._keeps_pace(p, share, rank, reserve_s)

    def _keeps_pace(self, p: Projection, share: float, rank: int, reserve_s: float) -> bool:
        """Placing there leaves every stream on the engine of the request's class or a
        higher one within the TPOT target: a request of a lower class with `1 - share` of
        the allowance to spare, and `reserve_s` more in critical streams' allowance. Lower
        classes' streams are the higher ones' to spend."""
        stall = self._stall_s(p)
        if stall is None:
            return True
        name = p.engine.name
        ledger = self.streams[name]
        now = time.monotonic()
        room = ledger.headroom_s(now, rank)
        if room is not None and stall / share > room:
            return False
        if room is not None and self._unheard is not None:
            # Other active routers judge this engine's room at the same moments, each
            # without what the others placed in the last few milliseconds: in a burst,
            # three routers each filled the room alone and the engine's streams were held
            # up to 4 s past their allowance (bench/README.md, "Active routers"). What
            # this router placed there that they may not hold yet spends at most its share
            # of the room they all saw; its first such placement may take what fits.
            unheard = self._unheard.unheard_s(name, now)
            if unheard and unheard + stall / share > (room + unheard) / self._unheard.routers:
                return False
        return not reserve_s or ledger.fits(stall + reserve_s, now, 0)

    def _stall(self, p: Projection) -> float:
        """Stream-seconds of decode this prompt's prefill holds up on its engine: each
        stream decoding there waits out the prefill's share of every step it shares."""
        stall = self._stall_s(p)
        return 0.0 if stall is None else stall * p.engine.decode

    def _stall_s(self, p: Projection) -> float | None:
        """How long the projected prompt's prefill holds up each step it shares: its own
        prefill less the fixed part (a step's weights, which the streams' steps pay anyway);
        None before the engine's rate is known."""
        if p.own_s is None:
            return None
        prof = self.predictor.profiles.get(p.engine.name)
        return max(0.0, p.own_s - (prof.overhead_s if prof is not None else 0.0))

    def overrun(self, lease: Lease, engine: Engine, now: float) -> float | None:
        """A waiting lease placed on `engine` now: its first token after the prefill seated
        there and its own, against its budget (`ttft_by`), as the judge projected it."""
        if lease.ttft_by is None:
            return None
        prof = self.predictor.profiles.get(engine.name)
        if prof is None or prof.prefill_tps is None:
            return None
        mine = self.predictor.of_model(engine, lease.request.served)
        own = mine.prefill_s(lease.tokens) if mine.prefill_tps is not None else 0.0
        due = prof.ahead_s(engine.prefill_tokens, engine.prefill_sq) + own
        due += engine.behind_s(now)
        due *= self.predictor.margin(prof) * self.predictor.edge
        late = now + due - lease.ttft_by
        return late if late > 0 else None

    def instead(self, room: list[Engine]) -> Engine:
        # The engine judged best has no seat free (it was projected with its queue, and a
        # queued request placed elsewhere is only faster than projected), or the plan named
        # none (an engine not profiled yet): the least loaded.
        return least_loaded(room)

    def placed(self, lease: Lease, plan: Plan) -> None:
        name = lease.on.name
        if plan.blocks is not None and self.cache is not None:
            self.cache.placed(name, plan.blocks)
            exp = plan.expected.get(name)
            if exp is None and lease.warm:
                exp = NOTHING_HELD  # a warm cut short is taken back to this (`_released`)
            if exp is not None:
                self._expected[lease] = (plan.blocks, exp)  # the engine's report corrects it
        self.sessions.placed(plan.session, name)
        if self.tpot_target_s is not None:
            self._joined(lease, name, plan)

    def _joined(self, lease: Lease, name: str, plan: Plan) -> None:
        assert self.tpot_target_s is not None
        prof = self.predictor.profiles[name]
        if prof.prefill_tps is None:
            return
        ledger = self.streams[name]
        # Charged when judged if it went where it was judged for; else charged here, and
        # the judged engine's pending prefill is let go (what it was charged stays: a little
        # caution, never too little).
        charge = plan.charge
        if charge is None or charge.ledger is not ledger:
            if charge is not None:
                charge.settle()
            mine = self.predictor.of_model(lease.on, lease.request.served)
            if mine.prefill_tps is None:
                mine = prof
            charge = ledger.charge(mine.prefill_s(lease.tokens) - mine.overhead_s)
        # What the stream is held to run to: a low quantile of how long its tenant's answers
        # run (`lengths`), its max_tokens at most; before the router has seen enough
        # answers, what this engine's typically ran to. With nothing known, two tokens: its
        # allowance then comes from its decoding.
        cap = lease.request.max_tokens
        lengths = self.lengths.of(lease.request.standing.tenant)
        n = cap
        if lengths is not None:
            n = lengths.at_least(2) if cap is None else min(cap, lengths.at_least(2))
        elif prof.output_tokens is not None:
            typical = max(2, round(prof.output_tokens))
            n = typical if n is None else min(n, typical)
        entry = self._stream(ledger, name, n, lease.request.standing.rank, lengths, cap)
        self._entries[lease] = (entry, charge, n)

    def _stream(
        self,
        ledger: Streams,
        name: str,
        n: int | None,
        rank: int,
        lengths: Histogram | None,
        cap: int | None,
    ) -> int | None:
        """A stream held to `n` tokens joins engine `name`'s ledger (this router's or a
        peer's); its entry, or None for an answer of one token (no stream to hold)."""
        if n is not None and n <= 1:
            return None
        assert self.tpot_target_s is not None
        aim = TPOT_AIM * self.tpot_target_s
        return ledger.joined(aim, self._tau0(name, aim), n or 2, rank, lengths, cap)

    def footprint(self, lease: Lease) -> tuple[float | None, int | None]:
        """What placing `lease` charged its engine's TPOT ledger: its prefill's seconds,
        and the length its stream is held to (Nones: nothing charged)."""
        placed = self._entries.get(lease)
        if placed is None:
            return None, None
        return placed[1].stall_s, placed[2]

    # -- work another active router placed (router/peering) -----------------------------
    def placed_elsewhere(self, p: Placed, e: Engine) -> PeerHold | None:
        """Another router placed `p` on `e`: its blocks are in `e`'s cache from now on, its
        conversation is there, and its prefill and stream are in `e`'s ledger as this
        router's own would be."""
        if p.blocks is not None and self.cache is not None:
            self.cache.placed(e.name, PromptBlocks.unpacked(p.blocks))
        self.sessions.placed(p.session, e.name)
        ledger = self.streams.get(e.name)
        if self.tpot_target_s is None or ledger is None or p.stall_s is None:
            return None
        charge = ledger.charge(p.stall_s)
        tenant = p.tenant or ""
        lengths = self.lengths.of(tenant)
        entry = self._stream(ledger, e.name, p.n, p.rank, lengths, p.cap)
        return PeerHold(ledger, charge, entry, tenant)

    def elsewhere_decoding(self, w: PeerHold) -> None:
        # Measured by the tokens its router tells (`Progress`), as that router measures it:
        # bounded by its decode time alone, a peer's stream looked slower than it was, and
        # two active routers refused an eighth of the chat trace for pace where one refused
        # none (bench/README.md, "Active routers").
        w.charge.settle()
        if w.entry is not None:
            w.ledger.decoding(w.entry, time.monotonic(), w.tally)

    def elsewhere_ended(
        self, w: PeerHold, output_tokens: int, decode_s: float, finished: bool
    ) -> None:
        if finished:
            # Answer lengths are the fleet's: each router holds new streams to the quantile
            # of every answer, not of the share it relayed itself.
            self.lengths.observe(w.tenant, output_tokens)
        w.charge.settle()
        if w.entry is not None:
            w.ledger.ended(w.entry, output_tokens, decode_s)
            self._wake()

    def evicted_elsewhere(self, d: Evicted) -> None:
        if self.cache is not None:
            self.cache.cut_elsewhere(d.engine, PromptBlocks.unpacked(d.blocks), d.keep)

    def share_headroom(self, unheard: Unheard) -> None:
        if self.tpot_target_s is not None:
            self._unheard = unheard

    def tell_evictions(self, told: Callable[[str, PromptBlocks, int], None]) -> None:
        if self.cache is not None:
            self.cache.told = told

    def picture(self) -> Picture:
        """What this router holds of the fleet, for a router that joins."""
        cache = {}
        if self.cache is not None:
            for name in self._engines:
                held = self.cache.held(name)
                if held:
                    cache[name] = held
        return Picture(cache, self.sessions.recent(), self.predictor.export())

    def take_picture(self, p: Picture) -> None:
        """A joining router's start: another router's picture of the fleet."""
        if self.cache is not None:
            for name, held in p.cache.items():
                if name in self._engines:
                    self.cache.placed(name, PromptBlocks.unpacked(held))
        for key, name in p.sessions:
            if name in self._engines:
                self.sessions.placed(key, name)
        if p.profiles is not None:
            self.predictor.load(p.profiles)

    def _tau0(self, name: str, aim: float) -> float:
        """The engine's step without prefill: learned from its clean streams, else its
        measured time per token (stalls included: an overestimate), else what the other
        engines' clean streams say, else half the aim. A stream always joins the ledger:
        one an engine had no figure for yet was left unprotected, and under a burst every
        stream on an engine that had not yet finished one was (bench/README.md, "Fleet")."""
        ledger = self.streams[name]
        if ledger.tau0_s is not None:
            return ledger.tau0_s
        measured = self.predictor.profiles[name].tpot_s
        if measured is not None:
            return measured
        others = [s.tau0_s for s in self.streams.values() if s.tau0_s is not None]
        return statistics.median(others) if others else COLD_TAU0_SHARE * aim

    def watch(self, events: Events) -> None:
        self.predictor.watch(events)
        events.subscribe(
            first_output=self._decoding, finished=self._finished, released=self._released
        )

    def degraded(self, engines: list[Engine]) -> str | None:
        return self.predictor.degraded(engines)

    def describe(self) -> dict[str, Any] | None:
        """The TPOT ledger's state for `/ready` (None without a TPOT target): how long
        answers run, and per engine the streams held, the step without prefill, the
        prefill placed there that has not run, and how much more it can take."""
        if self.tpot_target_s is None:
            return None
        now = time.monotonic()
        engines = {}
        for name, ledger in self.streams.items():
            head = ledger.headroom_s(now)
            engines[name] = {
                "streams": len(ledger),
                "tau0_ms": None if ledger.tau0_s is None else round(ledger.tau0_s * 1000, 2),
                "pending_prefill_s": round(ledger.pending_s, 3),
                "headroom_s": None if head is None else round(head, 3),
            }
        return {"lengths": self.lengths.describe(), "engines": engines}

    def _decoding(self, lease: Lease) -> None:
        placed = self._entries.get(lease)
        if placed is None:
            return
        entry, charge, _ = placed
        charge.settle()  # its prefill has run
        ledger = self.streams.get(lease.on.name)
        if entry is not None and ledger is not None:
            ledger.decoding(entry, lease.measured.first_at, lease.measured.tally)

    def _finished(self, lease: Lease) -> None:
        if not lease.warm:
            m = lease.measured
            self.lengths.observe(lease.request.standing.tenant, m.output_tokens, m.natural)
        self._reported(lease)

    def _released(self, lease: Lease) -> None:
        expected = self._expected.pop(lease, None)
        if lease.warm and not lease.measured.first_at and expected is not None:
            # A warm that yielded before its first token: what the engine computed of it
            # is not known, so the picture holds no more than it expected before the warm.
            assert self.cache is not None
            blocks, exp = expected
            self.cache.cut(lease.on.name, blocks, exp.blocks)
        placed = self._entries.pop(lease, None)
        if placed is None:
            return
        entry, charge, _ = placed
        charge.settle()
        ledger = self.streams.get(lease.on.name)
        if entry is None or ledger is None:
            return
        ledger.ended(entry, lease.measured.output_tokens, lease.measured.decode_s)
        self._wake()

    def _wake(self) -> None:
        """A stream left a ledger: those waiting for pace are judged again."""
        for order, ended in enumerate(self._ended):
            if ended is not None:
                if not ended.done():
                    ended.set_result(None)
                self._ended[order] = None

    async def room(self, timeout_s: float, order: int = 2) -> None:
        """Returns when a stream in the ledger ends (an engine may keep pace again), or
        after `timeout_s`; waiters of a lower order are woken before a higher one's."""
        ended = self._ended[order]
        if ended is None:
            ended = self._ended[order] = asyncio.get_running_loop().create_future()
        self._waiting[order] += 1
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(ended), timeout_s)
        finally:
            self._waiting[order] -= 1

    def _reported(self, lease: Lease) -> None:
        """The engine's own count of cached tokens corrects the picture."""
        expected = self._expected.pop(lease, None)
        cached = lease.measured.cached_tokens
        if expected is None or cached is None:
            return
        assert self.cache is not None
        blocks, exp = expected
        self.cache.reported(lease.on.name, blocks, exp, cached, lease.measured.prompt_tokens)
