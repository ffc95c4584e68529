"""CI's ratio gates: bounds on ratios measured side by side in one run, generous enough that
a shared machine's noise (tens of per cent between rounds) never fails them, tight enough
that a change making a hot path several times costlier does.

The figures themselves live in bench/README.md; these only keep a floor under them.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.router_e2e import floor_cmd, load, router_yaml, start, stop, tree_cpu
from tests.support import BIN, ROOT, free_port

pytestmark = pytest.mark.slow

# Narwhal's CPU per relayed token over the proxy floor's (Granian handing each read of the
# engine's answer to `send`, no logic), median of 5 rounds. Measured 1.3-2.1x at 64 streams
# (bench/README.md, "Router CPU per request, by stage"); 3x means a real regression.
ROUTER_OVER_FLOOR = 3.0
# Every Rust hot path against its pure-Python reference: measured 10-60x.
RUST_OVER_PYTHON = 5.0


def test_every_rust_hot_path_stays_several_times_ahead_of_its_python_reference() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.native_ratios", "--gate", str(RUST_OVER_PYTHON)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_routers_cpu_per_token_stays_within_a_bound_of_the_proxy_floor() -> None:
    eport = free_port()
    engine = f"http://127.0.0.1:{eport}"
    procs = [
        start(
            [sys.executable, "-m", "tests.scripted_engine", "--port", str(eport)], "/health", eport
        )
    ]
    try:
        nport, fport = free_port(), free_port()
        cfg = Path(tempfile.mkdtemp()) / "narwhal.yaml"
        cfg.write_text(router_yaml(nport, engine))
        router = start([str(BIN / "narwhal"), "serve", "--config", str(cfg)], "/ready", nport)
        procs.append(router)
        os.environ["NARWHAL_FLOOR_ENGINE"] = engine
        floor = start(floor_cmd(fport, "bench.floor_proxy:app"), "/health", fport)
        procs.append(floor)
        for port in (nport, fport):  # connections opened, code paths warm
            asyncio.run(load(f"http://127.0.0.1:{port}", 8, 32, 64))
        ratios = []
        for _ in range(5):  # rounds interleave the doors: the machine's speed drifts
            per_token = []
            for p, port in ((router, nport), (floor, fport)):
                url = f"http://127.0.0.1:{port}"
                before = tree_cpu(p.pid)
                tokens, _ = asyncio.run(load(url, 64, 640, 64))
                assert tokens == 640 * 64  # every request relayed in full
                per_token.append((tree_cpu(p.pid) - before) / tokens)
            ratios.append(per_token[0] / per_token[1])
        assert statistics.median(ratios) <= ROUTER_OVER_FLOOR, ratios
    finally:
        for p in reversed(procs):
            stop(p)
