"""The fair fight's verdict: issue #42's bars, read from replay runs' JSON (`--json`).

    .venv/bin/python -m bench.fleet.verdict /tmp/m-production.json [more.json ...]

Per load, over the runs (medians): the best peer is the peer configuration with the fewest
misses; where it serves at least half of what was offered within both SLO targets,
Narwhal's misses must be at most half of its; where it serves less, Narwhal's goodput must
be at least 1.5x its. Besides: at least 99 % of what Narwhal serves meets both targets, and
at the lightest load (0.5x) at most 1 % is refused for anything but a prompt that alone
exceeds the budget, with a TTFT p99 no worse than the best peer's. Each bar is printed
with the figures it was judged on, pass or not.
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
        row("served within SLO >= 99 %", f"{100 * s:.1f} %", "", s >= 0.99)
        if load <= 0.5:
            f = statistics.median(_refused_for_load(r) for r in us)
            row("refused (not alone over) <= 1 %", f"{100 * f:.1f} %", "", f <= 0.01)
            m, t = _median(us, "ttft_p99_s"), _median(them, "ttft_p99_s")
            row("TTFT p99 <= the peer's", f"{m:.2f} s", f"{t:.2f} s", m <= t)
    return out


def main() -> None:
    rows: list[dict[str, Any]] = []
    for arg in sys.argv[1:]:
        rows += orjson.loads(Path(arg).read_bytes())
    print("\n".join(verdict(rows)))


if __name__ == "__main__":
    main()
