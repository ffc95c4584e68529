"""The fleet's reading of engines' speeds against its prefill fit (`Speeds`), kept as
running sums: after any run of engines' samples and departures it reads as the engines
that remain would, read afresh."""

from __future__ import annotations

import math
import random

import pytest

from narwhal.router.speeds import Speeds


def test_the_reading_is_of_the_engines_that_remain_at_their_latest_paces() -> None:
    rng = random.Random(3)
    kept, latest = Speeds(), {}
    for _ in range(20_000):
        name = f"e{rng.randrange(40)}"
        if rng.random() < 0.05:
            kept.drop(name)
            latest.pop(name, None)
            continue
        weight = rng.uniform(0.5, 20.0)
        mean = 0.4 * (int(name[1:]) % 3) + rng.gauss(0.0, 0.05)  # three kinds of device
        paces = (weight, weight * mean, weight * (mean * mean + 0.02))
        kept.put(name, *paces)
        latest[name] = paces
    afresh = Speeds()
    for name, paces in latest.items():
        afresh.put(name, *paces)
    got, want = kept.reading(), afresh.reading()
    assert got is not None and want is not None and want.noise is not None
    assert want.between > 0.05  # the kinds differ, beyond the samples' noise
    assert got.mean == pytest.approx(want.mean, rel=1e-9)
    assert got.noise == pytest.approx(want.noise, rel=1e-9)
    assert got.between == pytest.approx(want.between, rel=1e-9)
    for weight, total, _ in latest.values():
        assert math.isclose(got.speed(weight, total), want.speed(weight, total), rel_tol=1e-9)
    assert len(kept) == len(latest)


def test_no_engine_measured_reads_nothing() -> None:
    s = Speeds()
    s.put("e0", 2.0, 0.2, 0.05)
    s.drop("e0")
    assert s.reading() is None and len(s) == 0
