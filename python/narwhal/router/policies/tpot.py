"""What placing a prompt does to the streams decoding beside it (time per output token).

Engines that batch continuously with chunked prefill (vLLM, SGLang, LexiEngine) put each
step's prefill tokens beside every decoding stream's next token, so a step lasts about
`tau0 + prefill tokens in it / R`, where `tau0` is the step without prefill (weights and KV
reads) and `R` the prefill rate. Engines prefill first come, first served: every uncached
token placed on an engine after a stream was placed there is prefilled while that stream
decodes (or after it has ended), and costs it `1 / R` seconds.

So each stream has an allowance: the decode time its target leaves beyond its own steps,
`(target - tau0) x (n - 1)` for `n` output tokens (the request's `max_tokens`, or what
the engine's answers typically run to when it has none). Per engine, a ledger counts the
prefill seconds placed there (`charged_s`) and, of those, what has not run yet (`pending_s`:
prompts placed that have not started to decode). Placing a prompt keeps pace on an engine
when its prefill fits the smallest allowance left among the streams there: a short stream,
nearly spent, is exactly the one a long prefill breaks.

Until a stream decodes, its allowance is spent by the prefill placed after it, as if all
of it ran during its decode (conservative: a stream that ends early leaves the ledger then).
Once it decodes and the relay counts its tokens (`Tally`), the past is measured instead of
bounded: a stream that has made `k` tokens in `d` seconds and runs to `N = max(n, k)` keeps
its target while the prefill still to run beside it fits
`target x (N - 1) - d - tau0 x (N - k)`, so a stream stalled less than charged, or one that
outlives its expected length, no longer holds its engine to a bound. A stream nothing counts
falls back on its decoding time: of `d` seconds, at most `c` (the prefill charged since it
joined) were spent waiting, so it has made at least `(d - c) / target` tokens, and its
allowance is at least `slope x (d - c)` with `slope = 1 - tau0 / target`.

Each kind has its heap, keyed by a lower bound of its stream's true value (for the measured
kind, `target x (n - 1) + start - tau0 x n`, which `k` only raises); reading one takes streams
off its top until the smallest true value seen is below the next key, then puts them back.

Streams have a rank (a priority class, 0 the highest) and a prompt is held only to the
allowance of streams of its own rank or higher: critical work may spend what a standard
stream had left, as an engine that schedules by priority would preempt it, and is kept out
only by streams as urgent as itself. Each rank has its heaps.

`tau0` is learned per engine from streams that shared few steps with prefill: the median
of the last few, since one stream stalled by something the ledger never saw (a prefill
larger than sized, an eviction) would otherwise shut its engine to prefill for a while.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from narwhal.router.policies.lengths import Histogram

# Clean samples kept for the median.
SAMPLES = 7
# A stream whose ledger charge was under this share of its decode time had steps of its
# own, mostly: its time per token says what a step without prefill costs.
CLEAN_SHARE = 0.25


class Tally(Protocol):
    """What counts a stream's output tokens as they are relayed (the relay itself)."""

    @property
    def counted(self) -> int: ...


class Charge:
    """A prompt's prefill charged to an engine's ledger: pending until it has run there (its
    first token came) or will not (it went elsewhere, or nowhere)."""

    __slots__ = ("ledger", "open", "stall_s")

    def __init__(self, ledger: Streams, stall_s: float) -> None:
        self.ledger = ledger
        self.stall_s = stall_s
        self.open = True

    def settle(self) -> None:
        """Its prefill is no longer ahead of the streams there (idempotent)."""
        if self.open:
            self.open = False
            ledger = self.ledger
            ledger.pending_s = max(0.0, ledger.pending_s - self.stall_s)


class Streams:
    """Per engine: the prefill placed there and the allowance each stream has left."""

    __slots__ = ("_heaps", "_live", "_samples", "charged_s", "pending_s", "tau0_s")

    _order = itertools.count()

    def __init__(self, ranks: int = 1) -> None:
        self.charged_s = 0.0  # prefill seconds placed on the engine, ever
        self.pending_s = 0.0  # of those, prefill that has not run yet
        self.tau0_s: float | None = None  # a step without prefill, learned
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        # Per rank, two heaps of (a lower bound of the stream's value, its entry), the
        # smallest first: streams held to the charge (in charge units) and streams measured
        # by their tokens (in seconds). Ended streams leave `_live` at once and a heap when
        # they reach its top.
        self._heaps: list[tuple[list[tuple[float, int]], list[tuple[float, int]]]] = [
            ([], []) for _ in range(ranks)
        ]
        self._live: dict[int, _Stream] = {}

    def headroom_s(self, now: float, rank: int | None = None) -> float | None:
        """Prefill seconds the engine can take before some stream there of `rank` or
        higher (every stream: None) misses its target; None with no such stream."""
        bounded = measured = None
        for b, m in self._heaps if rank is None else self._heaps[: rank + 1]:
            x = self._least(b, False, now)
            if x is not None and (bounded is None or x < bounded):
                bounded = x
            y = self._least(m, True, now)
            if y is not None and (measured is None or y < measured):
                measured = y
        if bounded is None:
            return None if measured is None else measured - now - self.pending_s
        room = bounded - self.charged_s
        return room if measured is None else min(room, measured - now - self.pending_s)

    def _least(self, heap: list[tuple[float, int]], measured: bool, now: float) -> float | None:
        """The smallest true value among the heap's streams."""
        live = self._live
        while heap and (heap[0][1] not in live or (live[heap[0][1]].tally is not None) != measured):
            heapq.heappop(heap)
        if not heap:
            return None
        charged = self.charged_s
        key, entry = heap[0]
        best = live[entry].value(now, charged)
        if best == key:  # the top stream's bound is its value
            return best
        taken = [heapq.heappop(heap)]
        while heap and heap[0][0] < best:
            key, entry = heapq.heappop(heap)
            stream = live.get(entry)
            if stream is not None and (stream.tally is not None) == measured:
                taken.append((key, entry))
                best = min(best, stream.value(now, charged))
        for x in taken:
            heapq.heappush(heap, x)
        return best

    def fits(self, stall_s: float, now: float, rank: int | None = None) -> bool:
        room = self.headroom_s(now, rank)
        return room is None or stall_s <= room

    def charge(self, stall_s: float) -> Charge:
        """A prompt whose prefill takes `stall_s` is on its way here (judged or placed):
        every stream here now will wait it out."""
        self.charged_s += stall_s
        self.pending_s += stall_s
        return Charge(self, stall_s)

    def joined(
        self,
        aim_s: float,
        tau0_s: float,
        n: int,
        rank: int = 0,
        lengths: Histogram | None = None,
        cap: int | None = None,
    ) -> int:
        """A stream of `rank` held to `aim_s` a token, expected to run to `n` tokens on
        steps of `tau0_s`, joins the ledger (after its own prompt was charged); once past
        `n`, to what `lengths` says answers that got as far run to (`cap` at most: its
        `max_tokens`), else to the token it is at. Returns its entry."""
        entry = next(self._order)
        stream = _Stream(self.charged_s, aim_s, tau0_s, n, rank, lengths, cap)
        self._live[entry] = stream
        heapq.heappush(self._heaps[rank][0], (stream.joined + stream.allowance, entry))
        return entry

    def decoding(self, entry: int, since: float, tally: Tally | None = None) -> None:
        """The stream's first token arrived at `since`: its allowance grows from then, by the
        tokens `tally` counts when something counts them."""
        stream = self._live.get(entry)
        if stream is None:
            return
        stream.since = since
        if tally is not None:
            stream.tally = tally
            heapq.heappush(self._heaps[stream.rank][1], (stream.floor(), entry))

    def ended(self, entry: int, output_tokens: int, decode_s: float) -> None:
        """The stream left; what it measured teaches `tau0`."""
        stream = self._live.pop(entry, None)
        for heap in (h for pair in self._heaps for h in pair):
            if len(heap) > 4 * len(self._live) + 64:
                # Ended entries leave a heap when they reach its top; one long-lived stream
                # at the top would let the rest pile up behind it.
                heap[:] = [x for x in heap if x[1] in self._live]
                heapq.heapify(heap)
        if stream is None or output_tokens < 2 or decode_s <= 0:
            return
        charge = self.charged_s - stream.joined
        if charge > CLEAN_SHARE * decode_s:
            return
        self._samples.append((decode_s - charge) / (output_tokens - 1))
        self.tau0_s = statistics.median(self._samples)

    def __len__(self) -> int:
        return len(self._live)


class _Stream:
    __slots__ = (
        "aim",
        "allowance",
        "cap",
        "joined",
        "lengths",
        "n",
        "rank",
        "since",
        "slope",
        "tally",
        "tau0",
    )

    def __init__(
        self,
        joined: float,
        aim: float,
        tau0: float,
        n: int,
        rank: int,
        lengths: Histogram | None = None,
        cap: int | None = None,
    ) -> None:
        self.joined = joined  # the engine's charge when the stream joined
        self.rank = rank
        self.lengths = lengths
        self.cap = cap
        self.aim = aim
        self.tau0 = tau0
        self.n = n
        self.allowance = max(0.0, aim - tau0) * (n - 1)  # from the length it was expected to run to
        self.slope = max(0.0, 1.0 - tau0 / aim) if aim > 0 else 0.0
        self.since: float | None = None  # when it started decoding
        # Its tokens so far, while it decodes; set, the stream is in the measured heap.
        self.tally: Tally | None = None

    def value(self, now: float, charged: float) -> float:
        """Measured: the time by which the prefill still to run beside it must end for it to
        keep its target. Else the engine's charge at which its allowance is spent."""
        if self.tally is not None:
            assert self.since is not None
            k = self.tally.counted
            n = self.reaches(k)
            return self.aim * (n - 1) + self.since - self.tau0 * (n - k)
        if self.since is None:
            return self.joined + self.allowance
        waited = charged - self.joined  # the most it can have waited on prefill
        grown = self.slope * (now - self.since - waited)
        return self.joined + max(self.allowance, grown)

    def reaches(self, k: int) -> int:
        """The length a stream at its `k`th token is held to: never below `n` or `k`, and
        growing with `k` (so `floor` stays a lower bound of `value`)."""
        if k < self.n:
            return self.n
        if self.lengths is None:
            return k
        n = self.lengths.at_least(k)
        return max(k, n if self.cap is None else min(n, self.cap))

    def floor(self) -> float:
        """`value` with no token counted yet: counting tokens only raises it."""
        assert self.since is not None
        return self.aim * (self.n - 1) + self.since - self.tau0 * self.n
