"""How long answers run: a learned distribution of output lengths, read as a quantile.

The router cannot know an answer's length: clients ask for a generous `max_tokens` (or
none) and answers stop at the model's end of text. What it can know is how long answers
have run, per tenant (a tenant's traffic is one application: summaries, chats, agent
steps) and over the whole router. The TPOT ledger (`tpot.py`) holds each stream to the
length it is expected to reach; a stall weighs most on a short stream, so the expectation
is a low quantile of the lengths, not their mean (one long answer in ten lifts a mean far
above what most answers run to), and it grows with the stream: of the answers that have
reached `k` tokens, `QUANTILE` stopped before `at_least(k)`.

An answer that has not ended says how long it is at least: the streams still running and
those a client left or a fault cut are right-censored, and the distribution is the
Kaplan-Meier estimate over them and the answers that ended (one its `max_tokens` stopped
ended there: it is how long a stream of its kind runs).
Read from ended answers alone it is biased short exactly when it matters most: a fresh
router's first answers to end are its shortest, while the long ones still stream (on a mix
of chats, RAG and agent steps it refused 7.5 % of a light load for pace, bench/README.md,
"A fresh router").

`max_tokens`, when the client sets it, is only a cap.
"""

from __future__ import annotations

import math

from .tpot import Tally

# The share of answers (that reached a given length) expected to stop sooner than the
# ledger assumes: a quarter are held to a length they do not reach, their stall's cost
# spread over fewer tokens than it will be (TPOT_AIM's slack covers them).
QUANTILE = 0.25
# Log-spaced buckets, this many an octave, up to 2^OCTAVES tokens.
PER_OCTAVE = 4
OCTAVES = 18
# Answers ended before a distribution is read (the router's, then a tenant's own).
MIN_SAMPLES = 20
# About this many recent answers weigh in: each new one counts e^(1/MEMORY) more.
MEMORY = 1000
# The table of quantiles is rebuilt after this many answers have ended, not after each;
# after each while the distribution is young (the running streams move it most then).
REBUILD_EVERY = 16
YOUNG = 10 * MIN_SAMPLES

_BUCKETS = PER_OCTAVE * OCTAVES + 1
_GROWTH = math.exp(1.0 / MEMORY)


def _bucket(tokens: int) -> int:
    if tokens <= 1:
        return 0
    return min(_BUCKETS - 1, int(math.log2(tokens) * PER_OCTAVE))


def _floor(bucket: int) -> int:
    """The smallest length in `bucket`."""
    return max(1, math.ceil(2 ** (bucket / PER_OCTAVE)))


class Histogram:
    """Decayed counts of answer lengths, ended and censored, the streams running now, and
    from them the quantile table."""

    __slots__ = (
        "_censored",
        "_dirty",
        "_ended",
        "_running",
        "_table",
        "_weight",
        "cut",
        "samples",
    )

    def __init__(self) -> None:
        self._ended = [0.0] * _BUCKETS  # answers that ended at their own length
        self._censored = [0.0] * _BUCKETS  # answers cut at a length they would have passed
        self._running: dict[object, Tally] = {}  # streams decoding now: censored as they stand
        self._weight = 1.0  # what the next answer counts (older ones fade against it)
        self._table: list[int] | None = None
        self._dirty = 0
        self.samples = 0  # answers that ended at their own length
        self.cut = 0  # answers cut at a length they would have passed

    @property
    def streaming(self) -> int:
        """Streams decoding now (censored as they stand)."""
        return len(self._running)

    def add(self, tokens: int, complete: bool = True) -> None:
        counts = self._ended if complete else self._censored
        counts[_bucket(tokens)] += self._weight
        self._weight *= _GROWTH
        if self._weight > 1e12:  # rescale before the floats lose the small counts
            self._ended = [c / self._weight for c in self._ended]
            self._censored = [c / self._weight for c in self._censored]
            self._weight = 1.0
        if complete:
            self.samples += 1
        else:
            self.cut += 1
        self._dirty += 1
        if self._dirty >= REBUILD_EVERY or self.samples < YOUNG:
            self._table = None

    def at_least(self, tokens: int) -> int:
        """Of the answers that reached `tokens`, the length all but QUANTILE reach (a
        bucket's floor: the lower, the more the ledger protects); never below `tokens`."""
        if self._table is None:
            self._table = self._build()
            self._dirty = 0
        return max(tokens, self._table[_bucket(tokens)])

    def _build(self) -> list[int]:
        ended = self._ended
        left = list(self._censored)
        for tally in self._running.values():
            if tally.counted > 0:
                left[_bucket(tally.counted)] += self._weight
        # survival[i]: the estimated share of answers that reach bucket i (Kaplan-Meier: of
        # those at risk there, ended or censored in it or beyond, the ended ones leave).
        survival = [1.0] * (_BUCKETS + 1)
        at_risk = sum(ended) + sum(left)
        last = 0  # the highest bucket anything reached: a quantile past it is unknown
        for i in range(_BUCKETS):
            if ended[i] or left[i]:
                last = i
            gone = ended[i] / at_risk if at_risk > 1e-12 else 1.0
            survival[i + 1] = survival[i] * max(0.0, 1.0 - gone)
            at_risk -= ended[i] + left[i]
        table = [_floor(i) for i in range(_BUCKETS)]
        j = 0
        for i in range(last):
            if survival[i] <= 0.0:
                continue
            # The first bucket by whose end QUANTILE of the answers that reached bucket i
            # have ended (the target only falls with i: the walk only moves forward); the
            # highest bucket reached where the censored ones leave it unknown.
            stop = (1.0 - QUANTILE) * survival[i]
            j = max(j, i)
            while j < last and survival[j + 1] > stop:
                j += 1
            table[i] = _floor(j)
        return table


class Lengths:
    """Answer lengths per tenant and over the router; one owner (the predictive policy)."""

    def __init__(self) -> None:
        self._all = Histogram()
        self._tenants: dict[str, Histogram] = {}

    def _of(self, tenant: str) -> list[Histogram]:
        if not tenant:
            return [self._all]
        h = self._tenants.get(tenant)
        if h is None:
            h = self._tenants[tenant] = Histogram()
        return [self._all, h]

    def started(self, key: object, tenant: str, tally: Tally) -> None:
        """A stream began decoding: until it ends, it has run at least `tally.counted`."""
        for h in self._of(tenant):
            h._running[key] = tally

    def ended(self, key: object, tenant: str, tokens: int, complete: bool = True) -> None:
        """An answer of `tokens` ended: at its own length (`complete`), or cut at a length
        it would have passed."""
        for h in self._of(tenant):
            h._running.pop(key, None)
            if tokens >= 1:
                h.add(tokens, complete)

    def cut(self, key: object, tenant: str) -> None:
        """A stream let go without ending (its client left, a fault): it ran at least what
        it counted. Nothing for a stream that `ended` or never decoded."""
        for h in self._of(tenant):
            tally = h._running.pop(key, None)
            if tally is not None and tally.counted >= 1:
                h.add(tally.counted, complete=False)

    def of(self, tenant: str) -> Histogram | None:
        """The distribution to read for `tenant`'s answers ("": none): its own once it has
        enough, else the router's; None before the router has seen enough."""
        h = self._tenants.get(tenant) if tenant else None
        if h is not None and h.samples >= MIN_SAMPLES:
            return h
        return self._all if self._all.samples >= MIN_SAMPLES else None

    def describe(self) -> dict[str, int | bool | None]:
        """The router's lengths for `/ready`: what was seen, and what a new stream is held
        to (None until enough answers ended)."""
        h = self._all
        ready = h.samples >= MIN_SAMPLES
        return {
            "ended": h.samples,
            "cut": h.cut,
            "streaming": h.streaming,
            "ready": ready,
            "new_stream_tokens": h.at_least(2) if ready else None,
        }
