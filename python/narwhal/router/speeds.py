"""Each engine's prefill speed against the fleet's fit, shrunk toward the fleet's mean by
empirical Bayes (`Predictor._pooled` reads it).

An engine's paces are the decayed weight, sum and sum of squares of ln(measured / the
fleet fit's projection) over its own samples. The fleet's reading (the mean pace, the
noise of one sample about its engine's mean, how far engines' means truly differ) is kept
as running sums of each engine's terms, so one engine's new sample re-reads the fleet in
constant time: read afresh from every engine on each sample it cost about a microsecond an
engine on the router's loop (960 us a finished request on 1,000 engines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# One engine's part of the sums: engines, weight, sum, degrees of freedom, squares about
# its own mean, its mean, its mean squared, 1 / weight.
_Terms = tuple[float, float, float, float, float, float, float, float]
_NONE: _Terms = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _terms(weight: float, total: float, squares: float) -> _Terms:
    mean = total / weight
    return (
        1.0,
        weight,
        total,
        max(0.0, weight - 1),
        max(0.0, squares - total * total / weight),
        mean,
        mean * mean,
        1 / weight,
    )


@dataclass(frozen=True)
class Reading:
    """The fleet's paces as one sample's worth of them sees it."""

    mean: float  # the weighted mean pace over every engine's samples
    noise: float | None  # a sample's variance about its engine's mean (None: none measured twice)
    between: float  # how far engines' mean paces differ beyond what noise makes

    def speed(self, weight: float, total: float) -> float:
        """An engine's speed (measured / the fleet fit's projection) from its paces: its
        own mean pace trusted as far as engines differ beyond its samples' noise."""
        if self.noise is None:
            return math.exp(self.mean)  # nothing tells noise from speed
        told = self.between + self.noise / weight
        trust = self.between / told if told > 0 else 1.0
        return math.exp(self.mean + trust * (total / weight - self.mean))


class Speeds:
    """The sums of every measured engine's terms, and each one's terms in them."""

    def __init__(self) -> None:
        self._rows: dict[str, _Terms] = {}
        self._sums: list[float] = list(_NONE)

    def __len__(self) -> int:
        return len(self._rows)

    def names(self) -> list[str]:
        return list(self._rows)

    def put(self, name: str, weight: float, total: float, squares: float) -> None:
        """`name`'s paces are now these (weight > 0)."""
        new = _terms(weight, total, squares)
        old = self._rows.get(name, _NONE)
        self._rows[name] = new
        self._sums = [s - o + n for s, o, n in zip(self._sums, old, new, strict=True)]

    def drop(self, name: str) -> None:
        old = self._rows.pop(name, None)
        if old is not None:
            self._sums = [s - o for s, o in zip(self._sums, old, strict=True)]

    def resum(self) -> None:
        """The sums added afresh: what adding and taking away over a long run rounds off."""
        sums = list(_NONE)
        for row in self._rows.values():
            sums = [s + t for s, t in zip(sums, row, strict=True)]
        self._sums = sums

    def reading(self) -> Reading | None:
        """None where no engine is measured."""
        n, weight, total, dof, within, means, squares, inverse = self._sums
        if n < 1 or weight <= 0:
            return None
        mean = total / weight
        noise = within / dof if dof >= 1 else None
        between = 0.0
        if noise is not None and n >= 2:
            seen = max(0.0, squares - 2 * mean * means + n * mean * mean) / (n - 1)
            between = max(0.0, seen - noise * inverse / n)
        return Reading(mean, noise, between)
