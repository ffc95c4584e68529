"""`narwhal up`'s engine threads: every CPU vs one fewer (the router is pinned to one CPU), with
the streams going through the router, as a user of `narwhal up` runs them. Both set-ups run
at once (each its own router and engine) and the waves interleave them; figures are medians
over `--rounds` of aggregate output tokens/s and of the slowest stream's time per token.

    .venv/bin/python -m bench.up_threads [--tokens 64] [--rounds 5] [--busy 1]

`--busy N` runs N busy-looping processes during the waves: other work on the machine (a
build, a test suite, a neighbour), which is what makes spinning threads expensive.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from bench.engine_batching import wave
from tests.support import BIN, ROOT, Server, free_port, wait_http

LEVELS = (1, 4)


class Up(Server):
    def __init__(self, threads: int) -> None:  # a Server that runs `narwhal up`
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(BIN / "narwhal"), "up", "--port", str(self.port), "--threads", str(threads)],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(self.url + "/ready", self.proc, 180)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--busy", type=int, default=0, help="busy-looping processes beside")
    a = p.parse_args()
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        sys.exit("needs at least 2 CPUs (with one, both choices are 1 thread)")
    choices = (cpus, cpus - 1)
    ups = {t: Up(t) for t in choices}
    got: dict[tuple[int, int], list[dict[str, float]]] = {}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        for _ in range(a.rounds):
            for c in LEVELS:
                for t, up in ups.items():
                    got.setdefault((t, c), []).append(wave(up.url, c, a.tokens))
    finally:
        for b in busy:
            b.kill()
        for up in ups.values():
            up.stop()
    print(
        f"{cpus} CPUs, {a.busy} busy processes beside, {a.tokens} tokens a stream, "
        f"median of {a.rounds} rounds\n"
    )
    print("| streams | threads | tok/s | worst TPOT ms | tok/s vs threads = CPUs |")
    print("|---|---|---|---|---|")
    for c in LEVELS:
        for t in choices:
            agg = [w["agg"] for w in got[t, c]]
            ratio = statistics.median(
                x / y for x, y in zip(agg, (w["agg"] for w in got[cpus, c]), strict=True)
            )
            worst = statistics.median(w["worst"] for w in got[t, c]) * 1000
            print(f"| {c} | {t} | {statistics.median(agg):.1f} | {worst:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
