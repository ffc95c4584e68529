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
prefill seconds placed there; a stream's allowance is spent by what was placed after it.
Placing a prompt keeps pace on an engine when its prefill fits the smallest allowance left
among the streams there: a short stream, nearly spent, is exactly the one a long prefill
breaks. Counting prefill placed after a stream as if it all ran during its decode is
conservative: a stream that ends early leaves the ledger then.

`n` is a guess, and a stream that outlives it must not hold its engine to the guess: once
decoding for `d` seconds, of which at most `c` (the prefill charged since it joined) were
spent waiting on prefill, a stream that keeps to its target has made at least
`(d - c) / target` tokens, so its allowance is at least `slope x (d - c)` with
`slope = 1 - tau0 / target`, whatever `n` was. The heap is keyed by each stream's
allowance from `n` (a lower bound of its true one, forever); reading it takes streams off
its top until the smallest true allowance seen is below the next key, then puts them back.

`tau0` is learned per engine from streams that shared few steps with prefill: the median
of the last few, since one stream stalled by something the ledger never saw (a prefill
larger than sized, an eviction) would otherwise shut its engine to prefill for a while.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import deque

# Clean samples kept for the median.
SAMPLES = 7
# A stream whose ledger charge was under this share of its decode time had steps of its
# own, mostly: its time per token says what a step without prefill costs.
CLEAN_SHARE = 0.25


class Streams:
    """Per engine: the prefill placed there and the allowance each stream has left."""

    __slots__ = ("_heap", "_live", "_samples", "charged_s", "tau0_s")

    _order = itertools.count()

    def __init__(self) -> None:
        self.charged_s = 0.0  # prefill seconds placed on the engine, ever
        self.tau0_s: float | None = None  # a step without prefill, learned
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        # (charge at which the stream's allowance is spent, its entry): the smallest first;
        # ended streams leave `_live` at once and the heap when they reach its top.
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, _Stream] = {}

    def headroom_s(self, now: float) -> float | None:
        """Prefill seconds the engine can take before some stream there misses its target;
        None with no stream to protect."""
        heap, live, charged = self._heap, self._live, self.charged_s
        while heap and heap[0][1] not in live:
            heapq.heappop(heap)
        if not heap:
            return None
        key, entry = heap[0]
        best = live[entry].spent_at(now, charged)
        if best == key:  # the tightest stream has not outlived its expected length
            return key - charged
        taken = [heapq.heappop(heap)]
        while heap and heap[0][0] < best:
            key, entry = heapq.heappop(heap)
            stream = live.get(entry)
            if stream is not None:
                taken.append((key, entry))
                best = min(best, stream.spent_at(now, charged))
        for x in taken:
            heapq.heappush(heap, x)
        return best - charged

    def fits(self, stall_s: float, now: float) -> bool:
        room = self.headroom_s(now)
        return room is None or stall_s <= room

    def charge(self, stall_s: float) -> None:
        """A prompt whose prefill takes `stall_s` is on its way here (judged, not placed
        yet): every stream here now will wait it out."""
        self.charged_s += stall_s

    def placed(self, stall_s: float, allowance_s: float | None, slope: float = 0.0) -> int | None:
        """A prompt whose prefill takes `stall_s` was placed here; its stream, when it has
        an allowance, joins the ledger after its own prefill. `slope` is what a second of
        its own decoding adds to its allowance. Returns its entry."""
        self.charged_s += stall_s
        if allowance_s is None:
            return None
        entry = next(self._order)
        stream = _Stream(self.charged_s, allowance_s, slope)
        self._live[entry] = stream
        heapq.heappush(self._heap, (stream.joined + allowance_s, entry))
        return entry

    def decoding(self, entry: int, since: float) -> None:
        """The stream's first token arrived at `since`: its allowance grows from then."""
        stream = self._live.get(entry)
        if stream is not None:
            stream.since = since

    def ended(self, entry: int, output_tokens: int, decode_s: float) -> None:
        """The stream left; what it measured teaches `tau0`."""
        stream = self._live.pop(entry, None)
        if len(self._heap) > 4 * len(self._live) + 64:
            # Ended entries leave the heap when they reach its top; one long-lived stream
            # at the top would let the rest pile up behind it.
            self._heap = [x for x in self._heap if x[1] in self._live]
            heapq.heapify(self._heap)
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
    __slots__ = ("allowance", "joined", "since", "slope")

    def __init__(self, joined: float, allowance: float, slope: float) -> None:
        self.joined = joined  # the engine's charge when the stream joined
        self.allowance = allowance  # from the length it was expected to run to
        self.slope = slope
        self.since: float | None = None  # when it started decoding

    def spent_at(self, now: float, charged: float) -> float:
        """The engine's charge at which this stream's allowance is spent, as of `now` with
        `charged` placed on the engine so far."""
        if self.since is None:
            return self.joined + self.allowance
        waited = charged - self.joined  # the most it can have waited on prefill
        grown = self.slope * (now - self.since - waited)
        return self.joined + max(self.allowance, grown)
