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

`tau0` is learned per engine from streams that shared few steps with prefill.
"""

from __future__ import annotations

import heapq
import itertools

ALPHA = 0.2
# A stream whose ledger charge was under this share of its decode time had steps of its
# own, mostly: its time per token says what a step without prefill costs.
CLEAN_SHARE = 0.25


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
        self._live: dict[int, float] = {}  # entry -> charge when it was placed

    def headroom_s(self) -> float | None:
        """Prefill seconds the engine can take before some stream there misses its target;
        None with no stream to protect."""
        heap = self._heap
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        return heap[0][0] - self.charged_s if heap else None

    def fits(self, stall_s: float) -> bool:
        room = self.headroom_s()
        return room is None or stall_s <= room

    def placed(self, stall_s: float, allowance_s: float | None) -> int | None:
        """A prompt whose prefill takes `stall_s` was placed here; its stream, when it has
        an allowance, joins the ledger after its own prefill. Returns its entry."""
        self.charged_s += stall_s
        if allowance_s is None:
            return None
        entry = next(self._order)
        self._live[entry] = self.charged_s
        heapq.heappush(self._heap, (self.charged_s + allowance_s, entry))
        return entry

    def ended(self, entry: int, output_tokens: int, decode_s: float) -> None:
        """The stream left; what it measured teaches `tau0`."""
        joined = self._live.pop(entry, None)
        if len(self._heap) > 4 * len(self._live) + 64:
            # Ended entries leave the heap when they reach its top; one long-lived stream
            # at the top would let the rest pile up behind it.
            self._heap = [x for x in self._heap if x[1] in self._live]
            heapq.heapify(self._heap)
        if joined is None or output_tokens < 2 or decode_s <= 0:
            return
        charge = self.charged_s - joined
        if charge > CLEAN_SHARE * decode_s:
            return
        sample = (decode_s - charge) / (output_tokens - 1)
        self.tau0_s = sample if self.tau0_s is None else (1 - ALPHA) * self.tau0_s + ALPHA * sample

    def __len__(self) -> int:
        return len(self._live)
