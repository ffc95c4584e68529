"""The fair fight's verdict: issue #42's bars, read from replay runs' JSON (`--json`).

    .venv/bin/python -m bench.fleet.verdict /tmp/m-production.json [more.json ...]

Per load, over the runs (medians): the best peer is the peer configuration with the fewest
misses; where it serves at least half of what was offered within both SLO targets,
Narwhal's misses must be at most half of its; where it serves less, Narwhal's goodput must
be at least 1.5x its. Besides: at least 99 % of what Narwhal serves meets both targets, and
at a light load at most 1 % is refused for anything but a prompt that alone exceeds the
budget, with a TTFT p99 no worse than the best peer's. Each bar is printed with the
figures it was judged on, pass or not.

A light load is judged two ways, both printed: the trace's nominal 0.5x, and every load
offered at no more than half the best door's measured SLO capacity (issue #42 states loads
against it). A door's SLO capacity (`capacities`) is the highest offered rate at which it
met both targets for 90 % of requests, a lower bound, the loads being discrete. A trace's
nominal 1x is sized on the simulator's flat cost model; with the calibrated context
slowdown and the mix's opening burst, a nominal 0.5x may already be past every door's
capacity, and the refusal bar there then asks a door to serve what no door serves in SLO.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

OURS = "narwhal-"
ALONE = "prompt_exceeds_ttft_budget"


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key] or 0.0) for r in rows)


def _refused_for_load(r: dict[str, Any]) -> float:
    """Refused as a share of offered, not counting prompts that alone exceed the budget."""
    n = sum(int(c) for k, c in r["refused_by"].items() if not k.endswith(ALONE))
    return n / int(r["offered"])


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    best_cap = max(capacities(rows).values(), default=None)
    out = [
        "| load | best peer | its within SLO | bar | Narwhal | best peer | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    loads = sorted({r["load"] for r in rows})
    for load in loads:
        cells: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if r["load"] == load:
                cells.setdefault(r["door"], []).append(r)
        ours = [d for d in cells if d.startswith(OURS)]
        peers = [d for d in cells if not d.startswith(OURS) and d != "direct"]
        if not ours or not peers:
            continue
        us = cells[ours[0]]
        best = min(peers, key=lambda d: _median(cells[d], "misses"))
        them = cells[best]
        attained = 1 - _median(them, "misses")

        head = f"| {load:g}x | {best} | {100 * attained:.1f} % |"

        def row(bar: str, mine: str, theirs: str, ok: bool, head: str = head) -> None:
            out.append(f"{head} {bar} | {mine} | {theirs} | {'pass' if ok else 'FAIL'} |")

        if attained >= 0.5:
            m, t = _median(us, "misses"), _median(them, "misses")
            row("misses <= half the peer's", f"{100 * m:.1f} %", f"{100 * t:.1f} %", m <= t / 2)
        else:
            m, t = _median(us, "goodput_per_s"), _median(them, "goodput_per_s")
            row("goodput >= 1.5x the peer's", f"{m:.2f}/s", f"{t:.2f}/s", m >= 1.5 * t)
        s = _median(us, "served_within_slo")
        row("served within SLO >= 99 %", f"{100 * s:.2f} %", "", s >= 0.99)
        light = []
        if load <= 0.5:
            light.append("nominal 0.5x or less")
        rate = _offered_rate(us + them)
        if best_cap is not None and rate is not None and rate <= best_cap / 2:
            light.append(f"{rate / best_cap:.2f}x the best door's capacity")
        if light:
            why = ", ".join(light)
            f = statistics.median(_refused_for_load(r) for r in us)
            row(f"refused (not alone over) <= 1 % ({why})", f"{100 * f:.1f} %", "", f <= 0.01)
            m, t = _median(us, "ttft_p99_s"), _median(them, "ttft_p99_s")
            row(f"TTFT p99 <= the peer's ({why})", f"{m:.2f} s", f"{t:.2f} s", m <= t)
    if best_cap is None:
        out.append("")
        out.append(
            "No door met both targets for 90 % at any load: no load is judged light by capacity."
        )
    return out


# DistServe's convention: a fleet's SLO capacity is the highest rate at which this share of
# requests meets both targets.
ATTAINMENT = 0.9


def _offered_rate(rows: list[dict[str, Any]]) -> float | None:
    """Requests offered a second at a load: goodput over attainment, the same for every door
    (goodput is SLO-met requests over the trace's duration, attainment their share)."""
    rates = [
        float(r["goodput_per_s"]) / float(r["slo_attainment"])
        for r in rows
        if r.get("slo_attainment")
    ]
    return statistics.median(rates) if rates else None


def capacities(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each door's measured SLO capacity, for the doors that met both targets for
    ATTAINMENT of requests (median over the runs) at one of the loads at least."""
    cells: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((float(r["load"]), str(r["door"])), []).append(r)
    rate = {
        load: _offered_rate([r for (ld, _), rs in cells.items() if ld == load for r in rs])
        for load in {k[0] for k in cells}
    }
    out: dict[str, float] = {}
    for (load, door), rs in cells.items():
        offered = rate[load]
        if door == "direct" or offered is None:
            continue
        if statistics.median(float(r.get("slo_attainment") or 0.0) for r in rs) >= ATTAINMENT:
            out[door] = max(out.get(door, 0.0), offered)
    return out


def capacity(rows: list[dict[str, Any]]) -> list[str]:
    """Each load's offered rate, and the best peer's measured SLO capacity: the highest
    offered rate at which its best configuration met both targets for ATTAINMENT of
    the requests (a lower bound, the loads being discrete)."""
    cells: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((float(r["load"]), str(r["door"])), []).append(r)
    peers = {d for _, d in cells if not d.startswith(OURS) and d != "direct"}
    if not peers:
        return []
    table = []
    for load in sorted({k[0] for k in cells}):
        rate = _offered_rate([r for (ld, _), rs in cells.items() if ld == load for r in rs])
        best = max(
            (_median(cells[(load, d)], "slo_attainment") for d in peers if (load, d) in cells),
            default=0.0,
        )
        if rate is not None:
            table.append((load, rate, best))
    within = [rate for _, rate, best in table if best >= ATTAINMENT]
    cap = max(within) if within else None
    if cap is None:
        head = (
            f"The best peer met both targets for {100 * ATTAINMENT:.0f} % of requests at none"
            " of these loads: its SLO capacity is below the lightest."
        )
    else:
        head = (
            f"The best peer's measured SLO capacity: at least {cap:.2f} requests/s (the "
            f"highest offered rate at which it met both targets for {100 * ATTAINMENT:.0f} %)."
        )
    doors = capacities(rows)
    top = max(doors, key=lambda d: doors[d], default=None)
    whole = doors[top] if top is not None else None
    if top is None:
        head2 = "No door met both targets for 90 % of requests at any of these loads."
    else:
        head2 = f"The best door's measured SLO capacity: at least {whole:.2f} requests/s ({top})."
    out = [
        head,
        head2,
        "",
        "| load | offered/s | best peer within SLO | of that capacity | of the best door's |",
        "|---|---|---|---|---|",
    ]
    for load, rate, best in table:
        share = f"{rate / cap:.2f}x" if cap else "over it"
        theirs = f"{rate / whole:.2f}x" if whole else "over it"
        out.append(f"| {load:g}x | {rate:.2f} | {100 * best:.1f} % | {share} | {theirs} |")
    return out


def main() -> None:
    rows: list[dict[str, Any]] = []
    for arg in sys.argv[1:]:
        rows += orjson.loads(Path(arg).read_bytes())
    print("\n".join(verdict(rows)))
    print()
    print("\n".join(capacity(rows)))


if __name__ == "__main__":
    main()
