"""The Rust hot paths vs their Python references in instructions, counted by callgrind.

Wall-clock ratios (bench/native_ratios.py) swing by tens of percent on a shared machine;
instruction counts do not: the same binary on the same input executes the same instructions
whatever else the machine does. Each figure is (instructions of a process that runs the
workload N+1 times) - (the same process doing nothing), over N+1. Instructions are not time
(the two sides retire them at different rates), so this is the stable companion of the
wall-clock table, not a replacement.

    .venv/bin/python -m bench.native_instructions [--runs 10]    (needs valgrind)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("rust_relay", "ref_relay", "rust_asm", "ref_asm")

WORKER = """
import sys
from bench.test_native_bench import ref_assemble_chunks, ref_relay, rust_assemble, rust_relay
from bench.workloads import WORKLOADS
name, side, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
frames, kind, chunks = WORKLOADS[name]
fn = {"rust_asm": lambda: rust_assemble(chunks, kind),
      "ref_asm": lambda: ref_assemble_chunks(chunks, kind),
      "rust_relay": lambda: rust_relay(chunks), "ref_relay": lambda: ref_relay(chunks),
      "none": lambda: None}[side]
for _ in range(n + 1):
    fn()
"""


def instructions(workload: str, side: str, runs: int) -> int:
    # This checkout's narwhal (its _native built in place), not whichever is installed: the
    # same script then measures another checkout, e.g. the commit before a change.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "python"), str(ROOT)))}
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-c",
            WORKER,
            workload,
            side,
            str(runs),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=True,
    )
    m = re.search(r"Collected : (\d+)", out.stderr)
    if m is None:
        raise RuntimeError(out.stderr[-2000:])
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    print(
        "| workload | events | relay: Rust instr/event | relay: python/rust "
        "| assemble: Rust instr/event | assemble: python/rust |"
    )
    print("|---|---|---|---|---|---|")
    for name, (frames, _, _) in WORKLOADS.items():
        base = instructions(name, "none", a.runs)
        per = {s: (instructions(name, s, a.runs) - base) / (a.runs + 1) for s in SIDES}
        n = len(frames)
        print(
            f"| {name} | {n} | {per['rust_relay'] / n:.0f} "
            f"| {per['ref_relay'] / per['rust_relay']:.1f}x "
            f"| {per['rust_asm'] / n:.0f} | {per['ref_asm'] / per['rust_asm']:.1f}x |"
        )


if __name__ == "__main__":
    main()
