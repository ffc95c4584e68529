"""Overload: what predictive admission buys. A scripted engine whose prefill is serial
(one prompt at a time, 2 ms a token) gets more work than it can prefill; the same offered
load goes through Narwhal with `admission: open` and with `admission: predictive`
(budget 1 s), in one run.

    .venv/bin/python -m bench.admission_overload [--rate 10] [--seconds 4] [--sglang PATH]

sglang-router (PyPI `sglang-router`, in a venv of its own) runs beside when given.

Loopback only; the offered load is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.router_e2e import start, stop
from tests.support import BIN, free_port

BUDGET_S = 1.0
TOKENS = 100  # prompt tokens a request: 0.2 s of serial prefill, so capacity is 5 req/s


def content() -> str:
    head = "script:prefill_serial:2:"
    return head + "x" * (TOKENS * 4 - len(head))


async def offer(url: str, rate: float, seconds: float) -> tuple[list[float], int, int]:
    body = {"model": "main", "stream": True, "messages": [{"role": "user", "content": content()}]}
    ttfts: list[float] = []
    refused = failed = 0

    async def one(s: aiohttp.ClientSession) -> None:
        nonlocal refused, failed
        t = time.perf_counter()
        async with s.post(
            url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
        ) as r:
            if r.status in (429, 408, 503):  # refused (sglang's queue: 429 full, 408 expired)
                refused += 1
                return
            if r.status != 200:
                failed += 1
                return
            async for _ in r.content.iter_any():
                ttfts.append(time.perf_counter() - t)
                break

    async with aiohttp.ClientSession() as s:
        tasks = []
        n = int(rate * seconds)
        for _ in range(n):
            tasks.append(asyncio.create_task(one(s)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
    return ttfts, refused, failed


async def warm(url: str) -> None:
    body = {"model": "main", "stream": True, "messages": [{"role": "user", "content": content()}]}
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--sglang", help="sglang-router executable, run beside with its queue")
    a = ap.parse_args()
    eport = free_port()
    eng = start(
        [sys.executable, "-m", "tests.scripted_engine", "--port", str(eport)], "/health", eport
    )
    rows = []
    engine = f"http://127.0.0.1:{eport}"
    try:
        doors: list[tuple[str, list[str], str, int]] = []
        for mode in ("open", "predictive"):
            port = free_port()
            cfg = Path(tempfile.mkdtemp()) / "n.yaml"
            cfg.write_text(
                f"model: main\nlisten: {{port: {port}}}\nadmission: {mode}\n"
                f"predictive: {{ttft_budget_s: {BUDGET_S}}}\n"
                "phases: {prefill_concurrency: 64}\nqueue: {wait_s: 60}\n"
                f"engines:\n  - {{name: e, url: '{engine}'}}\n"
            )
            doors.append(
                (
                    f"narwhal {mode}",
                    [str(BIN / "narwhal"), "serve", "--config", str(cfg)],
                    "/ready",
                    port,
                )
            )
        if a.sglang:
            # sglang-router's admission: a cap on requests in flight (a token bucket whose
            # refill defaults to the cap per second) plus a bounded queue with a timeout that
            # equals the budget. Two settings: 5 (1 s budget / 0.2 s prefill, the natural
            # reading of this engine's capacity) and 1 (what this workload needed, found by
            # trying).
            for cap in (5, 1):
                port = free_port()
                doors.append(
                    (
                        f"sglang-router, {cap} in flight, queue 16 for 1 s",
                        [
                            a.sglang,
                            "launch",
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(port),
                            "--worker-urls",
                            engine,
                            "--policy",
                            "round_robin",
                            "--max-concurrent-requests",
                            str(cap),
                            "--queue-size",
                            "16",
                            "--queue-timeout-secs",
                            str(int(BUDGET_S)),
                        ],
                        "/health",
                        port,
                    )
                )
        for name, cmd, health, port in doors:
            router = start(cmd, health, port)
            try:
                url = f"http://127.0.0.1:{port}"
                asyncio.run(warm(url))
                ttfts, refused, failed = asyncio.run(offer(url, a.rate, a.seconds))
            finally:
                stop(router)
            within = sum(1 for t in ttfts if t <= BUDGET_S)
            rows.append(
                (
                    name,
                    len(ttfts) + refused + failed,
                    len(ttfts),
                    refused,
                    failed,
                    pct(ttfts, 0.5),
                    pct(ttfts, 0.99),
                    within,
                )
            )
    finally:
        stop(eng)
    print(
        f"Offered {a.rate:g} req/s for {a.seconds:g} s; engine capacity 5 req/s; "
        f"TTFT budget {BUDGET_S:g} s.\n"
    )
    print(
        "| front door / admission | offered | admitted | refused | failed | TTFT p50 s "
        "| TTFT p99 s | admitted within budget |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, off, adm, ref, fail, p50, p99, within in rows:
        print(
            f"| {mode} | {off} | {adm} | {ref} | {fail} | {p50:.2f} | {p99:.2f} "
            f"| {within} ({within / max(adm, 1):.0%}) |"
        )


if __name__ == "__main__":
    main()
