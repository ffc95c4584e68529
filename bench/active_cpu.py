"""What active routers cost with no traffic: the fixed part of their CPU.

    .venv/bin/python -m bench.active_cpu --doors narwhal-predictive,narwhal-predictive@active1,\\
        narwhal-predictive@active3 [--seconds 60] [--engines 8] [--runs 3]

Each door is started before the simulated fleet as the fleet replay starts it (an etcd of
its own for `@activeN`), warmed as the replay warms it, and then left alone for `--seconds`:
what its processes run meanwhile is what every router pays whatever the traffic (probing
the engines, health checks, its lease, reading the routers' keys, the exchange's ticks with
nothing to tell). Reported per door as CPU milliseconds a second, median [range] of the
runs. Against a replay cell's `door CPU ms/req` this splits a door's cost into its fixed
part (these figures x the cell's span / its requests) and what the requests themselves
(and, for several routers, telling each other of them) cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.fleet.replay import doors, launch, start_etcd, start_fleet, stop, warm
from bench.router_e2e import tree_cpu
from tests.support import wait_http


def idle_cpu(door_name: str, a: argparse.Namespace, engines: list[str], etcd: str) -> float:
    """CPU seconds a second the door's processes run with no traffic, after its warm-up."""
    ns = argparse.Namespace(
        doors=door_name,
        baseline_tree=None,
        tpot=True,
        tpot_target_ms=100.0,
        time_scale=a.time_scale,
        ttft_budget_s=5.0,
        predictive_extra="",
        classes=None,
        models=None,
        engines=a.engines,
        sim_args="",
        protocol="fair",
        max_tokens=2048,
        patience=2.0,
    )
    door = doors(ns, engines, Path(tempfile.mkdtemp(prefix="active-cpu-")), etcd)[0]
    assert door.cmd is not None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd, port in [(door.cmd, door.port), *door.replicas]:
            procs.append(launch(cmd, door.env, None))
            wait_http(f"http://127.0.0.1:{port}/ready", procs[-1], 60)
        for _, port in [(door.cmd, door.port), *door.replicas]:
            asyncio.run(warm(f"http://127.0.0.1:{port}", 24, a.time_scale))
        cpu0, t0 = sum(tree_cpu(p.pid) for p in procs), time.monotonic()
        time.sleep(a.seconds)
        return (sum(tree_cpu(p.pid) for p in procs) - cpu0) / (time.monotonic() - t0)
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--doors", default="narwhal-predictive,narwhal-predictive@active3")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    fleet_args = argparse.Namespace(engines=a.engines, time_scale=a.time_scale, sim_args="")
    sim, engines = start_fleet(fleet_args)
    etcd, etcd_url = start_etcd()
    figures: dict[str, list[float]] = {}
    try:
        for _ in range(a.runs):
            for name in a.doors.split(","):
                figures.setdefault(name, []).append(1000 * idle_cpu(name, a, engines, etcd_url))
    finally:
        for proc in (sim, etcd):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    print("| door | routers' CPU with no traffic, ms a second |")
    print("|---|---|")
    for name, xs in figures.items():
        print(f"| {name} | {statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}] |")


if __name__ == "__main__":
    main()
