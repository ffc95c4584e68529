"""Where the router's CPU goes per request: a sampled profile of its request path, by stage.

One scripted engine, Narwhal in front (`admission: open`), a fixed number of concurrent
streaming chat requests; py-spy samples the router's event-loop thread while the load runs,
and /proc gives the CPU of every thread of the router's process. Each sample is given to the
stage of the deepest Narwhal frame on its stack (a call into asyncio, orjson or
prometheus_client counts for the stage that made it); a sample with no frame of ours is
native code the loop runs (uvloop's I/O, the native relay's read callbacks, Granian's
`send`/`receive`); Granian's own threads run no Python and are the rest of the CPU.

    .venv/bin/python -m bench.router_profile [--streams 64] [--requests 2560] [--tokens 64]
        [--py-spy PATH] [--at DIR | --floor]

`--at DIR` profiles another checkout's router (its python/ with `_native` built in place):
the before of a before/after table; `--floor` the proxy floor, kept to the same CPU.
Placement's own cost is `bench.fleet.placement_cost` (the scripted engine answers at once,
so a predictive router in front of it judges itself degraded and profiles refusals).
py-spy samples without pausing the router; its native mode must pause it and counts idle
threads' stacks too, which this split cannot tell from work. Needs py-spy (`pip install
py-spy` in any venv) and permission to ptrace the router (root, or
kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.router_e2e import floor_cmd, load, router_yaml, start, stop, tree_cpu
from tests.support import BIN, free_port

# (stage, the path fragments of its modules), the first that matches a frame wins.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("metrics", ("narwhal/router/metrics", "prometheus_client/")),
    ("access log", ("narwhal/logs", "/logging/")),
    ("intake: read, parse, size", ("pipeline/read", "pipeline/intake", "narwhal/asgi")),
    ("gate", ("pipeline/gate", "ha/")),
    ("judge: admission policy", ("pipeline/judge", "router/policies/", "router/predict")),
    ("place: seat, lease, events", ("pipeline/place", "router/admission", "router/lease")),
    ("engine pool", ("router/engines",)),
    ("upstream request", ("router/connection", "router/upstream")),
    ("relay", ("router/relay/",)),
    ("flow: stages wired, outcome", ("pipeline/flow", "router/app", "narwhal/errors")),
    ("other Narwhal", ("narwhal/",)),
]
SERVER = "server and event loop (no Narwhal frame)"


# Frames every stack of the serving thread starts with (start-up, then Granian's loop).
ROOTS = ("narwhal/service", "narwhal/router/cli", "bin/narwhal")


def stage_of(stack: str) -> str:
    """The stage of a collapsed stack (root first, frames separated by ';')."""
    for frame in reversed(stack.split(";")):
        if any(r in frame for r in ROOTS):
            break
        for stage, parts in STAGES:
            if any(p in frame for p in parts):
                return stage
    return SERVER


def read_raw(path: Path) -> collections.Counter[str]:
    """py-spy's raw (collapsed) output: samples by stage."""
    by: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        # A sample with no Python frame is one of Granian's threads: measured apart.
        if stack.strip() and n.isdigit():
            by[stage_of(stack)] += int(n)
    return by


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2560)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--rate", type=int, default=997, help="samples a second")
    ap.add_argument("--at", metavar="DIR", help="profile another checkout's router")
    ap.add_argument("--keep", type=Path, help="keep py-spy's raw profile here")
    ap.add_argument(
        "--floor", action="store_true", help="profile the proxy floor (bench.floor_proxy) instead"
    )
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    eport = free_port()
    engine = start(
        [sys.executable, "-m", "tests.scripted_engine", "--port", str(eport)], "/health", eport
    )
    upstream = f"http://127.0.0.1:{eport}"
    port = free_port()
    if a.floor:
        os.environ["NARWHAL_FLOOR_ENGINE"] = upstream
        router = start(floor_cmd(port, "bench.floor_proxy:app"), "/health", port)
    else:
        cfg = tmp / "narwhal.yaml"
        cfg.write_text(router_yaml(port, upstream))
        if a.at:
            src = str(Path(a.at).resolve() / "python")
            nw = ["env", f"PYTHONPATH={src}", sys.executable, "-m", "narwhal.router.cli"]
        else:
            nw = [str(BIN / "narwhal")]
        router = start([*nw, "serve", "--config", str(cfg)], "/ready", port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(load(url, a.streams, 4 * a.streams, a.tokens))  # warm up
        pid = _python_pid(router.pid)
        raw = tmp / "profile.txt"
        record = ["record", "--pid", str(pid), "--format", "raw", "--output", str(raw)]
        spy = subprocess.Popen(
            [a.py_spy, *record, "--rate", str(a.rate), "--full-filenames", "--nonblocking"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # attached
        before, main_before = tree_cpu(router.pid), thread_cpu(pid)
        tokens, _ = asyncio.run(load(url, a.streams, a.requests, a.tokens))
        cpu, main_cpu = tree_cpu(router.pid) - before, thread_cpu(pid) - main_before
        outcomes = {} if a.floor else asyncio.run(finished(url))
        spy.send_signal(2)
        spy.wait(30)
    finally:
        stop(router)
        stop(engine)
    if a.keep:
        a.keep.write_bytes(raw.read_bytes())
    by = read_raw(raw)
    if outcomes:
        print("requests ended (warm-up included):", outcomes)
    report(by, cpu, main_cpu, a.requests, tokens, a)


def _python_pid(pid: int) -> int:
    """The process that serves requests: Granian's worker, a child of the router's main
    process (the main process itself when it has none)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return int(children[0]) if children else pid


async def finished(url: str) -> dict[str, int]:
    """`narwhal_finished_total` by outcome: a profile of refusals is not one of relaying."""
    out: dict[str, int] = {}
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            for series in ("narwhal_finished_total{", "narwhal_rejected_total{"):
                if line.startswith(series):
                    label = line.split('="', 1)[1].split('"', 1)[0]
                    if n := int(float(line.rsplit(" ", 1)[1])):
                        out[label] = n
    return out


def thread_cpu(tid: int) -> float:
    """CPU seconds one thread has run (the worker's main thread runs the event loop)."""
    return int(Path(f"/proc/{tid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def report(
    by: collections.Counter[str],
    cpu_s: float,
    loop_s: float,
    requests: int,
    tokens: int,
    a: argparse.Namespace,
) -> None:
    """The loop thread's CPU shared out by its samples; the rest of the router's CPU ran on
    threads with no Python frame (Granian's runtime: sockets, HTTP, the native relay's
    writes to clients)."""
    per_req = cpu_s / requests * 1e6
    loop = loop_s / requests * 1e6
    sampled = sum(by.values()) or 1
    print(
        f"{'proxy floor' if a.floor else 'Narwhal'}, {a.streams} streams, {requests} "
        f"requests of {a.tokens} tokens: router CPU {per_req:.0f} µs a request "
        f"({cpu_s / max(tokens, 1) * 1e6:.2f} µs a token), the event loop's thread {loop:.0f} "
        f"µs ({sampled} samples)\n"
    )
    print("| stage | µs a request | share of the router's CPU |")
    print("|---|---|---|")
    rows = [(stage, n / sampled * loop) for stage, n in by.items()]
    rows.append(("Granian's threads (no Python frame)", max(0.0, per_req - loop)))
    for stage, us in sorted(rows, key=lambda x: -x[1]):
        print(f"| {stage} | {us:.0f} | {us / per_req:.0%} |")


if __name__ == "__main__":
    main()
