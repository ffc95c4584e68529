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
decoding, a stream within target has made at least one token every `target` seconds, so
after `d` seconds its allowance is at least `(1 - tau0 / target) x d`, whatever `n` was.
(A stream already over its target has made fewer and is credited too much; its target is
lost unless later steps run faster than the target, which a ledger cannot promise anyway.)
Allowances only grow, so the heap keeps a lower bound of each and the top is brought up to
date when it is read.

`tau0` is learned per engine from streams that shared few steps with prefill.
"""

from __future__ import annotations

import heapq
import itertools

ALPHA = 0.2
# A stream whose ledger charge was under this share of its decode time had steps of its
# own, mostly: its time per token says what a step without prefill costs.
CLEAN_SHARE = 0.25
# The top of the heap is brought up to date when its allowance has grown by more than this
# (seconds of prefill); what is read may understate the headroom by as much, never overstate.
REFRESH_S = 0.01


class Streams:
    """Per engine: the prefill placed there and the allowance each stream has left."""

    __slots__ = ("_heap", "_live", "charged_s", "tau0_s")

    _order = itertools.count()

    def __init__(self) -> None:
        self.charged_s = 0.0  # prefill seconds placed on the engine, ever
        self.tau0_s: float | None = None  # a step without prefill, learned
        # (charge at which the stream's allowance is spent, its entry): the smallest first;
        # ended streams leave `_live` at once and the heap when they reach its top.
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, _Stream] = {}

    def headroom_s(self, now: float) -> float | None:
        """Prefill seconds the engine can take before some stream there misses its target;
        None with no stream to protect."""
        heap, live = self._heap, self._live
        while heap:
            spent_at, entry = heap[0]
            stream = live.get(entry)
            if stream is None:
                heapq.heappop(heap)
                continue
            grown = stream.spent_at(now)
            if grown <= spent_at + REFRESH_S:
                return spent_at - self.charged_s
            heapq.heapreplace(heap, (grown, entry))
        return None

    def fits(self, stall_s: float, now: float) -> bool:
        room = self.headroom_s(now)
        return room is None or stall_s <= room

    def placed(self, stall_s: float, allowance_s: float | None, slope: float = 0.0) -> int | None:
        """A prompt whose prefill takes `stall_s` was placed here; its stream, when it has
        an allowance, joins the ledger after its own prefill. `slope` is what a second of
        its decoding adds to its allowance, `1 - tau0 / target`. Returns its entry."""
        self.charged_s += stall_s
        if allowance_s is None:
            return None
        entry = next(self._order)
        stream = _Stream(self.charged_s, allowance_s, slope)
        self._live[entry] = stream
        heapq.heappush(self._heap, (stream.spent_at(0.0), entry))
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
        sample = (decode_s - charge) / (output_tokens - 1)
        self.tau0_s = sample if self.tau0_s is None else (1 - ALPHA) * self.tau0_s + ALPHA * sample

    def __len__(self) -> int:
        return len(self._live)


class _Stream:
    __slots__ = ("allowance", "joined", "since", "slope")

    def __init__(self, joined: float, allowance: float, slope: float) -> None:
        self.joined = joined  # the engine's charge when the stream joined
        self.allowance = allowance  # from the length it was expected to run to
        self.slope = slope
        self.since: float | None = None  # when it started decoding

    def spent_at(self, now: float) -> float:
        """The engine's charge at which this stream's allowance is spent, as of `now`."""
        grown = 0.0 if self.since is None else self.slope * (now - self.since)
        return self.joined + max(self.allowance, grown)
