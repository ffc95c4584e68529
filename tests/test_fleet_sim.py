"""The fleet bench's own parts: the simulated GPU's cost model and cache, its vLLM-dialect
HTTP side, and the trace generator (bench/fleet)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest

from bench.fleet import projections
from bench.fleet.gpu import Gpu, GpuModel, Seq, block_hashes
from bench.fleet.replay import (
    EXACT,
    PEER_SECRET_ENV,
    Client,
    Outcome,
    Result,
    doors,
    duration_s,
    engine_stats,
    model_of,
    models,
    one,
    peer_command,
    request_body,
    reset_counters_only,
)
from bench.fleet.traces import Request, describe, generate, prompt_text
from tests.support import ROOT, free_port, sse_frames, start_router, wait_http, wait_until

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


def test_a_prompt_cancelled_in_its_prefill_leaves_only_what_it_computed_cached() -> None:
    gpu = Gpu(MODEL)  # 100 prompt tokens a step
    long = text("p", 250)
    gpu.submit(cut := seq(long))
    gpu.plan()  # one chunk of 100 computed: ten blocks
    cut.cancelled = True
    gpu.plan()  # dropped at the next step
    gpu.submit(again := seq(long))
    gpu.plan()
    assert again.cached_tokens == 100


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


def test_the_simulator_reports_its_load_as_vllm_does(sim: str) -> None:
    lines = httpx.get(sim + "/metrics", timeout=10).text.splitlines()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    assert values["vllm:num_requests_waiting"] == 0
    assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0
    assert values['vllm:cache_config_info{block_size="16",num_gpu_blocks="840"}'] == 1.0


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
    # Too large to ever fit the KV pool, it waits; gone with its client, waiting or not.
    while (st := httpx.get(sim + "/sim/stats").json())["running"] or st["waiting"]:
        assert time.monotonic() < end, "the sequence stayed after its client left"
        time.sleep(0.05)


def test_a_request_the_engines_admit_twice_is_counted_by_its_id(sim: str) -> None:
    asyncio.run(reset_counters_only([sim]))

    def send(rid: str) -> None:
        body = {"messages": [{"role": "user", "content": text("r", 20)}], "max_tokens": 2}
        r = httpx.post(
            sim + "/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=30
        )
        assert r.status_code == 200

    send("q0")
    send("q1")
    assert asyncio.run(engine_stats([sim], 0.05))[4] == 0
    send("q1")  # the same request again, as a second router or a retry would send it
    assert asyncio.run(engine_stats([sim], 0.05))[4] == 1


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


def test_every_prompt_has_the_same_bytes_a_token_whatever_its_block_ids() -> None:
    # A door that sizes prompts by their bytes (as Narwhal does, with no tokenizer) learns
    # one bytes-per-token from the warm-up's prompts (ids near 10**9) and applies it to the
    # trace's (ids from 1): text whose bytes a token grew with the ids was sized at half.
    small = prompt_text(Request(0, 700, 10, [1, 2]))
    large = prompt_text(Request(0, 700, 10, [10**9, 10**9 + 1]))
    assert len(small) == len(large)


def test_the_placement_cost_bench_judges_a_paced_fleet() -> None:
    # bench/README.md's placement figures come from this; it drives the ledger's own API.
    from bench.fleet.placement_cost import judge_us

    assert judge_us(4, 400, True, tpot=True, rounds=5) > 0


# -- the replay's protocol: what keeps a comparison fair --------------------------------


def test_a_peer_runs_with_its_own_admission_or_says_it_runs_at_its_defaults() -> None:
    engines = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cmd = peer_command("sglang-cache_aware@64", ["sgl", "launch"], 9, engines, budget_s=15.0)
    flags = dict(itertools.pairwise(cmd))
    assert flags["--max-concurrent-requests"] == "64" and flags["--queue-size"] == "64"
    assert flags["--queue-timeout-secs"] == "15"  # the TTFT budget, as the clients see it
    assert flags["--policy"] == "cache_aware"
    defaults = peer_command("vllm-cache_aware@defaults", ["vr"], 9, engines, budget_s=15.0)
    assert "--max-concurrent-requests" not in defaults
    # A peer named without saying how it is run is not run at all.
    for unsaid in ("sglang-cache_aware", "vllm-round_robin@", "sglang-cache_aware@many"):
        with pytest.raises(SystemExit):
            peer_command(unsaid, ["x"], 9, engines, budget_s=15.0)


def test_goodput_is_over_the_traces_duration_the_same_for_every_door() -> None:
    trace = [Request(t, 100, 10, [1]) for t in (0.0, 5000.0, 10000.0)]
    met = [Outcome(status=200, ttft_s=0.1, tpot_s=0.01, tokens=10) for _ in trace]
    quick = Result("quick", 2.0, met, span_s=1.0)  # a door that finished sooner
    slow = Result("slow", 2.0, met, span_s=60.0)  # one that drained a queue for a minute
    d = duration_s(trace, 2.0)
    assert d == 5.0
    assert quick.summary(5.0, 0.1, d)["goodput_per_s"] == slow.summary(5.0, 0.1, d)["goodput_per_s"]
    assert quick.summary(5.0, 0.1, d)["goodput_per_s"] == 3 / 5.0


def test_under_the_fair_protocol_no_door_can_read_an_answers_length(sim: str) -> None:
    r = Request(0.0, 40, 7, [123])
    body = request_body(r, Client(True, 2048, 10.0))
    assert body["max_tokens"] == 2048 and str(r.output_length) in body["messages"][0]["content"]
    frames = sse_frames(httpx.post(sim + "/v1/chat/completions", json=body, timeout=30).text)
    tokens = [
        f
        for f in frames
        if isinstance(f, dict) and f["choices"] and f["choices"][0]["delta"].get("content")
    ]
    assert len(tokens) == 7  # the engine stops at the hidden length, as at an EOS
    assert request_body(r, EXACT)["max_tokens"] == 7  # the older protocol told the door


def test_a_client_out_of_patience_leaves_and_counts_as_a_miss(sim: str) -> None:
    # A prompt whose prefill takes far longer than the client waits for its first token.
    r = Request(0.0, 100_000, 5, list(range(200)))
    out = Outcome()

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            await one(s, sim, r, 0.05, 600, out, Client(True, 2048, patience_s=1.0))

    asyncio.run(go())
    assert out.abandoned and out.ttft_s is None
    res = Result("d", 1.0, [out])
    row = res.summary(5.0, 0.1, 1.0)
    assert row["abandoned"] == 1 and row["misses"] == 1.0 and row["served"] == 0


def test_an_answer_the_clients_max_tokens_cuts_short_is_served_not_failed(sim: str) -> None:
    # The trace's answer is longer than the client asks for: the engine stops at the cap,
    # as every door's engine would, and the client has what it asked for.
    r = Request(0.0, 40, 30, [321])
    out = Outcome()

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            await one(s, sim, r, 0.05, 600, out, Client(True, 12, patience_s=100.0))

    asyncio.run(go())
    assert out.tokens == 12 and not out.failed
    assert Result("d", 1.0, [out]).summary(5.0, 1.0, 1.0)["served"] == 1


def test_prefill_slows_with_the_context_as_the_calibration_measured() -> None:
    flat = GpuModel(prefill_tps=38_000)
    h200 = GpuModel(prefill_tps=38_000, prefill_half_context=12_000)
    assert flat.chunk_s(8192, 2048) == flat.chunk_s(0, 2048)
    # The calibration's 2,048-token chunks: 38k tokens/s at no context, 23k at 8,192.
    rate_at = 2048 / h200.chunk_s(8192, 2048)
    assert 20_000 < rate_at < 26_000
    # A long prompt's chunks in one engine: each later chunk takes longer than the first.
    gpu = Gpu(dataclasses.replace(h200, chunk_tokens=2048, block_tokens=512))
    gpu.submit(Seq(16384, 1, []))
    steps = run_to_end(gpu)
    prefill_steps = steps[:8]
    assert prefill_steps == sorted(prefill_steps) and prefill_steps[-1] > 1.4 * prefill_steps[0]


def test_a_slower_engine_takes_longer_for_everything() -> None:
    slow = dataclasses.replace(MODEL, speed=0.5)
    assert slow.step_s(3, 100) == pytest.approx(2 * MODEL.step_s(3, 100))


def door_args(**given: Any) -> argparse.Namespace:
    """The replayer's arguments that shape its doors, as its command line sets them."""
    base: dict[str, Any] = {
        "doors": "narwhal-predictive",
        "baseline_tree": None,
        "tpot": False,
        "tpot_target_ms": 100.0,
        "time_scale": 2.0,
        "predictive_extra": "",
        "classes": None,
        "ttft_budget_s": 5.0,
    }
    return argparse.Namespace(**{**base, **given})


def test_a_router_change_is_ab_tested_against_an_older_tree_in_the_same_run(
    tmp_path: Path,
) -> None:
    a = door_args(
        doors="narwhal-predictive,narwhal-predictive@base", baseline_tree=tmp_path / "old"
    )
    current, base = doors(a, ["http://127.0.0.1:1"], tmp_path)
    assert current.env is None  # this tree's Narwhal
    assert base.env is not None and base.env["PYTHONPATH"] == str(tmp_path / "old" / "python")
    assert base.cmd is not None and current.cmd is not None
    assert base.cmd[1:3] == current.cmd[1:3] == ["serve", "--config"]  # the same settings
    assert "admission: predictive" in Path(base.cmd[3]).read_text()
    a.baseline_tree = None  # an A/B with nothing to compare against is refused
    with pytest.raises(SystemExit):
        doors(a, ["http://127.0.0.1:1"], tmp_path)
    # Several active routers of the older tree: its code, and the routers' shared secret.
    a = door_args(doors="narwhal-predictive@base-active3", baseline_tree=tmp_path / "old")
    (active,) = doors(a, ["http://127.0.0.1:1"], tmp_path, "http://127.0.0.1:2379")
    assert active.env is not None and active.env["PYTHONPATH"] == str(tmp_path / "old" / "python")
    assert PEER_SECRET_ENV in active.env and len(active.replicas) == 2
    assert active.cmd is not None and "mode: active" in Path(active.cmd[3]).read_text()


def test_several_models_are_served_by_their_engines_and_only_narwhal_places_by_model(
    tmp_path: Path,
) -> None:
    from narwhal.router.config import load

    a = door_args(models="chat:0.7:0-2,coder:0.3:2-3")
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    (door,) = doors(a, urls, tmp_path)
    assert door.cmd is not None
    config = load(door.cmd[3])
    assert [e.models for e in config.engines] == [
        ("chat",),
        ("chat",),
        ("chat", "coder"),  # shared: one engine, two models
        ("coder",),
    ]
    assert config.model == "chat"
    # The shares hold over the trace, and the same requests ask for the same model each run.
    asked = [model_of(i, models(a)) for i in range(2000)]
    assert 0.65 < asked.count("chat") / 2000 < 0.75
    assert asked == [model_of(i, models(a)) for i in range(2000)]
    a.doors = "sglang-cache_aware@64"  # a peer that cannot place by model is not compared
    a.sglang = "sglang-router"
    with pytest.raises(SystemExit):
        doors(a, urls, tmp_path)


def test_kv_taken_as_output_grows_preempts_the_last_admitted_and_both_finish() -> None:
    # Room for 12 blocks of 10 tokens: two prompts of 20 fit at once, their answers do not.
    small = dataclasses.replace(MODEL, kv_blocks=12, kv_on_demand=True)
    gpu = Gpu(small)
    first, second = seq(text("a", 20), out=45), seq(text("b", 20), out=45)
    gpu.submit(first)
    gpu.submit(second)
    gpu.plan()
    assert gpu.running == [first, second]  # admitted together: their prompts fit
    assert gpu.kv_usage == 6 / 12  # vLLM's `kv_cache_usage_perc`: prompts and first tokens
    run_to_end(gpu)
    assert first.done and second.done and gpu.served == 2
    assert gpu.kv_usage == 0.0  # cached blocks no sequence holds are free
    assert second.preempted and not first.preempted  # the one admitted last gave way
    assert gpu.preemptions >= 1 and gpu.pinned_blocks == gpu.private_blocks == 0
    # Reserved up front (the default), the second waits for the first and nothing is
    # preempted.
    gpu = Gpu(dataclasses.replace(small, kv_on_demand=False))
    a, b = seq(text("a", 20), out=45), seq(text("b", 20), out=45)
    gpu.submit(a)
    gpu.submit(b)
    gpu.plan()
    assert gpu.running == [a]
    run_to_end(gpu)
    assert gpu.served == 2 and gpu.preemptions == 0


def test_the_verdict_holds_narwhal_to_half_the_best_peers_misses_or_1_5x_its_goodput() -> None:
    from bench.fleet.verdict import verdict

    def row(door: str, load: float, misses: float, goodput: float) -> dict[str, object]:
        return {
            "door": door,
            "load": load,
            "misses": misses,
            "goodput_per_s": goodput,
            "served_within_slo": 1.0,
            "ttft_p99_s": 1.0,
            "offered": 100,
            "refused_by": {},
        }

    rows = [
        row("narwhal-predictive", 1, 0.06, 9.0),
        row("sglang-cache_aware@defaults", 1, 0.2, 8.0),
        row("sglang-cache_aware@64", 1, 0.1, 8.5),  # the best peer: 6 % is over half its 10 %
        row("narwhal-predictive", 4, 0.7, 9.0),
        row("sglang-cache_aware@64", 4, 0.8, 6.0),  # serves under half: goodput 1.5x holds
    ]
    lines = verdict(rows)
    one = next(x for x in lines if x.startswith("| 1x") and "misses" in x)
    assert "sglang-cache_aware@64" in one and one.endswith("FAIL |")
    four = next(x for x in lines if x.startswith("| 4x") and "goodput" in x)
    assert four.endswith("pass |")


def test_loads_are_stated_against_the_best_peers_measured_slo_capacity() -> None:
    from bench.fleet.verdict import capacity

    def row(door: str, load: float, goodput: float, attainment: float) -> dict[str, object]:
        return {"door": door, "load": load, "goodput_per_s": goodput, "slo_attainment": attainment}

    rows = [
        row("narwhal-predictive", 0.5, 5.0, 1.0),
        row("sglang-cache_aware@64", 0.5, 4.75, 0.95),  # 5 offered a second, 95 % in SLO
        row("narwhal-predictive", 1, 9.0, 0.9),
        row("sglang-cache_aware@64", 1, 8.0, 0.8),  # 10 offered, 80 %: past its capacity
        row("sglang-cache_aware@64", 2, 6.0, 0.3),
    ]
    lines = capacity(rows)
    assert "at least 5.00 requests/s" in lines[0]
    # Narwhal met both targets for 90 % at 10 offered a second: the best door's capacity.
    assert "at least 10.00 requests/s (narwhal-predictive)" in lines[1]
    assert "| 0.5x | 5.00 | 95.0 % | 1.00x | 0.50x |" in lines
    assert "| 1x | 10.00 | 80.0 % | 2.00x | 1.00x |" in lines
    assert "| 2x | 20.00 | 30.0 % | 4.00x | 2.00x |" in lines
    overloaded = capacity([r for r in rows if r["load"] != 0.5])
    assert "below the lightest" in overloaded[0]
    assert "| 1x | 10.00 | 80.0 % | over it | 1.00x |" in overloaded


def test_a_light_load_is_judged_at_half_the_best_doors_capacity_as_well_as_at_nominal_half() -> (
    None
):
    from bench.fleet.verdict import verdict

    def row(door: str, load: float, attained: float, refused: int) -> dict[str, object]:
        offered = 200
        return {
            "door": door,
            "load": load,
            "misses": 1 - attained,
            "slo_attainment": attained,
            "goodput_per_s": 10 * load * attained,  # 10 offered a second at 1x
            "served_within_slo": 1.0,
            "ttft_p99_s": 1.0,
            "offered": offered,
            "refused_by": {"429 tpot_target_exceeded": refused},
        }

    rows = [
        row("narwhal-predictive", 0.25, 0.995, 1),
        row("sglang-cache_aware@64", 0.25, 0.9, 0),
        # Narwhal's capacity: 5 a second (93 % in SLO); nothing meets 90 % at 1x.
        row("narwhal-predictive", 0.5, 0.93, 13),
        row("sglang-cache_aware@64", 0.5, 0.7, 0),
        row("narwhal-predictive", 1, 0.8, 30),
        row("sglang-cache_aware@64", 1, 0.5, 0),
    ]
    lines = verdict(rows)
    quarter = [x for x in lines if x.startswith("| 0.25x") and "refused" in x]
    assert len(quarter) == 1 and "0.50x the best door's capacity" in quarter[0]
    assert quarter[0].endswith("pass |")
    half = [x for x in lines if x.startswith("| 0.5x") and "refused" in x]
    # At nominal 0.5x the load is the best door's whole capacity: judged as nominal only.
    assert len(half) == 1 and "(nominal 0.5x or less)" in half[0] and half[0].endswith("FAIL |")
    assert not [x for x in lines if x.startswith("| 1x") and "refused" in x]


def test_the_router_exports_how_far_its_projections_and_cache_expectations_were_off(
    sim: str, tmp_path: Path
) -> None:
    r = start_router(
        tmp_path,
        "model: main\nlisten: {port: $PORT}\nadmission: predictive\n"
        "predictive: {ttft_budget_s: 30}\nprefix_cache: {block_bytes: 192}\n"
        f"engines: [{{name: g, url: '{sim}', dialect: vllm}}]\n",
    )
    try:
        # The router's probe measures the engine first.
        wait_until(
            lambda: bool(
                httpx.get(r.url + "/ready").json()["engines"][0]["profile"]["prefill_tokens_per_s"]
            ),
            30,
        )
        shared = list(range(7000, 7040))
        for tail in (1, 2, 3):  # the second and third share the first's 600 words
            body = request_body(Request(0, 640, 3, [*shared, 8000 + tail]), Client(True, 16))
            got = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=30)
            assert got.status_code == 200
            usage = next(
                f["usage"] for f in sse_frames(got.text) if isinstance(f, dict) and f.get("usage")
            )
            served = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert (served >= 560) == (tail > 1)  # the engine's cache did serve the share
        m = httpx.get(r.url + "/metrics").text

        def series(name: str, le: str | None = None) -> float:
            labels = '{engine="g"}' if le is None else f'{{engine="g",le="{le}"}}'
            line = next(x for x in m.splitlines() if x.startswith(name + labels))
            return float(line.split()[-1])

        # Every request was placed where it was projected.
        assert series("narwhal_ttft_prediction_error_count") >= 3
        # The engine's cache served what the router expected of it (none, then the shared
        # 600 words), give or take a tenth of the prompt. (Signed buckets: no _sum series.)
        err = "narwhal_cache_expectation_error_bucket"
        assert series("narwhal_cache_expectation_error_count") == 3
        assert series(err, "0.1") - series(err, "-0.1") == 3
    finally:
        r.stop()


def test_the_projections_reader_holds_narwhal_to_the_simulators_own_cost(tmp_path: Path) -> None:
    """`bench.fleet.projections` reads a dump's access lines and `/ready` against the cost a
    prompt alone has in the simulator: that cost is the simulator's own (its steps to the
    first token, at each engine's speed), and each figure is a projection over it."""
    model = dataclasses.replace(GpuModel(prefill_half_context=12_000), block_tokens=512)
    for speed, tokens in ((1.0, 9000), (0.5, 3000)):
        gpu = Gpu(dataclasses.replace(model, speed=speed))
        gpu.submit(Seq(tokens, 2, []))
        first = 0.0
        while True:
            dur, producing, _ = gpu.plan()
            first += dur
            gpu.finish_step(producing)
            if producing:
                break
        assert projections.alone_s(dataclasses.replace(model, speed=speed), tokens, 0, 2.0) == (
            pytest.approx(2 * first)
        )

    fleet = projections.Fleet(model, (1.0, 0.5), 2.0)
    slow_5k, fast_4k = fleet.alone_s("e1", 5000), fleet.alone_s("e0", 4000)
    assert slow_5k > 2 * fleet.alone_s("e0", 5000) * 0.99
    line = "2026-12-07 INFO narwhal.access POST /v1/chat/completions {} request_id={} {}"
    lines = [
        # Warm-up: not the trace's.
        line.format(200, "warm0", "outcome=completed engine=e0 own_ms=1 projected_ms=1"),
        # Refused for the margin on the slow engine, its own prefill projected 1.5x its cost.
        line.format(
            429,
            "a",
            "outcome=refused reason=ttft_budget_exceeded nearest_engine=e1 tokens_sized=5000 "
            f"own_ms={1500 * slow_5k} projected_ms={1500 * slow_5k} "
            f"guarded_ms={3000 * slow_5k}",
        ),
        # Served alone on the fast engine: projected at its cost, its first byte 1.1x.
        line.format(
            200,
            "b",
            f"outcome=completed engine=e0 tokens_in=4000 tokens_cached=0 cached_expected=0 "
            f"sent_ms=2.0 own_ms={1000 * fast_4k} projected_ms={1000 * fast_4k} "
            f"ttfb_ms={1100 * fast_4k}",
        ),
        # Long prompts on the fast engine, their own prefill projected 1.4x their cost (sent
        # after a wait: not alone), and one on the slow engine projected at twice its cost
        # (one prompt is no engine's reading).
        *(
            line.format(
                200,
                f"d{i}",
                f"outcome=completed engine=e0 tokens_in=9000 tokens_sized=9000 "
                f"cached_expected=0 sent_ms=900 own_ms={1400 * fleet.alone_s('e0', 9000)} "
                "projected_ms=1 ttfb_ms=1",
            )
            for i in range(projections.LONG_READ)
        ),
        line.format(
            429,
            "e",
            "outcome=refused reason=tpot_target_exceeded nearest_engine=e1 tokens_sized=9000 "
            f"own_ms={2000 * fleet.alone_s('e1', 9000)}",
        ),
        # Behind another prompt there: not alone, not read.
        line.format(
            200,
            "c",
            f"outcome=completed engine=e0 tokens_in=4000 tokens_cached=0 cached_expected=0 "
            f"sent_ms=2.0 own_ms={1000 * fast_4k} projected_ms={3000 * fast_4k} "
            f"ttfb_ms={9000 * fast_4k}",
        ),
    ]
    log = tmp_path / "narwhal-predictive-1x-r1.log"
    log.write_text("\n".join(lines) + "\n")
    long_s = fleet.alone_s("e0", projections.LONG)
    ready = {
        "engines": [
            {
                "name": "e0",
                "profile": {
                    "prefill_tokens_per_s": projections.LONG / (1.25 * long_s),
                    "prefill_overhead_s": 0.0,
                    "prefill_quadratic_s": 0.0,
                },
            }
        ]
    }
    c = projections.cell(projections.access_lines(log), ready, fleet)
    assert c["refused"] == {"ttft_budget_exceeded": 1, "tpot_target_exceeded": 1}
    assert c["margin_refusals"] == 1 and c["margin"] == pytest.approx(2.0)
    assert c["refused_own_over_cost"] == pytest.approx(1.5) and c["refused_own_over_1_2"] == 1
    assert c["alone_served"] == 1
    assert c["measured_over_cost"] == pytest.approx((1.1, 1.1))
    assert c["projected_over_cost"] == pytest.approx((1.0, 1.0))
    assert c["end_20k_over_cost"] == {1.0: pytest.approx(1.25)}
    n = projections.LONG_READ
    assert c["long_own_over_cost"] == {"e0": (pytest.approx(1.4), n), "e1": (pytest.approx(2.0), 1)}
    assert projections.most_off(c["long_own_over_cost"]) == f"e0 1.40 ({n})"
