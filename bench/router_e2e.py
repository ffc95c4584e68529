"""End-to-end router harness: one scripted engine, several front doors, same run.

For each front door (none = the engine directly, Narwhal, and sglang-router / vllm-router
when their binaries are given) and each concurrency level, a bounded number of streaming
chat requests goes through; the harness records time to first byte per request, the tokens
relayed, and the CPU time the front door's process tree spent (utime + stime from /proc).

    .venv/bin/python -m bench.router_e2e [--sglang PATH] [--vllm PATH] [--tokens 64]
        [--pace-ms 5]   # tokens 5 ms apart, one per read, as from a decoding engine

Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tests.conftest import BIN, ROOT, free_port, wait_http

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and all its descendants (live ones)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(d.name)] = int(f[1])
        cpu[int(d.name)] = (int(f[11]) + int(f[12])) / TICK
    family = {pid}
    grew = True
    while grew:
        grew = False
        for p, pp in parents.items():
            if pp in family and p not in family:
                family.add(p)
                grew = True
    return sum(cpu.get(p, 0.0) for p in family)


@dataclass
class Result:
    door: str
    concurrency: int
    requests: int
    tokens: int
    cpu_s: float
    ttfb: list[float]
    # CPU µs/token of each round (the table shows their median and range).
    rounds: list[float]

    def pct(self, q: float) -> float:
        s = sorted(self.ttfb)
        return s[min(len(s) - 1, int(q * len(s)))] * 1000


async def load(url: str, concurrency: int, requests: int, tokens: int,
               pace_ms: float = 0.0) -> tuple[int, list[float]]:
    script = f"script:paced:{tokens}:{pace_ms}" if pace_ms else f"script:echo:{tokens}"
    body = {"model": "main", "stream": True,
            "messages": [{"role": "user", "content": script}]}
    sem = asyncio.Semaphore(concurrency)
    ttfb: list[float] = []
    got = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one() -> None:
            nonlocal got
            async with sem:
                t = time.perf_counter()
                first = True
                async with s.post(url + "/v1/chat/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=120)) as r:
                    async for chunk in r.content.iter_any():
                        if first:
                            ttfb.append(time.perf_counter() - t)
                            first = False
                        got += chunk.count(b'"content":"w')

        await asyncio.gather(*(one() for _ in range(requests)))
    return got, ttfb


def start(args: list[str], health: str, port: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}{health}", p, 60)
    return p


def stop(p: subprocess.Popen[bytes]) -> None:
    os.killpg(p.pid, 15)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)


def doors(engine: str, a: argparse.Namespace) -> list[tuple[str, list[str], str, int]]:
    out = []
    tmp = Path(tempfile.mkdtemp())
    for dialect in ("openai", "lexi"):
        port = free_port()
        cfg = tmp / f"{dialect}.yaml"
        cfg.write_text(f"model: main\nlisten: {{port: {port}}}\nadmission: open\n"
                       f"phases: {{prefill_concurrency: 512, decode_concurrency: 512}}\n"
                       f"queue: {{size: 1024}}\n"
                       f"engines:\n  - {{name: e, url: '{engine}', dialect: {dialect}}}\n")
        out.append((f"narwhal ({dialect} dialect)", [str(BIN / "narwhal"), "serve", "--config",
                                                     str(cfg)], "/ready", port))
    # No upstream at all: what Granian + asyncio cost per streamed chunk by themselves.
    port = free_port()
    out.append(("floor: Granian app, no upstream", [sys.executable, "-m", "granian", "--interface",
                "asgi", "--loop", "uvloop", "--host", "127.0.0.1", "--port", str(port),
                "--no-ws", "bench.floor_app:app"], "/health", port))
    for name, exe in (("sglang-router", a.sglang), ("vllm-router", a.vllm)):
        if exe:
            port = free_port()
            sub = ["launch"] if name == "sglang-router" else []
            out.append((name, [exe, *sub, "--host", "127.0.0.1", "--port", str(port),
                               "--worker-urls", engine, "--policy", "round_robin"],
                        "/health", port))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang")
    ap.add_argument("--vllm")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,64,256")
    ap.add_argument("--pace-ms", type=float, default=0.0,
                    help="the engine emits tokens this far apart (0: as fast as it can)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each level this many times (median and range reported)")
    ap.add_argument("--scale", type=int, default=1,
                    help="multiply the requests per round (longer rounds, less tick noise)")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    eport = free_port()
    engine = f"http://127.0.0.1:{eport}"
    eng = start([sys.executable, "-m", "tests.scripted_engine", "--port", str(eport)],
                "/health", eport)
    results: list[Result] = []
    try:
        plan: list[tuple[str, list[str] | None, str, int]] = [("direct", None, "", eport)]
        plan += doors(engine, a)
        for door, cmd, health, port in plan:
            proc = None
            try:
                if cmd is not None:
                    proc = start(cmd, health, port)
            except Exception as e:  # a peer that cannot start is reported, not fatal
                print(f"{door}: did not start ({e})", file=sys.stderr)
                continue
            url = f"http://127.0.0.1:{port}"
            try:
                for c in levels:
                    n = max(20, 2 * c) * a.scale
                    asyncio.run(load(url, min(c, 8), 8, a.tokens, a.pace_ms))  # warm up
                    r = Result(door, c, 0, 0, 0.0, [], [])
                    for _ in range(a.rounds):
                        before = tree_cpu(proc.pid) if proc else tree_cpu(eng.pid)
                        tokens, ttfb = asyncio.run(load(url, c, n, a.tokens, a.pace_ms))
                        cpu = (tree_cpu(proc.pid) if proc else tree_cpu(eng.pid)) - before
                        r.requests += n
                        r.tokens += tokens
                        r.cpu_s += cpu
                        r.ttfb += ttfb
                        r.rounds.append(cpu / max(tokens, 1) * 1e6)
                    results.append(r)
            finally:
                if proc:
                    stop(proc)
    finally:
        stop(eng)
    direct = {r.concurrency: r for r in results if r.door == "direct"}
    print("| front door | streams | tokens | CPU µs/token (median) | range over rounds "
          "| CPU ms/request | TTFB p50 ms | TTFB p99 ms | added p50 ms | added p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        d = direct[r.concurrency]
        cpu_tok = "engine" if r.door == "direct" else f"{statistics.median(r.rounds):.1f}"
        spread = "" if r.door == "direct" else f"{min(r.rounds):.1f}-{max(r.rounds):.1f}"
        cpu_req = "" if r.door == "direct" else f"{r.cpu_s / r.requests * 1e3:.2f}"
        added50 = "" if r.door == "direct" else f"{r.pct(0.5) - d.pct(0.5):.1f}"
        added99 = "" if r.door == "direct" else f"{r.pct(0.99) - d.pct(0.99):.1f}"
        print(f"| {r.door} | {r.concurrency} | {r.tokens} | {cpu_tok} | {spread} | {cpu_req} "
              f"| {r.pct(0.5):.1f} | {r.pct(0.99):.1f} | {added50} | {added99} |")


if __name__ == "__main__":
    main()
