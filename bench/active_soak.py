"""Active routers under a trace while one of them is killed and started again.

    .venv/bin/python -m bench.active_soak --trace bench/fleet/traces/chat-8.jsonl \\
        --requests 1000 --load 0.5 --routers 3 [--kill-at 0.35 --restart-at 0.55] \\
        [--every 20] [--time-scale 2] [--sim-args "--kv-on-demand --jitter 0.1"]

N active routers (`ha.mode: active`, an etcd of their own) before the simulated fleet, the
trace offered open loop with its requests spread over the routers in turn (as a plain L4
balancer would, with no retry), the fair protocol's clients. Router 1 is SIGKILLed at
`--kill-at` of the trace and started again (a new process: a new name, key and term) at
`--restart-at`. Reported per router and per phase (before the kill, while it is down,
after the restart): requests, served within both SLO targets (of offered), failed, and
the prefix-cache hit rate of what was served (cached / prompt tokens, from each answer's
usage). `--every S` repeats the kill S trace seconds after the last, for as long as the
trace lasts (phases: up and down). What the issue asks of it (#44): the other routers'
attainment does not dip while one is down (only the dead router's own requests fail), and
the restarted router's hit rate within 5 s of its first answer reaches 90 % of its hit
rate before the kill.

Times are trace seconds (wall clock / `--time-scale`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.fleet.replay import (
    Outcome,
    client_of,
    doors,
    launch,
    offer,
    start_etcd,
    start_fleet,
    stop,
    warm,
)
from bench.fleet.traces import Request, read
from tests.support import wait_http

RESTARTED_WINDOW_S = 5.0


def phase_of(at: float, downs: list[tuple[float, float]]) -> str:
    """Once: before, down, after; repeated: up or down."""
    if any(k <= at < r for k, r in downs):
        return "down"
    if len(downs) > 1:
        return "up"
    return "before" if at < downs[0][0] else "after"


def figures(
    rows: list[tuple[Request, Outcome, float]], budget: float, tpot: float
) -> dict[str, Any]:
    n = len(rows)
    ok = [
        o
        for _, o, _ in rows
        if o.status == 200
        and not o.failed
        and o.ttft_s is not None
        and o.ttft_s <= budget
        and (o.tpot_s is None or o.tpot_s <= tpot)
    ]
    served = [o for _, o, _ in rows if o.status == 200 and o.cached is not None]
    prompt = sum(o.prompt for o in served)
    cached = sum(o.cached or 0 for o in served)
    return {
        "requests": n,
        "within_slo": len(ok) / n if n else None,
        "failed": sum(1 for _, o, _ in rows if o.failed or o.status == 0),
        "hit_rate": cached / prompt if prompt else None,
        "misses_by": misses_by(rows, budget, tpot),
    }


def misses_by(
    rows: list[tuple[Request, Outcome, float]], budget: float, tpot: float
) -> dict[str, int]:
    """Why each request that missed did: refused (with its code), failed, abandoned (no
    first token within the client's patience), late (first token past the budget), or slow
    (mean TPOT past the target)."""
    out: dict[str, int] = {}
    for _, o, _ in rows:
        if o.status not in (0, 200):
            why = f"refused {o.status} {o.code or ''}".strip()
        elif o.failed or o.status == 0:
            why = "failed"
        elif o.abandoned or o.ttft_s is None:
            why = "abandoned"
        elif o.ttft_s > budget:
            why = "late"
        elif o.tpot_s is not None and o.tpot_s > tpot:
            why = "slow"
        else:
            continue
        out[why] = out.get(why, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--routers", type=int, default=3)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--ttft-budget-s", type=float, default=5.0)
    ap.add_argument("--tpot-target-ms", type=float, default=100.0)
    ap.add_argument(
        "--kill-at", type=float, default=0.35, help="share of the trace (1: none, a baseline)"
    )
    ap.add_argument("--restart-at", type=float, default=0.55, help="share of the trace")
    ap.add_argument(
        "--every",
        type=float,
        default=0.0,
        help="trace seconds: kill and restart router 1 again this long after each kill, "
        "as long as the trace lasts (0: once); phases are then up and down",
    )
    ap.add_argument(
        "--sim-args", default="--kv-on-demand --jitter 0.1 --prefill-half-context 12000"
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    # What the replayer's door and fleet builders read.
    ns = argparse.Namespace(
        doors=f"narwhal-predictive@active{a.routers}",
        baseline_tree=None,
        tpot=True,
        tpot_target_ms=a.tpot_target_ms,
        time_scale=a.time_scale,
        ttft_budget_s=a.ttft_budget_s,
        predictive_extra="",
        classes=None,
        models=None,
        engines=a.engines,
        sim_args=a.sim_args,
        protocol="fair",
        max_tokens=2048,
        patience=2.0,
    )
    trace = read(a.trace)[: a.requests]
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000 / a.load
    kill_s, restart_s = a.kill_at * span, a.restart_at * span
    # Router 1's outages: (killed, started again), in trace seconds.
    downs = [(kill_s, restart_s)] if a.kill_at < 1 else [(span + 1, span + 1)]
    while a.every > 0 and downs[-1][0] + a.every < span:
        at = downs[-1][0] + a.every
        downs.append((at, at + restart_s - kill_s))
    sim, engines = start_fleet(ns)
    etcd, etcd_url = start_etcd()
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp(prefix="active-soak-"))
    try:
        door = doors(ns, engines, logs, etcd_url)[0]
        assert door.cmd is not None
        members = [(door.cmd, door.port), *door.replicas]
        urls = [f"http://127.0.0.1:{p}" for _, p in members]

        def spawn(k: int) -> subprocess.Popen[bytes]:
            return launch(members[k][0], door.env, logs / f"router{k}-{len(procs)}.log")

        for k in range(len(members)):
            procs.append(spawn(k))
            wait_http(urls[k] + "/ready", procs[-1], 60)
        for url in urls:
            asyncio.run(warm(url, 24, a.time_scale, False, None))
        router1 = [procs[1]]  # its processes, the live one last
        started = time.monotonic()

        async def chaos() -> None:
            if a.kill_at >= 1:
                return  # the baseline: nobody killed
            for at, back in downs:
                await asyncio.sleep(max(0.0, started + at * a.time_scale - time.monotonic()))
                os.killpg(router1[-1].pid, signal.SIGKILL)
                print(f"router 1 killed at {at:.1f} s", flush=True)
                await asyncio.sleep(max(0.0, started + back * a.time_scale - time.monotonic()))
                router1.append(spawn(1))
                procs.append(router1[-1])
                print(f"router 1 started again at {back:.1f} s", flush=True)

        async def run() -> list[Outcome]:
            nonlocal started
            started = time.monotonic()
            c = asyncio.create_task(chaos())
            outs, _ = await offer(urls, trace, a.load, a.time_scale, client=client_of(ns))
            await c
            return outs

        outs = asyncio.run(run())
        print(f"offered in {(time.monotonic() - started) / a.time_scale:.0f} s", flush=True)
    finally:
        stop(procs)
        os.killpg(sim.pid, signal.SIGTERM)
        sim.wait()
        os.killpg(etcd.pid, signal.SIGTERM)
        etcd.wait()
    t0 = trace[0].timestamp_ms
    at = [(r.timestamp_ms - t0) / 1000 / a.load for r in trace]
    budget, tpot = a.ttft_budget_s, a.tpot_target_ms / 1000
    report: dict[str, Any] = {"kill_s": kill_s, "restart_s": restart_s, "routers": {}}
    print("| router | phase | requests | within SLO (of offered) | failed | prefix hit | misses |")
    print("|---|---|---|---|---|---|---|")
    for k in range(len(urls)):
        mine = [(trace[i], outs[i], at[i]) for i in range(len(trace)) if i % len(urls) == k]
        report["routers"][str(k)] = {}
        for phase in ("before", "down", "after") if len(downs) == 1 else ("up", "down"):
            rows = [row for row in mine if phase_of(row[2], downs) == phase]
            f = figures(rows, budget, tpot)
            report["routers"][str(k)][phase] = f
            slo = "-" if f["within_slo"] is None else f"{100 * f['within_slo']:.1f} %"
            hit = "-" if f["hit_rate"] is None else f"{100 * f['hit_rate']:.0f} %"
            why = ", ".join(f"{n} {w}" for w, n in sorted(f["misses_by"].items())) or "-"
            print(f"| {k} | {phase} | {f['requests']} | {slo} | {f['failed']} | {hit} | {why} |")
    # The restarted router: its hit rate in its first seconds of answers after each start,
    # against its rate before the first kill.
    mine = [(trace[i], outs[i], at[i]) for i in range(len(trace)) if i % len(urls) == 1]
    before = figures([r for r in mine if r[2] < kill_s], budget, tpot)["hit_rate"]
    report["restarts"] = []
    for _, back in downs:
        nxt = min([k for k, _ in downs if k > back], default=span + 1)
        answered = [r for r in mine if back <= r[2] < nxt and r[1].status == 200]
        if not answered:
            continue
        first = answered[0][2]
        e = figures([r for r in answered if r[2] < first + RESTARTED_WINDOW_S], budget, tpot)
        ratio = (e["hit_rate"] / before) if e["hit_rate"] is not None and before else None
        report["restarts"].append(
            {"started_s": back, "first_answer_s": first, "early": e, "of_before": ratio}
        )
        print(
            f"router 1 started at {back:.1f} s: first answer {first - back:.1f} s later; hit "
            f"rate over its next {RESTARTED_WINDOW_S:g} s {100 * (e['hit_rate'] or 0):.0f} % "
            f"({e['requests']} requests), "
            + ("-" if ratio is None else f"{100 * ratio:.0f} % of its rate before the first kill")
        )
    print(f"router logs: {logs}")
    if a.json:
        a.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
