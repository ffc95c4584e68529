"""Each engine's speed against the fleet's prefill fit (`Speeds`): kept as running sums and
a histogram of the engines' means, it reads after any run of samples and departures as the
engines that remain would, read afresh; and an engine reads its speed with the engines of
its kind."""

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
    assert got.mean == pytest.approx(want.mean, rel=1e-9)
    assert got.noise == pytest.approx(want.noise, rel=1e-9)
    for weight, total, _ in latest.values():
        assert math.isclose(
            kept.speed(got, weight, total), afresh.speed(want, weight, total), rel_tol=1e-9
        )
    assert len(kept) == len(latest)


def test_no_engine_measured_reads_nothing() -> None:
    s = Speeds()
    s.put("e0", 2.0, 0.2, 0.05)
    s.drop("e0")
    assert s.reading() is None and len(s) == 0


@pytest.mark.parametrize(("engines", "within"), [(8, 0.8), (64, 0.5)])
def test_an_engine_reads_its_speed_with_the_engines_of_its_kind(
    engines: int, within: float
) -> None:
    """Fleets of two kinds, one twice as slow, a dozen samples an engine scattered as live
    load scatters them (a quarter, in ln): an engine's own mean is off by 7 % typically.
    Read with its kind's, its speed is closer, the more so the more engines of its kind
    (a single mean to shrink toward, halfway between the kinds, left each engine its own)."""
    own = read = 0.0
    for seed in range(20):
        rng = random.Random(seed)
        speeds, paces = Speeds(), []
        for i in range(engines):
            truth = math.log(2.0) if i % 2 else 0.0
            xs = [truth + rng.gauss(0.0, 0.25) for _ in range(12)]
            paces.append((truth, 12.0, sum(xs)))
            speeds.put(f"e{i}", 12.0, sum(xs), sum(x * x for x in xs))
        reading = speeds.reading()
        assert reading is not None
        for truth, weight, total in paces:
            own += (total / weight - truth) ** 2
            read += (math.log(speeds.speed(reading, weight, total)) - truth) ** 2
    assert math.sqrt(read) < within * math.sqrt(own)


def test_an_engine_measured_a_few_times_reads_the_speed_of_its_own_kind() -> None:
    """Placement sends most of the work to the fast kind, so early on a slow engine has a
    few samples where a fast one has fifty. Which kind it is of is as likely as that kind's
    engines are many, not as its samples are: read otherwise, the fast kind's samples
    outweighed the slow engine's own and it read nearer the fast speed than its own mean
    alone says (a slow engine projected fast is served late, and the margins that learn
    it refuse)."""
    own = read = 0.0
    for seed in range(100):
        rng = random.Random(seed)
        speeds, slow = Speeds(), []
        for i in range(8):
            truth = math.log(2.0) if i % 2 else 0.0
            n = rng.randint(2, 8) if i % 2 else rng.randint(25, 75)
            xs = [truth + rng.gauss(0.0, 0.25) for _ in range(n)]
            speeds.put(f"e{i}", float(n), sum(xs), sum(x * x for x in xs))
            if i % 2:
                slow.append((truth, float(n), sum(xs)))
        reading = speeds.reading()
        assert reading is not None
        for truth, weight, total in slow:
            own += (total / weight - truth) ** 2
            read += (math.log(speeds.speed(reading, weight, total)) - truth) ** 2
    assert read < 0.9 * own
