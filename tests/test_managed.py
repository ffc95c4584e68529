"""Managed engines: the router starts LexiEngine, serves through it, restarts it when it
dies, and leaves no process behind when it stops."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support import start_router

pytestmark = pytest.mark.slow


def _engine_pid(router_pid: int) -> int | None:
    """The router's managed engine: the lexi-engine process whose parent is not one."""
    family = _descendants(router_pid)
    for d in sorted(Path("/proc").iterdir(), key=lambda p: p.name):
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            stat = (d / "stat").read_text().split()
        except OSError:
            continue
        if (
            any(c.endswith(b"lexi-engine") for c in cmd[:2])
            and b"serve" in cmd
            and int(d.name) in family
            and int(stat[3]) in family
        ):
            parent_cmd = Path(f"/proc/{stat[3]}/cmdline").read_bytes()
            if b"lexi-engine" not in parent_cmd:
                return int(d.name)
    return None


def _descendants(pid: int) -> set[int]:
    out = {pid}
    changed = True
    while changed:
        changed = False
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) not in out:
                try:
                    ppid = int((d / "stat").read_text().split()[3])
                except OSError:
                    continue
                if ppid in out:
                    out.add(int(d.name))
                    changed = True
    return out


def test_managed_engine_serves_restarts_and_stops(model_path: str, tmp_path: Path) -> None:
    r = start_router(
        tmp_path,
        f"""
model: main
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 0.2}}
engines:
  - name: local
    launch: {{model: {model_path}, parallel: 2, args: ["--ctx-size", "1024"]}}
""",
    )
    try:
        body = {"model": "main", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        ok = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        pid = _engine_pid(r.proc.pid)
        assert pid is not None
        # The router keeps to one CPU; the engine it launched gets back all of them.
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
        if len(os.sched_getaffinity(0)) > 1:
            assert len(os.sched_getaffinity(r.proc.pid)) == 1
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while True:
            assert time.monotonic() < end, "engine was not restarted"
            new = _engine_pid(r.proc.pid)
            if new not in (None, pid) and httpx.get(r.url + "/ready").status_code == 200:
                break
            time.sleep(0.2)
        again = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=60)
        assert again.status_code == 200
        _tool_call_through_the_router(r.url)
        tree = _descendants(r.proc.pid)
    finally:
        r.stop()
    time.sleep(0.5)
    alive = [
        p
        for p in tree
        if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
    ]
    assert alive == []


def _tool_call_through_the_router(url: str) -> None:
    """A LexiEngine tool call survives the router's relay (token IDs checked on every
    tool-call event) and its non-streaming assembly."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    body = {
        "model": "main",
        "messages": [{"role": "user", "content": "weather?"}],
        "grammar": "root ::= " + json.dumps(call),
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    }
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tc,) = choice["message"]["tool_calls"]
    assert (tc["function"]["name"], json.loads(tc["function"]["arguments"])) == (
        "get_weather",
        {"city": "Oslo"},
    )
    streamed = httpx.post(
        url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60
    ).text
    assert "error" not in streamed and "<tool_call>" not in streamed
    assert '"name":"get_weather"' in streamed and streamed.rstrip().endswith("[DONE]")
    # A required call that does not come: LexiEngine's error event is this request's end,
    # relayed once; the engine stays in service for everyone else.
    refused = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json=body
        | {
            "stream": True,
            "tool_choice": "required",
            "grammar": 'root ::= "no call"',
            "max_tokens": 20,
        },
    ).text
    assert refused.count('"error"') == 1 and "tool_call_invalid" in refused
    assert "engine_disconnected" not in refused
    assert httpx.get(url + "/ready").status_code == 200
    whole = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json=body | {"tool_choice": "required", "grammar": 'root ::= "no call"', "max_tokens": 20},
    )
    assert whole.status_code == 422  # LexiEngine's own status, not 502 bad_engine_output
    assert whole.json()["error"]["code"] == "tool_call_invalid"


def test_predictor_learns_a_real_lexiengine(model_path: str, tmp_path: Path) -> None:
    r = start_router(
        tmp_path,
        f"""
model: main
listen: {{port: $PORT}}
admission: predictive
predictive: {{ttft_budget_s: 30}}
engines:
  - name: local
    launch: {{model: {model_path}, parallel: 1, args: ["--ctx-size", "1024"]}}
""",
    )
    try:
        text = "Tell me about the sea and the animals that live in it. " * 8
        # Three prefills that had the engine alone: one the router's own profiling probe
        # shared steps with teaches no rate, so a few more requests may be needed.
        for _ in range(8):
            prof = httpx.get(r.url + "/ready").json()["engines"][0]["profile"]
            if prof["prefill_samples"] >= 3:
                break
            ok = httpx.post(
                r.url + "/v1/chat/completions",
                timeout=60,
                json={
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 4,
                    "stream": True,
                },
            )
            assert ok.status_code == 200, ok.text
        prof = httpx.get(r.url + "/ready").json()["engines"][0]["profile"]
        assert prof["prefill_tokens_per_s"] > 0 and prof["prefill_samples"] >= 3
        # SmolLM2's BPE reads English at a few bytes a token; the chat template's own
        # tokens count against the message bytes, so it reads lower than raw text would.
        assert 1.5 < prof["bytes_per_token"] < 8
        assert prof["sizing_error"] is not None and prof["sizing_error"] < 0.5
        assert prof["time_per_output_token_s"] > 0
    finally:
        r.stop()


def _restarts(url: str) -> str | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('narwhal_engine_restarts_total{engine="local"}'):
            return line.split()[-1]
    return None


def test_a_crash_is_named_and_nothing_outlives_a_killed_router(
    model_path: str, tmp_path: Path
) -> None:
    r = start_router(
        tmp_path,
        f"""
listen: {{port: $PORT}}
admission: open
health: {{interval_s: 0.2}}
engines:
  - name: local
    launch: {{model: {model_path}, parallel: 1, args: ["--ctx-size", "512"]}}
""",
    )
    tree: set[int] = set()
    try:
        assert _restarts(r.url) == "0.0"  # exported from the start
        engine = _engine_pid(r.proc.pid)
        assert engine is not None
        (worker,) = _descendants(engine) - {engine}
        os.kill(worker, signal.SIGSEGV)  # what a crash inside llama.cpp looks like
        end = time.monotonic() + 60
        while _restarts(r.url) != "1.0":
            assert time.monotonic() < end, "the crash was not counted"
            time.sleep(0.1)
        (desc,) = httpx.get(r.url + "/ready").json()["engines"]
        assert desc["process"]["last_exit"].startswith("was killed by SIGSEGV")
        assert desc["process"]["restarts"] == 1
        # out of placement from the moment the process ended, not from the next probe
        assert desc["healthy"] is False and "killed by SIGSEGV" in desc["reason"]
        while httpx.get(r.url + "/ready").status_code != 200:  # restarted, serving again
            assert time.monotonic() < end, "the engine did not come back"
            time.sleep(0.2)
        tree = _descendants(r.proc.pid)
        assert len(tree) >= 4  # router main, its worker, the engine's main and worker
        os.kill(r.proc.pid, signal.SIGKILL)
        r.proc.wait()
        end = time.monotonic() + 30
        while [p for p in tree if _alive(p)]:
            assert time.monotonic() < end, [p for p in tree if _alive(p)]
            time.sleep(0.1)
    finally:
        r.stop()
        for p in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    err = r.stderr()
    assert "engine local was killed by SIGSEGV" in err and "--no-repack" in err
    assert "[engine local]" in err  # the engine's own lines, labelled


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
