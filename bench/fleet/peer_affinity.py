"""Whether a peer's `cache_aware` places chat requests by their text, outside any load.

    .venv/bin/python -m bench.fleet.peer_affinity [--sglang /tmp/sgl/bin/sglang-router] \\
        [--vllm /tmp/vllmr/bin/vllm-router]

Four families of chat prompts (each a distinct 2,048-word prefix and a 64-word tail of its
own), ten of each in a shuffled order, sent one at a time through the peer onto four
simulated engines (`bench.fleet.server`): the engines' prefix-cache hit rate says whether
each family stayed on one engine (cache-aware: about 0.87, a family's first prompt the
only miss) or went where the order took it (round robin: about 0.58). One request at a
time keeps every engine idle, so a router's switch to placing by load alone never fires:
what is measured is whether its policy reads the chat's text at all.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import subprocess
import sys
from collections.abc import Callable

import aiohttp

from bench.fleet.replay import engine_stats, peer_command, reset
from bench.fleet.server import STOP_MARK
from tests.support import free_port, wait_http

ENGINES = 4
FAMILIES = 4
EACH = 10


def prompts(seed: int = 7) -> list[str]:
    order = [f for f in range(FAMILIES) for _ in range(EACH)]
    random.Random(seed).shuffle(order)
    out = []
    for k, fam in enumerate(order):
        prefix = " ".join(f"f{fam:02d}w{j:05d}" for j in range(2048))
        tail = " ".join(f"t{k:03d}w{j:04d}" for j in range(64))
        out.append(f"{prefix} {tail} {STOP_MARK}4")  # the simulated engine stops after 4
    return out


async def hit_rate(command: Callable[[int, list[str]], list[str]]) -> float:
    port = free_port()
    sim_cmd = [sys.executable, "-m", "bench.fleet.server", "--engines", str(ENGINES)]
    sim_cmd += ["--port", str(port), "--time-scale", "1"]
    sim = subprocess.Popen(sim_cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert sim.stdout is not None
    sim.stdout.readline()  # the engines are up
    urls = [f"http://127.0.0.1:{port + i}" for i in range(ENGINES)]
    rport = free_port()
    router = subprocess.Popen(
        command(rport, urls), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # Nothing else runs on the loop yet: waiting here blocks no one.
        wait_http(f"http://127.0.0.1:{rport}/health", router, 60)
        async with aiohttp.ClientSession() as s:
            await reset(urls)
            for text in prompts():
                chat = [{"role": "user", "content": text}]
                body = {"model": "m", "max_tokens": 4, "messages": chat}
                async with s.post(f"http://127.0.0.1:{rport}/v1/chat/completions", json=body) as r:
                    await r.read()
            p, c, *_ = await engine_stats(urls, 1.0)
            return c / p if p else 0.0
    finally:
        for proc in (router, sim):
            proc.send_signal(signal.SIGINT)
        for proc in (router, sim):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sglang", default="/tmp/sgl/bin/sglang-router")
    ap.add_argument("--vllm", default="/tmp/vllmr/bin/vllm-router")
    a = ap.parse_args()

    def peer(exe: list[str], policy: str) -> Callable[[int, list[str]], list[str]]:
        # At its defaults: one request at a time never reaches an admission knob.
        return lambda port, urls: peer_command(f"peer-{policy}@defaults", exe, port, urls, 0)

    for name, cmd in (
        ("vllm-router cache_aware", peer([a.vllm], "cache_aware")),
        ("sglang-router cache_aware", peer([a.sglang, "launch"], "cache_aware")),
        ("vllm-router round_robin", peer([a.vllm], "round_robin")),
    ):
        print(f"{name}: prefix-cache hit rate {asyncio.run(hit_rate(cmd)):.2f}")


if __name__ == "__main__":
    main()
