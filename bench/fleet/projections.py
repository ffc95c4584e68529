"""Narwhal's projections in a `replay --dump` folder, held against the simulator's cost model.

    python -m bench.fleet.projections DUMP_FOLDER --time-scale 2 [the replay's --sim-args]

    e.g. python -m bench.fleet.projections /tmp/d --time-scale 2 --speeds 1,0.5 \\
             --prefill-half-context 12000

The simulated engines' cost is known (`bench/fleet/gpu.py`): a prompt alone on an engine
takes its chunked prefill's steps, at that engine's speed, times the time scale. Each
Narwhal cell (`<door>-<load>x-r<run>.log`, the router's access lines, and its `.ready.json`)
is read against it, one line a cell:

- refusals by reason;
- the refusals for the TTFT margin (`ttft_budget_exceeded`: guarded over the budget): how
  many, their margin (guarded / projected, median), and their own prefill as projected on
  the engine they came nearest on against the cost model there (median; how many over
  1.2x: refused on a projection too long, not for the margin);
- the requests placed at once with nothing projected ahead of them and the cache they
  expected (`own` at least 95 % of `projected`, sent within 50 ms, cached tokens within a
  tenth of the expected): the first byte against the cost model (what the engine took, the
  run's load and jitter included) and the projection against it (median and 90th
  percentile);
- the end of the run: each engine's profile projecting a 20k-token prompt alone against the
  cost model, the median over the engines of each speed;
- during the run: each engine's own prefill as projected for the long prompts it served or
  came nearest on when refused (`LONG_FRESH` tokens or more) against their cost, and the
  engine whose median is furthest off (one engine read slow for half a run refuses the
  long prompts a fleet at rest would serve).

The flags are the simulator's (`bench.fleet.server`), so the replay's `--sim-args` can be
passed as they were; the engines' speeds repeat over the fleet as there (`e0`, `e1`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from bench.fleet.gpu import GpuModel
from bench.fleet.server import add_model_flags, model_from

LONG = 20_000  # the prompt the end-of-run profiles are asked about
# The prompts each engine's own projections are held to their cost for, in the run: those
# that decide light load's refusals (at a 5 s budget and time scale 2, 0.4-0.8 of it alone
# on the fast kind of the bench's fleets, past it on the slow).
LONG_FRESH = 8_000
# An engine is read from this many such prompts at least (one prompt is not its reading).
LONG_READ = 3
_FIELD = re.compile(r"(\w+)=(\S+)")


def alone_s(model: GpuModel, fresh: int, cached: int, scale: float) -> float:
    """The simulator's time to a first token for a prompt alone on an idle engine: its
    uncached tokens in chunks, a step each, after the cached context."""
    t, context, left = 0.0, cached, fresh
    while left > 0:
        n = min(model.chunk_tokens, left)
        t += model.step_base_s + model.chunk_s(context, n)
        context += n
        left -= n
    return t / model.speed * scale


def access_lines(path: Path) -> list[dict[str, str]]:
    """The router's access lines for the trace's requests (the bench's warm-up left out)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if "narwhal.access" not in line:
            continue
        f = dict(_FIELD.findall(line))
        if not f.get("request_id", "").startswith("warm"):
            out.append(f)
    return out


def _num(f: dict[str, str], key: str) -> float | None:
    v = f.get(key)
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None  # "None"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Fleet:
    """Each engine's cost model, by name (`e{i}`, speeds repeating as the simulator's)."""

    def __init__(self, model: GpuModel, speeds: tuple[float, ...], scale: float) -> None:
        self.model, self.speeds, self.scale = model, speeds, scale

    def speed(self, engine: str) -> float:
        if not self.speeds or not engine[1:].isdigit():
            return 1.0
        return self.speeds[int(engine[1:]) % len(self.speeds)]

    def alone_s(self, engine: str, fresh: int, cached: int = 0) -> float:
        model = dataclasses.replace(self.model, speed=self.speed(engine))
        return alone_s(model, fresh, cached, self.scale)


def cell(lines: list[dict[str, str]], ready: dict[str, Any] | None, fleet: Fleet) -> dict[str, Any]:
    """One cell's figures (see the module's docstring)."""
    reasons = Counter(f.get("reason", "") for f in lines if f.get("outcome") == "refused")
    margin, refused_own = [], []
    measured, projected = [], []
    long: dict[str, list[float]] = {}
    for f in lines:
        own, proj = _num(f, "own_ms"), _num(f, "projected_ms")
        sized, on = _num(f, "tokens_sized"), f.get("engine") or f.get("nearest_engine")
        if own and sized and sized >= LONG_FRESH and on:
            cost = fleet.alone_s(on, int(sized), int(_num(f, "cached_expected") or 0))
            long.setdefault(on, []).append(own / 1000 / cost)
        if f.get("reason") == "ttft_budget_exceeded":
            guarded = _num(f, "guarded_ms")
            if own and proj and guarded and sized and on:
                margin.append(guarded / proj)
                refused_own.append(own / 1000 / fleet.alone_s(on, int(sized)))
            continue
        if f.get("outcome") != "completed" or not own or not proj or own < 0.95 * proj:
            continue
        sent, ttfb = _num(f, "sent_ms"), _num(f, "ttfb_ms")
        tokens, cached = _num(f, "tokens_in"), _num(f, "tokens_cached") or 0.0
        expected = _num(f, "cached_expected") or 0.0
        if sent is None or sent > 50 or not ttfb or not tokens:
            continue
        if abs(cached - expected) > 0.1 * tokens:
            continue  # the cache the projection counted was not the one the engine had
        cost = fleet.alone_s(f.get("engine", ""), int(tokens - cached), int(cached))
        measured.append(ttfb / 1000 / cost)
        projected.append(proj / 1000 / cost)
    end: dict[float, list[float]] = {}
    for e in (ready or {}).get("engines", []):
        p = e.get("profile") or {}
        tps = p.get("prefill_tokens_per_s")
        if not tps:
            continue
        own = (
            (p.get("prefill_overhead_s") or 0.0)
            + LONG / tps
            + (p.get("prefill_quadratic_s") or 0.0) * LONG * LONG
        )
        end.setdefault(fleet.speed(e["name"]), []).append(own / fleet.alone_s(e["name"], LONG))
    return {
        "refused": dict(reasons),
        "margin_refusals": len(margin),
        "margin": statistics.median(margin) if margin else None,
        "refused_own_over_cost": statistics.median(refused_own) if refused_own else None,
        "refused_own_over_1_2": sum(1 for r in refused_own if r > 1.2),
        "alone_served": len(measured),
        "measured_over_cost": (statistics.median(measured), _quantile(measured, 0.9))
        if measured
        else None,
        "projected_over_cost": (statistics.median(projected), _quantile(projected, 0.9))
        if projected
        else None,
        "end_20k_over_cost": {s: statistics.median(v) for s, v in sorted(end.items())},
        "long_own_over_cost": {e: (statistics.median(v), len(v)) for e, v in sorted(long.items())},
    }


def most_off(by_engine: dict[str, tuple[float, int]]) -> str:
    """The engine whose long prompts' own projections were furthest from their cost (of
    those with LONG_READ of them at least)."""
    read = {e: v for e, v in by_engine.items() if v[1] >= LONG_READ}
    if not read:
        return "-"
    name, (ratio, n) = max(read.items(), key=lambda kv: abs(math.log(kv[1][0])))
    return f"{name} {ratio:.2f} ({n})"


def _pair(v: tuple[float, float] | None) -> str:
    return "-" if v is None else f"{v[0]:.2f} / {v[1]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--time-scale", type=float, default=2.0)
    add_model_flags(ap)
    a = ap.parse_args()
    speeds = tuple(float(x) for x in a.speeds.split(",") if x)
    fleet = Fleet(model_from(a), speeds, a.time_scale)
    print(
        "| cell | refused (by reason) | margin refusals: n, margin, own / cost (n over 1.2x) "
        "| served alone: n, first byte / cost (median / p90) | projected / cost "
        "| 20k at the end / cost (by speed) | long prompts' own / cost, engine most off (n) |"
    )
    print("|---|---|---|---|---|---|---|")
    for log in sorted(a.folder.glob("narwhal-*.log")):
        ready_path = log.with_suffix(".ready.json")
        ready = orjson.loads(ready_path.read_bytes()) if ready_path.exists() else None
        c = cell(access_lines(log), ready, fleet)
        refused = ", ".join(f"{k} {v}" for k, v in sorted(c["refused"].items())) or "-"
        margin = "-"
        if c["margin_refusals"]:
            margin = (
                f"{c['margin_refusals']}, {c['margin']:.2f}x, "
                f"{c['refused_own_over_cost']:.2f} ({c['refused_own_over_1_2']})"
            )
        end = ", ".join(f"{s:g}: {v:.2f}" for s, v in c["end_20k_over_cost"].items()) or "-"
        print(
            f"| {log.stem} | {refused} | {margin} | {c['alone_served']}, "
            f"{_pair(c['measured_over_cost'])} | {_pair(c['projected_over_cost'])} | {end} "
            f"| {most_off(c['long_own_over_cost'])} |"
        )


if __name__ == "__main__":
    main()
