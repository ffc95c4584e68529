"""Side-by-side ratios for the Rust hot paths, measured in one run: prints bench/README's table.

    .venv/bin/python -m bench.native_ratios [--gate X]

`--gate X` (CI) fails when a Rust path is not at least X times its Python reference on every
workload. Both sides run in the same process on the same machine, one after the other, so
the ratio holds across machines where an absolute time recorded elsewhere does not.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from bench.test_native_bench import (
    newline_scan,
    ref_assemble_chunks,
    ref_decode,
    ref_relay,
    rust_assemble,
    rust_decode,
    rust_relay,
)
from bench.workloads import WORKLOADS


def best(fn: Callable[[], object], repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--gate",
        type=float,
        metavar="X",
        help="exit 1 unless every python/rust ratio is at least X",
    )
    args = ap.parse_args()
    worst = float("inf")
    print(
        "| workload | events | decode: python/rust | decode: rust/newline-scan "
        "| relay: python/rust | assemble: python/rust |"
    )
    print("|---|---|---|---|---|---|")
    for name, (frames, kind, chunks) in WORKLOADS.items():
        d_rust = best(lambda c=chunks: rust_decode(c))
        d_ref = best(lambda c=chunks: ref_decode(c))
        d_scan = best(lambda c=chunks: newline_scan(c))
        r_rust = best(lambda c=chunks: rust_relay(c))
        r_ref = best(lambda c=chunks: ref_relay(c))
        a_rust = best(lambda c=chunks, k=kind: rust_assemble(c, k))
        a_ref = best(lambda c=chunks, k=kind: ref_assemble_chunks(c, k))
        print(
            f"| {name} | {len(frames)} | {d_ref / d_rust:.1f}x | {d_rust / d_scan:.1f}x "
            f"| {r_ref / r_rust:.1f}x | {a_ref / a_rust:.1f}x |"
        )
        worst = min(worst, d_ref / d_rust, r_ref / r_rust, a_ref / a_rust)
    if args.gate is not None and worst < args.gate:
        print(
            f"gate: the slowest Rust path is {worst:.1f}x its Python reference, under "
            f"{args.gate:g}x",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
