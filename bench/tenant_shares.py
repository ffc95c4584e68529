"""Two tenants of equal weight, one sending ten times the other, both backlogged: the
tokens each is served while both wait, with fair turns (each key a tenant) and without
(the same two keys as plain keys, one queue in arrival order).

One scripted engine that streams each answer at a fixed pace, Narwhal in front with
`admission: open` and a few seats, so requests wait in the router's queue; by default the
light tenant alone asks for all the engine serves, so both stay backlogged for the whole
window. Served tokens are counted by when each answer ended, within the window.

    .venv/bin/python -m bench.tenant_shares [--window-s 6] [--light-rps 20] [--ratio 10]
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

TOKENS, PACE_MS, SEATS = 8, 25, 4  # 0.2 s an answer: the engine serves 20 a second


async def offer(url: str, window_s: float, light_rps: float, ratio: int) -> dict[str, int]:
    """Each tenant's requests at its rate for `window_s`; the tokens each was served by the
    end of the window (answers still running or waiting then are not counted)."""
    served = {"heavy": 0, "light": 0}
    body = {
        "model": "main",
        "stream": True,
        "messages": [{"role": "user", "content": f"script:paced:{TOKENS}:{PACE_MS}"}],
    }
    start_at = time.monotonic()
    end_at = start_at + window_s

    async def one(s: aiohttp.ClientSession, tenant: str) -> None:
        headers = {"authorization": f"Bearer key-{tenant}"}
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            if r.status == 200 and time.monotonic() <= end_at:
                served[tenant] += TOKENS

    async def sender(s: aiohttp.ClientSession, tenant: str, rps: float) -> list[asyncio.Task[None]]:
        tasks = []
        i = 0
        while (at := start_at + i / rps) < end_at:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tasks.append(asyncio.create_task(one(s, tenant)))
            i += 1
        return tasks

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        heavy, light = await asyncio.gather(
            sender(s, "heavy", light_rps * ratio), sender(s, "light", light_rps)
        )
        await asyncio.sleep(max(0.0, end_at - time.monotonic()))
        for t in heavy + light:
            t.cancel()
        await asyncio.gather(*heavy, *light, return_exceptions=True)
    return served


def run(tenants: bool, engine: str, a: argparse.Namespace, tmp: Path) -> dict[str, int]:
    port = free_port()
    keys = (
        "[{key: key-heavy, tenant: heavy}, {key: key-light, tenant: light}]"
        if tenants
        else "[key-heavy, key-light]"
    )
    cfg = tmp / f"narwhal-{port}.yaml"
    cfg.write_text(
        f"model: main\nlisten: {{port: {port}}}\nadmission: open\n"
        f"auth: {{api_keys: {keys}}}\n"
        f"phases: {{prefill_concurrency: {SEATS}, decode_concurrency: {SEATS}}}\n"
        "queue: {size: 4096, wait_s: 600}\n"
        "serving: {http_retention_limit: 8192, request_timeout_s: 600}\n"
        f"engines: [{{name: e, url: '{engine}', dialect: openai}}]\n"
    )
    router = start([str(BIN / "narwhal"), "serve", "--config", str(cfg)], "/ready", port)
    try:
        return asyncio.run(offer(f"http://127.0.0.1:{port}", a.window_s, a.light_rps, a.ratio))
    finally:
        stop(router)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--light-rps", type=float, default=20.0)
    ap.add_argument("--ratio", type=int, default=10)
    a = ap.parse_args()
    eport = free_port()
    engine = f"http://127.0.0.1:{eport}"
    eng = start(
        [sys.executable, "-m", "tests.scripted_engine", "--port", str(eport)], "/health", eport
    )
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for tenants in (False, True):
                served = run(tenants, engine, a, Path(tmp))
                total = sum(served.values()) or 1
                rows.append(
                    f"| {'a tenant each (fair turns)' if tenants else 'plain keys (one queue)'} "
                    f"| {served['heavy']:,} | {served['light']:,} "
                    f"| {100 * served['light'] / total:.1f} % |"
                )
    finally:
        stop(eng)
    print(
        f"heavy {a.light_rps * a.ratio:g}/s, light {a.light_rps:g}/s, engine "
        f"{1000 * SEATS / (TOKENS * PACE_MS):g}/s, window {a.window_s:g} s"
    )
    print("| keys | heavy: served tokens | light: served tokens | light's share |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
