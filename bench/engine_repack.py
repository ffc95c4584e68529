"""Weight repacking: LexiEngine's decode tokens/s with `--repack` vs `--no-repack`, for a Q4_0
and a Q4_1 model, at 1 and 8 concurrent streams; all four servers run at once and the waves
interleave them, so each ratio is taken within seconds of the machine's state (median over
`--rounds`).

The Q4_0 model is made from the bundled Q4_1 one with llama.cpp's own quantizer (requantized:
the numbers compare kernels, not model quality).

    .venv/bin/python -m bench.engine_repack [--tokens 64] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.engine_batching import wave
from narwhal.bundled_model import smollm2_path
from tests.support import Server, start_engine

LEVELS = (1, 8)


def q4_0(source: str, into: Path) -> str:
    import llama_cpp

    out = into / "smollm2-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(source.encode(), str(out).encode(), params) != 0:
        raise RuntimeError("quantizing to Q4_0 failed")
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args()
    import llama_cpp

    print(llama_cpp.llama_print_system_info().decode())
    with tempfile.TemporaryDirectory() as tmp:
        models = {"Q4_1": str(smollm2_path()), "Q4_0": q4_0(str(smollm2_path()), Path(tmp))}
        servers: dict[tuple[str, bool], Server] = {}
        try:
            for name, path in models.items():
                for repack in (True, False):
                    servers[name, repack] = start_engine(
                        path,
                        "--repack" if repack else "--no-repack",
                        "--parallel",
                        "8",
                        "--ctx-size",
                        "4096",
                        "--threads",
                        str(a.threads),
                        "--temp",
                        "0",
                    )
            got: dict[tuple[str, bool, int], list[float]] = {}
            for _ in range(a.rounds):
                for c in LEVELS:
                    for key, s in servers.items():
                        got.setdefault((*key, c), []).append(wave(s.url, c, a.tokens)["agg"])
        finally:
            for s in servers.values():
                s.stop()
    print(f"threads {a.threads}, {a.tokens} tokens a stream, median of {a.rounds} rounds\n")
    print("| model | streams | repack tok/s | no-repack tok/s | repack / no-repack |")
    print("|---|---|---|---|---|")
    for name in models:
        for c in LEVELS:
            on = statistics.median(got[name, True, c])
            off = statistics.median(got[name, False, c])
            ratios = [x / y for x, y in zip(got[name, True, c], got[name, False, c], strict=True)]
            print(
                f"| {name} | {c} | {on:.1f} | {off:.1f} | {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}) |"
            )


if __name__ == "__main__":
    main()
