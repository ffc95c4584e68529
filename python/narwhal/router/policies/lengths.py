"""How long answers run: a learned distribution of output lengths, read as a quantile.

The router cannot know an answer's length: clients ask for a generous `max_tokens` (or
none) and answers stop at the model's end of text. What it can know is how long answers
have run, per tenant (a tenant's traffic is one application: summaries, chats, agent
steps) and over the whole router. The TPOT ledger (`tpot.py`) holds each stream to the
length it is expected to reach; a stall weighs most on a short stream, so the expectation
is a low quantile of the lengths, not their mean (one long answer in ten lifts a mean far
above what most answers run to), and it grows with the stream: of the answers that have
reached `k` tokens, `QUANTILE` stopped before `at_least(k)`.

`max_tokens`, when the client sets it, is only a cap; an answer that ran to it says only
that answers run at least that long, and is read only until enough answers have ended on
their own (one its client cut short is never read).
"""

from __future__ import annotations

import math

# The share of answers (that reached a given length) expected to stop sooner than the
# ledger assumes: those are held to a length they do not reach, their stall's cost spread
# over fewer tokens than it will be. At a quarter, TPOT_AIM's slack did not cover them: the
# streams served over the TPOT target were short answers (13-76 tokens, held to ~95) and
# kept Narwhal under 99 % of what it serves within SLO on most fleets; at a tenth, on 64
# engines, 2-3.5x fewer such streams, for a few more refusals at light load on 8 engines
# (bench/README.md, "Answers held to the tenth").
QUANTILE = 0.1
# Log-spaced buckets, this many an octave, up to 2^OCTAVES tokens.
PER_OCTAVE = 4
OCTAVES = 18
# Answers before a distribution is read (the router's, then a tenant's own).
MIN_SAMPLES = 20
# About this many recent answers weigh in: each new one counts e^(1/MEMORY) more.
MEMORY = 1000
# The table of quantiles is rebuilt after this many new answers, not after each.
REBUILD_EVERY = 16

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
    """Decayed counts of answer lengths and, from them, the quantile table."""

    __slots__ = ("_counts", "_dirty", "_table", "_weight", "samples")

    def __init__(self) -> None:
        self._counts = [0.0] * _BUCKETS
        self._weight = 1.0  # what the next answer counts (older ones fade against it)
        self._table: list[int] | None = None
        self._dirty = 0
        self.samples = 0

    def add(self, tokens: int) -> None:
        self._counts[_bucket(tokens)] += self._weight
        self._weight *= _GROWTH
        if self._weight > 1e12:  # rescale before the floats lose the small counts
            self._counts = [c / self._weight for c in self._counts]
            self._weight = 1.0
        self.samples += 1
        self._dirty += 1
        if self._dirty >= REBUILD_EVERY:
            self._table = None

    def at_least(self, tokens: int) -> int:
        """Of the answers that reached `tokens`, the length all but QUANTILE reach (a
        bucket's floor: the lower, the more the ledger protects); never below `tokens`."""
        if self._table is None:
            self._table = self._build()
            self._dirty = 0
        return max(tokens, self._table[_bucket(tokens)])

    def _build(self) -> list[int]:
        counts = self._counts
        table = [0] * _BUCKETS
        above = 0.0  # the counts of buckets >= i
        for i in range(_BUCKETS - 1, -1, -1):
            above += counts[i]
            if not above:
                table[i] = _floor(i)
                continue
            target, seen, j = QUANTILE * above, 0.0, i
            while j < _BUCKETS - 1 and seen + counts[j] < target:
                seen += counts[j]
                j += 1
            table[i] = _floor(j)
        return table


class Lengths:
    """Answer lengths per tenant and over the router; one owner (the predictive policy).

    Answers that ended on their own are the lengths. Answers that ran to their max_tokens
    only bound them from below, and are read only until 20 of the first kind are seen: a
    router that has served nothing but capped answers (a warm-up, a probe) holds new
    streams to those rather than to nothing, and a fleet's opening burst keeps its pace."""

    def __init__(self) -> None:
        self._all = Histogram()
        self._tenants: dict[str, Histogram] = {}
        self._capped = Histogram()  # every answer, capped ones too: read until `_all` is

    def observe(self, tenant: str, tokens: int, natural: bool = True) -> None:
        """A finished answer; `natural` where it ended on its own (short of its max_tokens).
        One cut short by its client says nothing of its length: not observed."""
        if tokens < 1:
            return
        self._capped.add(tokens)
        if not natural:
            return
        self._all.add(tokens)
        if tenant:
            h = self._tenants.get(tenant)
            if h is None:
                h = self._tenants[tenant] = Histogram()
            h.add(tokens)

    def of(self, tenant: str) -> Histogram | None:
        """The distribution to read for `tenant`'s answers ("": none): its own once it has
        enough, else the router's, else (before the router has seen enough answers end on
        their own) every answer's; None before the router has seen enough of any."""
        h = self._tenants.get(tenant) if tenant else None
        if h is not None and h.samples >= MIN_SAMPLES:
            return h
        if self._all.samples >= MIN_SAMPLES:
            return self._all
        return self._capped if self._capped.samples >= MIN_SAMPLES else None

    def describe(self) -> dict[str, int | bool | None]:
        """The router's lengths for `/ready`: how many answers it has seen end on their own,
        whether new streams are held to a learned length, and to what (None: not yet)."""
        h = self.of("")
        return {
            "ended": self._all.samples,
            "ready": h is not None,
            "new_stream_tokens": h.at_least(2) if h is not None else None,
        }
