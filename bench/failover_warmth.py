"""Predictive admission right after a failover: the new leader warm (it loaded the profiles
the last leader published to etcd) vs cold (they were deleted before it took over).

Two routers (`admission: predictive`, budget 1 s, `ha` on a real etcd, TTL 2 s) in front of
a scripted engine whose prefill is serial (2 ms a token; 100-token prompts, so 5 requests a
second). The leader learns under load, then is killed (SIGKILL); the same offered load (over
capacity) goes on, and for the standby's first `--seconds` as leader the harness reports,
of the answered requests, the share whose first byte came within the budget, and how many
were refused (429: projected over budget). Run once warm and once cold, same load.

    .venv/bin/python -m bench.failover_warmth [--rate 10] [--seconds 30]

Needs etcd (make setup installs etcd-server). Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx

from bench.admission_overload import BUDGET_S, offer
from tests.support import EtcdServer, start_router, start_test_engine


def config(etcd: str, engine: str, key: str) -> str:
    return (
        "listen: {port: $PORT}\nmodel: main\nadmission: predictive\n"
        f"predictive: {{ttft_budget_s: {BUDGET_S}}}\nhealth: {{interval_s: 0.2}}\n"
        f"ha: {{etcd: ['{etcd}'], key: '{key}', lease_ttl_s: 2}}\n"
        f"engines: [{{name: s, url: '{engine}', dialect: lexi}}]\n"
    )


def role(url: str) -> str:
    try:
        return str(httpx.get(url + "/ready", timeout=2).json()["leadership"]["role"])
    except (httpx.HTTPError, ValueError, KeyError):
        return "?"


def run(etcd: EtcdServer, engine: str, rate: float, seconds: float, warm: bool) -> str:
    key = f"/bench-{int(time.time() * 1000)}/leader"
    tmp = Path(tempfile.mkdtemp())
    a = start_router(tmp, config(etcd.url, engine, key))
    b = start_router(tmp, config(etcd.url, engine, key), wait_ready=False)
    try:
        asyncio.run(offer(a.url, rate, 8.0))  # the leader learns under load, and publishes
        time.sleep(2.5)
        os.killpg(a.proc.pid, signal.SIGKILL)
        if not warm:
            k = base64.b64encode(key.replace("/leader", "/profiles").encode()).decode()
            httpx.post(etcd.url + "/v3/kv/deleterange", json={"key": k})
        end = time.monotonic() + 10
        while role(b.url) != "leader" and time.monotonic() < end:
            time.sleep(0.05)
        ttfts, refused, failed = asyncio.run(offer(b.url, rate, seconds))
        within = sum(1 for t in ttfts if t <= BUDGET_S)
        share = within / len(ttfts) if ttfts else 0.0
        return (
            f"| {'warm' if warm else 'cold'} | {len(ttfts) + refused + failed} | {len(ttfts)} "
            f"| {share:.1%} | {refused} | {failed} |"
        )
    finally:
        a.stop()
        b.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=10.0, help="requests a second (capacity: 5)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    etcd = EtcdServer()
    # Every prompt costs prefill, the probes too (2 ms a token, as the live prompts).
    engine = start_test_engine("tests.scripted_engine", "--prefill-ms-per-token", "2")
    try:
        print("| new leader | offered | answered | first byte within budget | refused | failed |")
        print("|---|---|---|---|---|---|")
        for _ in range(a.rounds):
            for warm in (True, False):
                print(run(etcd, engine.url, a.rate, a.seconds, warm), flush=True)
    finally:
        engine.stop()
        etcd.stop()


if __name__ == "__main__":
    main()
