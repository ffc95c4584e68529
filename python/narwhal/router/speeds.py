"""Each engine's prefill speed against the fleet's fit, read with what the engines like it
measured (`Predictor._pooled` reads it).

An engine's paces are the decayed weight, sum and sum of squares of ln(measured / the fleet
fit's projection) over its own samples: their mean is its speed, read alone. A dozen
samples under live load scatter by a quarter (the fleet bench: a sample's ln about its
engine's mean deviates by 0.25, the engine's own jitter 0.1), so one engine's mean is off
by several percent; engines of one kind of device share a speed, and their samples together
say it closely. Which engines are of a kind is not declared: an engine's speed is the mean
of every engine's mean pace weighted by how likely it is that the two share a speed, given
how far apart their means are and how noisy each is (a kernel over the fleet's means:
nonparametric empirical Bayes). On a fleet of one kind all read the fleet's mean; on a
fleet of two kinds, each its kind's. Shrunk toward one mean, two kinds' spread about it
read as engines truly differing and each kept its own: engines of one kind ended
fleet-bench runs 1.05-1.26x apart (1.00-1.07x now).

How likely an engine is of another's kind is counted in engines, not samples: a kind is as
likely as the engines in it, and its samples only place its speed. Counted in samples, the
kind placement favours (the fast one, which takes most of the work) outweighed the slow
kind's few samples: a slow engine measured 2-8 times beside fast ones measured 25-75 times
read its speed further off (1.16x, rms) than its own mean alone says (1.13x; 1.10x read by
engines, tests/test_speeds.py), and one measured twice beside fast ones measured fifty times
1.6x off. On the fleet bench at 0.5x the slow engines' early projections were 0.57-0.82x
their prefills, and the margins that learned it refused 3.5-4.5 % of the trace.

The noise and the engines' means are kept as running sums and a histogram of the means, so
one engine's sample re-reads the fleet in time that does not grow with it: read afresh from
every engine on each sample it cost about a microsecond an engine on the router's loop (1.1
ms a finished request on 1,000 engines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The histogram's bins, in ln(speed): narrow against the kernel's width (twice a mean's
# noise: 0.08 at the least, with the pace's decay and the bench's noise).
BIN = 0.02
# Past this many kernel widths another engine's mean says nothing of this one's speed.
REACH = 4.0

# One engine's part of the sums: its weight, the degrees of freedom and squares about its
# own mean that say the noise, and its mean.
_Terms = tuple[float, float, float, float]


def _terms(weight: float, total: float, squares: float) -> _Terms:
    return (
        weight,
        max(0.0, weight - 1),
        max(0.0, squares - total * total / weight),
        total / weight,
    )


@dataclass(frozen=True)
class Reading:
    """The fleet's paces as one sample's worth of them sees it."""

    mean: float  # the weighted mean pace over every engine's samples
    noise: float | None  # a sample's variance about its engine's mean (None: none measured twice)


class Speeds:
    """The sums of every measured engine's terms, the histogram of their means (per bin:
    engines, weight, weighted sum of means), and each engine's terms in them."""

    def __init__(self) -> None:
        self._rows: dict[str, _Terms] = {}
        self._clear()

    def _clear(self) -> None:
        self._weight = self._total = self._dof = self._within = 0.0
        self._bins: dict[int, list[float]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def names(self) -> list[str]:
        return list(self._rows)

    def put(self, name: str, weight: float, total: float, squares: float) -> None:
        """`name`'s paces are now these (weight > 0)."""
        self.drop(name)
        self._add(name, _terms(weight, total, squares))

    def drop(self, name: str) -> None:
        old = self._rows.pop(name, None)
        if old is None:
            return
        weight, dof, within, mean = old
        self._weight -= weight
        self._total -= weight * mean
        self._dof -= dof
        self._within -= within
        k = math.floor(mean / BIN)
        b = self._bins[k]
        b[0] -= 1
        if b[0] < 0.5:
            del self._bins[k]
        else:
            b[1] -= weight
            b[2] -= weight * mean

    def _add(self, name: str, terms: _Terms) -> None:
        weight, dof, within, mean = terms
        self._rows[name] = terms
        self._weight += weight
        self._total += weight * mean
        self._dof += dof
        self._within += within
        b = self._bins.setdefault(math.floor(mean / BIN), [0.0, 0.0, 0.0])
        b[0] += 1
        b[1] += weight
        b[2] += weight * mean

    def resum(self) -> None:
        """The sums added afresh: what adding and taking away over a long run rounds off."""
        rows, self._rows = self._rows, {}
        self._clear()
        for name, terms in rows.items():
            self._add(name, terms)

    def reading(self) -> Reading | None:
        """None where no engine is measured."""
        if not self._rows or self._weight <= 0:
            return None
        noise = self._within / self._dof if self._dof >= 1 else None
        return Reading(self._total / self._weight, noise)

    def speed(self, reading: Reading, weight: float, total: float) -> float:
        """An engine's speed (measured / the fleet fit's projection) from its paces: the
        fleet's engines' means, each weighted by how likely its speed is this engine's,
        given the two means' noise (the engine's own among them); engines whose means share
        a bin are one mean there, weighted by their samples, counted as that many engines."""
        if reading.noise is None:
            return math.exp(reading.mean)  # nothing tells noise from speed
        own = total / weight
        width = 2 * reading.noise / weight  # the variance of a difference of two means
        if width <= 0:
            return math.exp(own)
        reach = REACH * math.sqrt(width)
        lo, hi = math.floor((own - reach) / BIN), math.floor((own + reach) / BIN)
        # The bins within reach, or every bin where there are fewer of those (few samples).
        near = range(lo, hi + 1) if hi - lo < len(self._bins) else list(self._bins)
        weights = means = 0.0
        for k in near:
            b = self._bins.get(k)
            if b is None or b[1] <= 0:
                continue
            mean = b[2] / b[1]
            if abs(mean - own) > reach:
                continue
            likely = b[0] * math.exp(-((mean - own) ** 2) / (2 * width))
            weights += likely
            means += likely * mean
        return math.exp(means / weights if weights > 0 else own)
