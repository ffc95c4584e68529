"""The fleet bench's own parts: the simulated GPU's cost model and cache, its vLLM-dialect
HTTP side, and the trace generator (bench/fleet)."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from bench.fleet.gpu import Gpu, GpuModel, Seq, block_hashes
from bench.fleet.traces import Request, describe, generate, prompt_text
from tests.support import ROOT, free_port, sse_frames, wait_http

MODEL = GpuModel(
    step_base_s=0.01, step_per_seq_s=0.001, prefill_tps=1000, chunk_tokens=100, block_tokens=10
)


def seq(prompt: str, out: int = 3) -> Seq:
    w = prompt.split()
    return Seq(len(w), out, block_hashes(w, MODEL.block_tokens))


def text(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def run_to_end(gpu: Gpu) -> list[float]:
    steps = []
    while not gpu.idle:
        dur, producing, _ = gpu.plan()
        steps.append(dur)
        gpu.finish_step(producing)
    return steps


def test_step_time_is_base_plus_streams_plus_prefill_chunk() -> None:
    gpu = Gpu(MODEL)
    gpu.submit(seq(text("a", 150), out=2))
    dur, producing, prefill = gpu.plan()
    assert (prefill, producing) == (100, [])  # one chunk, no token yet
    assert dur == pytest.approx(0.01 + 100 / 1000)
    dur, producing, prefill = gpu.plan()
    assert prefill == 50 and len(producing) == 1  # the prefill's last chunk samples token 1
    gpu.finish_step(producing)
    dur, producing, prefill = gpu.plan()
    assert prefill == 0 and dur == pytest.approx(0.01 + 0.001)  # decode only: one stream


def test_a_shared_prefix_is_served_from_cache_once_computed() -> None:
    gpu = Gpu(MODEL)
    system = text("s", 40)
    gpu.submit(first := seq(system + " " + text("q", 5)))
    run_to_end(gpu)
    gpu.submit(second := seq(system + " " + text("r", 5)))
    gpu.plan()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 40  # four whole blocks of ten
    assert (gpu.prompt_tokens, gpu.cached_tokens) == (90, 40)


def test_least_recently_used_prefixes_are_evicted_from_their_tail() -> None:
    small = GpuModel(**{**MODEL.__dict__, "kv_blocks": 12})
    gpu = Gpu(small)
    old = text("old", 40)
    gpu.submit(seq(old, out=1))
    run_to_end(gpu)
    for i in range(3):  # newer prompts push the old one out
        gpu.submit(seq(text(f"n{i}", 40), out=1))
        run_to_end(gpu)
    again = seq(old, out=1)
    gpu.submit(again)
    gpu.plan()
    assert again.cached_tokens < 40
    assert gpu.pinned_blocks + gpu.private_blocks + len(gpu.free_cached) <= 12


def test_a_cancelled_sequence_gives_its_blocks_back() -> None:
    gpu = Gpu(MODEL)
    s = seq(text("a", 30), out=50)
    gpu.submit(s)
    gpu.plan()
    s.cancelled = True
    gpu.plan()
    assert gpu.idle and gpu.private_blocks == 0 and gpu.pinned_blocks == 0


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.fleet.server",
            "--engines",
            "1",
            "--port",
            str(port),
            "--time-scale",
            "0.05",
            "--block-tokens",
            "16",
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, 30)
    yield url
    proc.terminate()
    proc.wait(10)


def test_the_simulator_streams_as_vllm_does(sim: str) -> None:
    body = {
        "messages": [{"role": "user", "content": text("w", 40)}],
        "max_tokens": 5,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    first = httpx.post(sim + "/v1/chat/completions", json=body, timeout=30)
    frames = [f for f in sse_frames(first.text) if isinstance(f, dict)]
    tokens = [f for f in frames if f["choices"] and f["choices"][0]["delta"].get("content")]
    assert len(tokens) == 5  # one chunk per token
    assert all(len(f["choices"][0]["token_ids"]) == 1 for f in tokens)
    assert len(tokens[0]["prompt_token_ids"]) == 40
    assert frames[-1]["usage"]["prompt_tokens"] == 40
    assert frames[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = [
        f
        for f in sse_frames(httpx.post(sim + "/v1/chat/completions", json=body, timeout=30).text)
        if isinstance(f, dict)
    ]
    assert again[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 2 blocks


def test_a_client_that_leaves_cancels_its_sequence(sim: str) -> None:
    raw = orjson.dumps(
        {
            "messages": [{"role": "user", "content": text("x", 30)}],
            "max_tokens": 100000,
            "stream": True,
        }
    )
    host, port = sim.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    end = time.monotonic() + 10
    while httpx.get(sim + "/sim/stats").json()["running"]:
        assert time.monotonic() < end, "the sequence kept running after its client left"
        time.sleep(0.05)


def test_equal_hash_ids_are_equal_text_and_the_rate_is_the_fleet_s_capacity() -> None:
    a = Request(0, 1100, 10, [7, 8, 9])
    b = Request(0, 1500, 10, [7, 8, 11])
    ta, tb = prompt_text(a).split(), prompt_text(b).split()
    assert len(ta) == 1100 and len(tb) == 1500
    assert ta[:1024] == tb[:1024] and ta[1024] != tb[1024]
    reqs = generate("production", 400, engines=8, seed=3, model=GpuModel())
    d = describe(reqs)
    assert d["requests"] == 400 and 0.2 < d["shared_fraction"] < 0.9
    assert all(x.timestamp_ms <= y.timestamp_ms for x, y in itertools.pairwise(reqs))
    more = generate("production", 400, engines=16, seed=3, model=GpuModel())
    assert describe(more)["rate_per_s"] == pytest.approx(2 * d["rate_per_s"], rel=0.01)
    again = generate("production", 400, engines=8, seed=3, model=GpuModel())
    assert [r.line() for r in again] == [r.line() for r in reqs]  # a seed is one trace


def test_the_placement_cost_bench_judges_a_paced_fleet() -> None:
    # bench/README.md's placement figures come from this; it drives the ledger's own API.
    from bench.fleet.placement_cost import judge_us

    assert judge_us(4, 400, True, tpot=True, rounds=5) > 0
