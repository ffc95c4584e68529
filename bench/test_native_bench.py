"""pytest-benchmark: each Rust hot path and its pure-Python reference on the same input.

`make bench` (or `pytest bench --benchmark-only`). CI gates on `bench.native_ratios --gate 5`
(tests/test_ratio_gates.py).
"""

from __future__ import annotations

import pytest

from bench.workloads import WORKLOADS
from narwhal._native import Assembler, SseDecoder, StreamRelay, ThinkSplitter
from tests.reference import RefSseDecoder, RefThinkSplitter, ref_assemble, ref_relay_event

NAMES = list(WORKLOADS)


def rust_decode(chunks: list[bytes]) -> int:
    d = SseDecoder()
    return sum(len(d.feed(c)) for c in chunks)


def ref_decode(chunks: list[bytes]) -> int:
    d = RefSseDecoder()
    return sum(len(d.feed(c)) for c in chunks)


def newline_scan(chunks: list[bytes]) -> int:
    return sum(c.count(b"\n\n") for c in chunks)


def rust_relay(chunks: list[bytes]) -> int:
    r = StreamRelay(strip_token_ids=True, require_token_ids=False)
    return sum(r.feed(c).events for c in chunks)


def ref_relay(chunks: list[bytes]) -> int:
    d = RefSseDecoder()
    n = 0
    for c in chunks:
        for _, data, _ in d.feed(c):
            ref_relay_event(data, True, False)
            n += 1
    return n


def rust_assemble(chunks: list[bytes], kind: str) -> bytes:
    a = Assembler(kind)  # type: ignore[arg-type]
    for c in chunks:
        a.feed(c)
    return a.finish(0)


def ref_assemble_chunks(chunks: list[bytes], kind: str) -> object:
    d = RefSseDecoder()
    return ref_assemble([data for c in chunks for _, data, _ in d.feed(c)], kind)


THINK_DELTAS = ["<th", "ink>"] + ["word "] * 2000 + ["</th", "ink>"] + ["answer "] * 500


def rust_think() -> int:
    t = ThinkSplitter()
    n = sum(len(r) + len(c) for r, c in map(t.feed, THINK_DELTAS))
    return n


def ref_think() -> int:
    # The reference splits a whole text; streaming it means re-splitting the growing text.
    t = RefThinkSplitter()
    for d in THINK_DELTAS:
        t.text += d
        if len(t.text) % 64 == 0:
            t.split_all()
    return len(t.split_all()[0])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["rust", "python", "newline-scan"])
def test_sse_decode(benchmark: object, name: str, impl: str) -> None:
    fn = {"rust": rust_decode, "python": ref_decode, "newline-scan": newline_scan}[impl]
    benchmark(fn, WORKLOADS[name][2])  # type: ignore[operator]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["rust", "python"])
def test_relay(benchmark: object, name: str, impl: str) -> None:
    fn = rust_relay if impl == "rust" else ref_relay
    benchmark(fn, WORKLOADS[name][2])  # type: ignore[operator]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["rust", "python"])
def test_assemble(benchmark: object, name: str, impl: str) -> None:
    _, kind, chunks = WORKLOADS[name]
    fn = rust_assemble if impl == "rust" else ref_assemble_chunks
    benchmark(fn, chunks, kind)  # type: ignore[operator]


@pytest.mark.parametrize("impl", ["rust", "python"])
def test_think(benchmark: object, impl: str) -> None:
    benchmark(rust_think if impl == "rust" else ref_think)  # type: ignore[operator]
