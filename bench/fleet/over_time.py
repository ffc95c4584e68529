"""Misses over the trace's time, per door: whether they are spread or follow a burst.

    python -m bench.fleet.over_time DUMP_FOLDER [--windows 8] [--ttft-budget-s 5]
        [--tpot-target-ms 100]

Reads `replay --dump` (one JSONL per door and load, a line a request) and prints, per load
and door, each window of the trace's time (equal spans of its arrival times) with the
requests offered in it, their prompt tokens, and the misses among them: refused or failed,
first token past the budget, or time per output token past the target. A fresh router's
refusals and a burst's look alike in a total; over time they do not (a burst's misses fall
where every door's do).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson


def missed(r: dict[str, Any], budget_s: float, target_s: float) -> bool:
    if r["status"] != 200 or r["failed"]:
        return True
    ttft, tpot = r["ttft_s"], r["tpot_s"]
    return ttft is None or ttft > budget_s or (tpot is not None and tpot > target_s)


def windows(rows: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    first = min(r["at_ms"] for r in rows)
    span = max(r["at_ms"] for r in rows) - first or 1
    out: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for r in rows:
        out[min(n - 1, int((r["at_ms"] - first) * n / span))].append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", type=Path)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ttft-budget-s", type=float, default=5.0)
    ap.add_argument("--tpot-target-ms", type=float, default=100.0)
    a = ap.parse_args()
    by_load: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(dict)
    for f in sorted(a.dump.glob("*.jsonl")):
        door, load = f.stem.rsplit("-", 1)
        by_load[load][door] = [orjson.loads(line) for line in f.read_bytes().splitlines()]
    target = a.tpot_target_ms / 1000
    for load, doors in sorted(by_load.items()):
        some = next(iter(doors.values()))
        cuts = windows(some, a.windows)
        head = " | ".join(f"{len(w)} req, {sum(r['input'] for r in w) // 1000}k tok" for w in cuts)
        print(f"\n{load}: window | {head}")
        for door, rows in sorted(doors.items()):
            cells = " | ".join(
                str(sum(missed(r, a.ttft_budget_s, target) for r in w))
                for w in windows(rows, a.windows)
            )
            print(f"{door} misses | {cells}")


if __name__ == "__main__":
    main()
