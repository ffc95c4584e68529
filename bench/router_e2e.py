"""End-to-end router harness: one scripted engine, several front doors, same run.

For each front door (none = the engine directly, Narwhal, and sglang-router / vllm-router
when their binaries are given) and each concurrency level, a bounded number of streaming
chat requests goes through; the harness records time to first byte per request, the tokens
relayed, and the CPU time the front door's process tree spent (every thread, from /proc).
All doors run for the whole harness; rounds interleave them, and each door's CPU per token
is also given as a ratio to the best Rust router of the same round.

    .venv/bin/python -m bench.router_e2e [--sglang PATH] [--vllm PATH] [--tokens 64]
        [--pace-ms 5]   # tokens 5 ms apart, one per read, as from a decoding engine
        [--rounds 7] [--scale 4]
        [--narwhal-at DIR]   # also another checkout's router (DIR/python, its _native
                             # built in place), e.g. the commit before a change

Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from narwhal.router import affinity
from tests.support import BIN, ROOT, free_port, wait_http


def tree_cpu(pid: int) -> float:
    """CPU seconds `pid` and all its live descendants have run, every thread counted to the
    nanosecond (/proc/PID/task/TID/schedstat: clock ticks would round a one-stream round by
    ±10 %)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    family = {pid}
    grew = True
    while grew:
        grew = False
        for p, pp in parents.items():
            if pp in family and p not in family:
                family.add(p)
                grew = True
    ns = 0
    for p in family:
        try:
            for t in (Path("/proc") / str(p) / "task").iterdir():
                ns += int((t / "schedstat").read_text().split()[0])
        except OSError:  # ended meanwhile
            continue
    return ns / 1e9


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


async def load(
    url: str, concurrency: int, requests: int, tokens: int, pace_ms: float = 0.0
) -> tuple[int, list[float]]:
    script = f"script:paced:{tokens}:{pace_ms}" if pace_ms else f"script:echo:{tokens}"
    body = {"model": "main", "stream": True, "messages": [{"role": "user", "content": script}]}
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
                async with s.post(
                    url + "/v1/chat/completions",
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=120),
                ) as r:
                    async for chunk in r.content.iter_any():
                        if first:
                            ttfb.append(time.perf_counter() - t)
                            first = False
                        got += chunk.count(b'"content":"w')

        await asyncio.gather(*(one() for _ in range(requests)))
    return got, ttfb


def start(args: list[str], health: str, port: int) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_http(f"http://127.0.0.1:{port}{health}", p, 60)
    return p


def stop(p: subprocess.Popen[bytes]) -> None:
    os.killpg(p.pid, 15)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)


def router_yaml(
    port: int, engine: str, dialect: str = "openai", cpus: str = "auto", telemetry: str = ""
) -> str:
    """Narwhal in front of one engine, admitting everything, limits out of the way: what
    every CPU comparison runs (`serving.cpu_affinity`: `cpus`; `telemetry`: that section's
    YAML flow mapping, if any)."""
    return (
        f"model: main\nlisten: {{port: {port}}}\nadmission: open\n"
        f"serving: {{cpu_affinity: {cpus}}}\n"
        "phases: {prefill_concurrency: 512, decode_concurrency: 512}\n"
        "queue: {size: 1024}\n"
        + (f"telemetry: {telemetry}\n" if telemetry else "")
        + f"engines:\n  - {{name: e, url: '{engine}', dialect: {dialect}}}\n"
    )


def floor_cmd(port: int, app: str) -> list[str]:
    """A floor door: `app` on Granian + uvloop, kept to the CPU Narwhal keeps to by default
    (`serving.cpu_affinity: auto`), so the two are compared on the same footing."""
    cpus = affinity.choose("auto", os.sched_getaffinity(0))
    pinned = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
    granian = [sys.executable, "-m", "granian", "--interface", "asgi", "--loop", "uvloop"]
    return [*pinned, *granian, "--host", "127.0.0.1", "--no-ws", "--port", str(port), app]


def doors(engine: str, a: argparse.Namespace) -> list[tuple[str, list[str], str, int]]:
    out = []
    tmp = Path(tempfile.mkdtemp())
    # The last one leaves its threads to the OS scheduler (serving.cpu_affinity: none) to
    # show what keeping to one CPU, the default, is worth.
    for dialect, placement, label in (
        ("openai", "auto", "openai dialect"),
        ("lexi", "auto", "lexi dialect"),
        ("openai", "none", "openai dialect, cpu_affinity: none"),
    ):
        port = free_port()
        cfg = tmp / f"{port}.yaml"
        cfg.write_text(router_yaml(port, engine, dialect, placement))
        out.append(
            (
                f"narwhal ({label})",
                [str(BIN / "narwhal"), "serve", "--config", str(cfg)],
                "/ready",
                port,
            )
        )
    for ratio in a.traced or ():
        # Same config as the first door, with traces sent to a receiver in this harness
        # (decoding them is its CPU, not the door's): what tracing costs per token.
        port = free_port()
        cfg = tmp / f"{port}.yaml"
        sink = f"{{otlp_endpoint: '{a.receiver_url}', sample_ratio: {ratio}}}"
        cfg.write_text(router_yaml(port, engine, telemetry=sink))
        out.append(
            (
                f"narwhal (openai dialect, traced at {ratio:g})",
                [str(BIN / "narwhal"), "serve", "--config", str(cfg)],
                "/ready",
                port,
            )
        )
    if a.narwhal_at:
        # Same config as the first door, another checkout's code: a change's cost, side by
        # side with the current tree in the same rounds.
        port = free_port()
        cfg = tmp / f"{port}.yaml"
        cfg.write_text(router_yaml(port, engine))
        src = str(Path(a.narwhal_at).resolve() / "python")
        cmd = ["env", f"PYTHONPATH={src}", sys.executable, "-m", "narwhal.router.cli"]
        out.append(
            (
                f"narwhal at {a.narwhal_at} (openai dialect)",
                [*cmd, "serve", "--config", str(cfg)],
                "/ready",
                port,
            )
        )
    # No upstream at all: what Granian + asyncio cost per streamed chunk by themselves.
    port = free_port()
    out.append((FLOOR, floor_cmd(port, "bench.floor_app:app"), "/health", port))
    # An upstream but no logic: each read of the engine's answer handed to `send` as is.
    port = free_port()
    out.append((PROXY_FLOOR, floor_cmd(port, "bench.floor_proxy:app"), "/health", port))
    for name, exe in ((SGLANG, a.sglang), (VLLM, a.vllm)):
        if exe:
            port = free_port()
            sub = ["launch"] if name == SGLANG else []
            # Both default their metrics listener to port 29000: one each, so both can run.
            out.append(
                (
                    name,
                    [
                        exe,
                        *sub,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--worker-urls",
                        engine,
                        "--policy",
                        "round_robin",
                        "--prometheus-port",
                        str(free_port()),
                    ],
                    "/health",
                    port,
                )
            )
    return out


FLOOR = "floor: Granian app, no upstream"
PROXY_FLOOR = "proxy floor: Granian, reads forwarded as they come"
SGLANG, VLLM = "sglang-router", "vllm-router"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang")
    ap.add_argument("--vllm")
    ap.add_argument("--narwhal-at", metavar="DIR", help="also run another checkout's router")
    ap.add_argument(
        "--traced",
        type=lambda v: [float(x) for x in v.split(",")],
        metavar="RATIO[,RATIO...]",
        help="also run Narwhal with traces on at each sample ratio (OTLP to a receiver here)",
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,64,256")
    ap.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="the engine emits tokens this far apart (0: as fast as it can)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each level this many times (median and range reported)",
    )
    ap.add_argument(
        "--scale",
        type=int,
        default=1,
        help="multiply the requests per round (longer rounds, less tick noise)",
    )
    a = ap.parse_args()
    # The doors run in sessions of their own: a harness stopped by SIGTERM (`timeout`) must
    # still reach the `finally` that stops them, or they outlive it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    levels = [int(x) for x in a.levels.split(",")]
    receiver = None
    if a.traced:
        from tests.otlp_receiver import Receiver

        receiver = Receiver()
        a.receiver_url = receiver.url
    eport = free_port()
    engine = f"http://127.0.0.1:{eport}"
    os.environ["NARWHAL_FLOOR_ENGINE"] = engine
    eng = start(
        [sys.executable, "-m", "tests.scripted_engine", "--port", str(eport)], "/health", eport
    )
    results: dict[tuple[str, int], Result] = {}
    running: list[tuple[str, subprocess.Popen[bytes] | None, int]] = [("direct", None, eport)]
    try:
        # Every door runs for the whole harness and the rounds interleave them (round, level,
        # door): the machine's speed drifts by tens of percent over minutes, and a door
        # measured a minute after another is not measured side by side.
        for door, cmd, health, port in doors(engine, a):
            try:
                running.append((door, start(cmd, health, port), port))
            except Exception as e:  # a peer that cannot start is reported, not fatal
                print(f"{door}: did not start ({e})", file=sys.stderr)
        for door, _, port in running:
            for c in levels:
                asyncio.run(
                    load(f"http://127.0.0.1:{port}", min(c, 8), 8, a.tokens, a.pace_ms)
                )  # warm up
                results[door, c] = Result(door, c, 0, 0, 0.0, [], [])
        for _ in range(a.rounds):
            for c in levels:
                n = max(20, 2 * c) * a.scale
                for door, proc, port in running:
                    pid = proc.pid if proc else eng.pid
                    before = tree_cpu(pid)
                    tokens, ttfb = asyncio.run(
                        load(f"http://127.0.0.1:{port}", c, n, a.tokens, a.pace_ms)
                    )
                    cpu = tree_cpu(pid) - before
                    r = results[door, c]
                    r.requests += n
                    r.tokens += tokens
                    r.cpu_s += cpu
                    r.ttfb += ttfb
                    r.rounds.append(cpu / max(tokens, 1) * 1e6)
    finally:
        for _, proc, _ in running:
            if proc:
                stop(proc)
        stop(eng)
        if receiver is not None:
            print(f"traced door: {len(receiver.spans())} spans received", file=sys.stderr)
            receiver.close()
    report(results, levels, [d for d, _, _ in running])


def report(results: dict[tuple[str, int], Result], levels: list[int], order: list[str]) -> None:
    print(
        "| front door | streams | tokens | CPU µs/token (median) | range over rounds "
        "| CPU ms/request | TTFB p50 ms | TTFB p99 ms | added p50 ms | added p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for door in order:
        for c in levels:
            r, d = results[door, c], results["direct", c]
            direct = door == "direct"
            cpu_tok = "engine" if direct else f"{statistics.median(r.rounds):.1f}"
            spread = "" if direct else f"{min(r.rounds):.1f}-{max(r.rounds):.1f}"
            cpu_req = "" if direct else f"{r.cpu_s / r.requests * 1e3:.2f}"
            added50 = "" if direct else f"{r.pct(0.5) - d.pct(0.5):.1f}"
            added99 = "" if direct else f"{r.pct(0.99) - d.pct(0.99):.1f}"
            print(
                f"| {r.door} | {r.concurrency} | {r.tokens} | {cpu_tok} | {spread} | {cpu_req} "
                f"| {r.pct(0.5):.1f} | {r.pct(0.99):.1f} | {added50} | {added99} |"
            )
    # A variant of Narwhal (traced, another checkout) against Narwhal as configured by
    # default, round by round: what the variant's difference costs per token.
    base = "narwhal (openai dialect)"
    variants = [d for d in order if d.startswith("narwhal at ") or "traced" in d]
    if variants:
        print()
        print("| door | " + " | ".join(f"{c} streams: / {base} (range)" for c in levels) + " |")
        print("|---|" + "---|" * len(levels))
        for door in variants:
            cells = []
            for c in levels:
                pairs = zip(results[door, c].rounds, results[base, c].rounds, strict=True)
                ratios = [x / b for x, b in pairs if b > 0]
                cells.append(
                    f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
                )
            print(f"| {door} | " + " | ".join(cells) + " |")
    peers = [p for p in (SGLANG, VLLM) if (p, levels[0]) in results]
    if not peers:
        return
    # Each round's CPU per token against the best Rust router in that same round; the
    # median over rounds is the side-by-side ratio (drift between rounds cancels out).
    print()
    print(
        "| front door | "
        + " | ".join(f"{c} streams: / best Rust router (range)" for c in levels)
        + " |"
    )
    print("|---|" + "---|" * len(levels))
    for door in order:
        if door == "direct" or door in peers:
            continue
        cells = []
        for c in levels:
            rounds = results[door, c].rounds
            best = [min(results[p, c].rounds[i] for p in peers) for i in range(len(rounds))]
            ratios = [x / b for x, b in zip(rounds, best, strict=True) if b > 0]
            cells.append(
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                if ratios
                else "n/a"
            )
        print(f"| {door} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
