"""A bounded soak: the router in front of the scripted engine for `--seconds`, `--streams`
concurrent clients, a share of them faulty (`--faults`): engine errors passed through,
engines that break mid-stream, deadlines that pass, clients that hang up mid-stream, and
bodies no server should accept. The router worker's RSS and open files are sampled every
second.

Reports requests by outcome, 5xx that were not the injected fault's own answer, requests
lost (no answer and no error the client caused), and RSS growth per 1,000 requests after
warm-up.

    .venv/bin/python -m bench.soak [--seconds 120] [--streams 32] [--faults 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from tests.support import Server, free_port, start_router

FAULTS = {
    # name: (request body, header, what the client should get)
    "engine_500": ({"prompt": "script:status:500", "stream": True}, {}, {500}),
    "engine_429": ({"prompt": "script:status:429", "stream": False}, {}, {429}),
    "engine_dies": ({"prompt": "script:die", "stream": True}, {}, {200, 502, 503}),
    "deadline": ({"prompt": "script:hang", "stream": True}, {"x-narwhal-timeout-ms": "300"}, {200}),
    "bad_json": (b'{"prompt": ', {}, {400}),
    "too_deep": (b'{"prompt": "x", "a": ' + b"[" * 300 + b"]" * 300 + b"}", {}, {400}),
    "bad_header": ({"prompt": "hi"}, {"x-narwhal-timeout-ms": "9" * 400}, {200}),
}


def _worker(main_pid: int) -> int:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == main_pid:
                    return int(d.name)
            except (OSError, ValueError, IndexError):
                continue
    raise RuntimeError("no router worker")


def _sample(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:"))
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


async def client(
    url: str, end: float, fault_share: float, tally: collections.Counter[str], rng: random.Random
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        while time.monotonic() < end:
            hang_up = rng.random() < fault_share / 2
            name = rng.choice(list(FAULTS)) if rng.random() < fault_share else "ok"
            body, headers, expect = FAULTS.get(
                name,
                (
                    {"prompt": f"script:echo:{rng.randint(8, 64)}", "stream": rng.random() < 0.8},
                    {},
                    {200},
                ),
            )
            data = body if isinstance(body, bytes) else orjson.dumps(body)
            tally["requests"] += 1
            tally["faults injected"] += name != "ok"
            tally["bad inputs"] += name in ("bad_json", "too_deep", "bad_header")
            try:
                async with s.post(
                    url + "/v1/completions",
                    data=data,
                    headers={"content-type": "application/json", **headers},
                ) as r:
                    if hang_up:  # the client goes away mid-answer
                        await r.content.readany()
                        tally["client hang-ups"] += 1
                        r.close()
                        continue
                    text = await r.read()
                    if r.status not in expect:
                        tally[f"unexpected {r.status} ({name})"] += 1
                        if r.status >= 500:
                            tally["5xx not injected"] += 1
                    elif (
                        name == "ok"
                        and r.status == 200
                        and b"[DONE]" not in text
                        and b'"choices"' not in text
                    ):
                        tally["lost"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                tally["lost"] += 1


async def run(
    url: str, seconds: float, streams: int, faults: float, pid: int
) -> tuple[collections.Counter[str], list[tuple[float, int, int, int]]]:
    tally: collections.Counter[str] = collections.Counter()
    samples: list[tuple[float, int, int, int]] = []
    end = time.monotonic() + seconds

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append((time.monotonic(), tally["requests"], *_sample(pid)))
            await asyncio.sleep(1)

    rng = random.Random(7)
    await asyncio.gather(
        sampler(),
        *(client(url, end, faults, tally, random.Random(rng.random())) for _ in range(streams)),
    )
    samples.append((time.monotonic(), tally["requests"], *_sample(pid)))
    return tally, samples


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--faults", type=float, default=0.05)
    a = p.parse_args()
    port = free_port()
    engine = Server(
        [sys.executable, "-m", "tests.scripted_engine", "--port", str(port)], "/health", port
    )
    router = start_router(
        Path(tempfile.mkdtemp()),
        f"""
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 0.2}}
engines: [{{name: s, url: "{engine.url}", dialect: openai}}]
""",
    )
    try:
        pid = _worker(router.proc.pid)
        tally, samples = asyncio.run(run(router.url, a.seconds, a.streams, a.faults, pid))
        alive = router.proc.poll() is None
    finally:
        router.stop()
        engine.stop()
    warm = samples[min(len(samples) - 1, max(1, len(samples) // 5)) :]
    slope = statistics.linear_regression([s[1] for s in warm], [s[2] for s in warm]).slope
    print(
        f"{a.seconds:g} s, {a.streams} clients, {a.faults:.0%} faulty; router alive after: "
        f"{alive}\n"
    )
    for k, v in sorted(tally.items()):
        print(f"| {k} | {v} |")
    print(f"| RSS start / end (MiB) | {samples[0][2] / 1024:.1f} / {samples[-1][2] / 1024:.1f} |")
    print(f"| RSS growth per 1,000 requests after warm-up (KiB) | {slope * 1000:.1f} |")
    print(f"| open files start / end | {samples[0][3]} / {samples[-1][3]} |")


if __name__ == "__main__":
    main()
