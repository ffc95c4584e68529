"""The fleet's prefill fit: every engine's measured prefills pooled, each engine's at its own
speed, and each engine's speed against the pool shrunk toward the fleet's as far as engines'
speeds spread no more than the noise of their samples explains (empirical Bayes).

One engine's own fit of the dozen noisy prompts it measured ranges widely, and placement
sends a prompt where its projection is least, so the most hopeful fit wins the long prompts
(the winner's curse: on 64 simulated engines at 0.5x they were served at two to five times
their projections). An engine's own samples are asked one number, how fast it is; the
curve's shape comes from all of them. On a fleet of one kind of device every engine reads
the pool; on a mixed one each keeps the speed its samples show.

Kept as sums: an engine's share (its fit's moments at its speed, weighted by the samples they
amount to) is taken out and put back when its fit moves, so a sample costs the same however
many engines there are, and the pool always reads every engine at its current speed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from narwhal.router.prefill_fit import PrefillFit

_MOMENTS = 9
# Where the pool's moments are read as a fit: its weight counts as that many samples.
_EVEN = 1e-9


@dataclass
class _Share:
    weight: float  # the samples its fit amounts to
    moments: list[float]  # its fit's weighted means, its times divided by its speed
    log_speed: float | None  # ln of its speed against the rest (None: its samples tell none)
    noise: float  # its samples' mean squared relative miss of that speed's fit
    evidence: float  # the samples its speed amounts to (short ones count for little)


class FleetFit:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._sums = [0.0] * _MOMENTS  # the shares' moments, each times its weight
        self._weight = 0.0
        self._shares: dict[str, _Share] = {}
        # Over the shares that tell a speed: how many, their log speeds' sum and squares,
        # their weighted noise and its degrees of freedom, the sum of 1 / their weights.
        self._told = 0
        self._logs = 0.0
        self._squares = 0.0
        self._noise = 0.0
        self._dof = 0.0
        self._thin = 0.0

    @property
    def samples(self) -> float:
        return self._weight

    def fit(self) -> tuple[float, float, float] | None:
        """The pool's (rate in tokens/s, overhead in s, quad in s a token^2), where its
        samples tell sizes apart; else None."""
        if self._weight <= 0:
            return None
        pooled = PrefillFit(
            m=[v / self._weight for v in self._sums], count=round(self._weight), alpha=_EVEN
        )
        return pooled.fit() if pooled.tells_sizes() else None

    def update(self, name: str, own: PrefillFit) -> tuple[tuple[float, float, float], float] | None:
        """Engine `name`'s fit moved: its share is taken out, its speed read against the rest,
        and its share put back at that speed. What it is projected by: (the pool's fit, its
        speed shrunk toward the fleet's), or None where the pool cannot tell sizes apart or
        its own samples tell no speed (mostly the fixed overhead: the router's probes)."""
        self.forget(name)
        weight = min(float(own.count), (2 - own.alpha) / own.alpha)
        if weight <= 0:
            return None
        rest = self.fit()
        told = _speed(own.m, rest) if rest is not None else None
        log_speed, noise, share_of = told if told is not None else (None, 0.0, 0.0)
        at = math.exp(log_speed if log_speed is not None else self._mean())
        share = _Share(weight, _slowed(own.m, at), log_speed, noise, weight * share_of)
        self._add(name, share)
        pool = self.fit()
        if log_speed is None or pool is None:
            return None
        return pool, math.exp(self._shrunk(log_speed, share.evidence))

    def forget(self, name: str) -> None:
        """An engine's share out of the pool (it left the fleet, or its fit moved)."""
        share = self._shares.pop(name, None)
        if share is not None:
            self._count(share, -1.0)

    def _add(self, name: str, share: _Share) -> None:
        self._shares[name] = share
        self._count(share, 1.0)

    def _count(self, share: _Share, sign: float) -> None:
        for i, v in enumerate(share.moments):
            self._sums[i] += sign * share.weight * v
        self._weight += sign * share.weight
        if share.log_speed is not None:
            self._told += int(sign)
            self._logs += sign * share.log_speed
            self._squares += sign * share.log_speed**2
            self._noise += sign * share.evidence * share.noise
            self._dof += sign * max(0.0, share.evidence - 1)
            self._thin += sign / max(share.evidence, 1e-9)
        if not self._shares:  # none left: not what sums of floats leave behind
            self._reset()

    def _mean(self) -> float:
        return self._logs / self._told if self._told > 0 else 0.0

    def _shrunk(self, log_speed: float, weight: float) -> float:
        """An engine's log speed, as far from the fleet's mean as engines' speeds spread
        beyond what their samples' noise makes of them: trust = spread / (spread + noise /
        its samples). Until an engine has measured twice, nothing tells noise from speed."""
        mean = self._mean()
        if self._told < 2 or self._dof < 1:
            return mean  # its own alone; or with several, no more than the fleet's yet
        noise = self._noise / self._dof
        seen = (self._squares - self._told * mean * mean) / (self._told - 1)
        spread = max(0.0, seen - noise * self._thin / self._told)
        told = spread + noise / weight
        trust = spread / told if told > 0 else 1.0
        return mean + trust * (log_speed - mean)


def _slowed(m: list[float], speed: float) -> list[float]:
    """A fit's moments with its times divided by `speed` (x1, x2, t, x1^2, x1 x2, x2^2,
    x1 t, x2 t, t^2)."""
    out = list(m)
    for i in (2, 6, 7):
        out[i] /= speed
    out[8] /= speed * speed
    return out


def _speed(m: list[float], pool: tuple[float, float, float]) -> tuple[float, float, float] | None:
    """How much longer this fit's samples took than the pool's fit projects (least squares
    of t = speed x f), as (ln speed, the samples' mean squared relative miss of it, the
    share of its samples the estimate amounts to: mean(f)^2 / mean(f^2), a short prompt
    among long ones counting for little); None where its samples are mostly the fixed
    overhead, which says nothing of a rate. Counted as samples, six probes and two prompts
    were eight, and their speed trusted as much: the most hopeful of sixteen engines then
    projected a long prompt at two thirds of its time."""
    tps, overhead, quad = pool
    b, c = 1000 / tps, quad * 1e6  # the moments' units: thousands and millions of tokens
    m1, m2, mt, m11, m12, m22, m1t, m2t, mtt = m
    ff = (
        overhead * overhead
        + 2 * overhead * (b * m1 + c * m2)
        + b * b * m11
        + 2 * b * c * m12
        + c * c * m22
    )
    ft = overhead * mt + b * m1t + c * m2t
    # The fit's squares are mostly the overhead's where its samples are (the router's
    # probes, all one short size): they tell no rate. Read from the squares, not the mean
    # size, so that one long prompt among six probes tells it (it weighs that much in the
    # least squares).
    if ff < 2 * overhead * overhead or ft <= 0:
        return None
    speed = ft / ff
    miss = max(0.0, mtt - speed * ft) / (ff * speed * speed)
    mean_f = overhead + b * m1 + c * m2
    return math.log(speed), miss, min(1.0, mean_f * mean_f / ff)
