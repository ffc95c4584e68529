"""Replay a trace open-loop through front doors onto one simulated fleet, side by side.

    .venv/bin/python -m bench.fleet.replay --trace bench/fleet/traces/production-8.jsonl \\
        --engines 8 --loads 0.5,1,2,4 --time-scale 2 --ttft-budget-s 5 --tpot-target-ms 100 \\
        [--sglang /tmp/sgl/bin/sglang-router] [--vllm /tmp/vllmr/bin/vllm-router] \\
        [--doors direct,narwhal-predictive,narwhal-open,sglang-cache_aware,...] \\
        [--requests 400] [--json out.json] [--plot out.png]

For every load and door: the engines' caches and counters are reset, the door starts, a
short warm-up of unique prompts (not counted) lets learning doors learn, then the trace
is offered at `load` times its own pace (1x = the fleet's capacity, see traces.py), every
request streamed. Per door and load: offered, served, refused (by status and code),
failed, abandoned, SLO attainment (served with TTFT within the budget and mean TPOT within
the target, over offered), misses (1 - attainment: refused, abandoned, failed or late),
goodput (SLO-met requests a second over the trace's own duration at that load, the same
divisor for every door), TTFT p50/p90/p99 of what was served, the fleet's prefix-cache hit
rate (cached / prompt tokens, as the engines counted them), the door's CPU per request
(its whole process tree), and in the JSON `sim_lag`: how much slower than their model the
engines ran because this machine's loop woke late (a cell it could not keep up with), and
`placed_twice`: requests the engines admitted more than once (each is sent with an
`x-request-id` of its own, which Narwhal forwards; `seen_by_id` says how many came with it).
Every time is measured on the wall clock and divided by `--time-scale`.

The protocol (`--protocol`):
- `fair` (the default): a client asks for a generous `max_tokens` (`--max-tokens`, 2,048)
  and the engine stops at the trace's output length, which only the prompt's last word
  (`stop@N`, read by the simulated engine) carries: no door knows an answer's length. A
  client gives up on a request that has no first token after `--patience` times the TTFT
  budget, closing the connection (which cancels it upstream): it counts as a miss.
- `exact`: the older protocol, kept to reproduce the figures measured with it:
  `max_tokens` = the output length, and clients that never give up.

Peers run as their operators run them: `sglang-POLICY@CAP` and `vllm-POLICY@CAP` with
`--max-concurrent-requests CAP --queue-size CAP --queue-timeout-secs` (the TTFT budget),
or `@defaults` for a peer with nothing set; a peer named with neither is refused.
`--runs N` repeats every cell N times, every door in each run, and the table gives each
figure's median and range. `narwhal-MODE@base` is Narwhal from `--baseline-tree` (a worktree
of an older commit): a router change A/B'd in one run (`@base-activeN`: N active routers of
that tree). `narwhal-MODE@activeN` is N active
routers (`ha.mode: active`) on an etcd the bench starts, the clients spread over them round
robin; the door's CPU is all N processes'. The simulated engines' realism is
`--sim-args`: `--kv-on-demand` (KV as output grows, preemption), `--prefill-half-context
12000` (prefill slowing with the context, the H200 calibration), `--jitter 0.1`, `--speeds
1,1,1,0.5` (a mixed fleet); without them the engines are the older figures' model.

Loopback only; every request loop is bounded by the trace and a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.fleet.server import STOP_MARK
from bench.fleet.traces import Request, prompt_text, read
from bench.router_e2e import tree_cpu
from tests.support import BIN, ROOT, free_port, wait_http

TOKEN = re.compile(rb'"(?:content|text)":\s*"t\d')
CACHED = re.compile(rb'"cached_tokens":\s*(\d+)')


@dataclass
class Outcome:
    status: int = 0
    code: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    cached: int | None = None  # as the engine's usage said
    failed: bool = False
    klass: str = ""  # its class or tenant (--classes), sent as its tenant's key
    model: str = ""  # the model it asks for (--models; "": the router's one)
    prompt: int = 0  # its prompt tokens, as the trace says
    abandoned: bool = False  # the client gave up before a first token (a miss)
    rid: str = ""  # the `x-request-id` it is sent with ("": none)


@dataclass
class Result:
    door: str
    load: float
    outcomes: list[Outcome] = field(default_factory=list)
    span_s: float = 0.0
    cpu_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0  # the engines' own count (a sequence's KV freed to be recomputed)
    # How much slower than their model the engines ran because this machine's loop woke
    # late (their summed lateness over their summed step time, on the wall clock): a cell
    # this machine could not keep up with says so here.
    sim_lag: float = 0.0
    # Requests the engines admitted more than once, by the ID each was sent with (a door
    # that does not forward `x-request-id` shows none either way).
    placed_twice: int = 0
    seen_by_id: int = 0  # of the requests the engines admitted, those that came with an ID
    run: int = 1

    def summary(self, budget_s: float, tpot_s: float, duration_s: float) -> dict[str, Any]:
        """The figures of this door at this load; `duration_s` is the trace's own span at
        this load, the one divisor of goodput for every door (a door that refuses fast
        would otherwise gain by finishing sooner)."""
        o = self.outcomes
        served = [x for x in o if x.status == 200 and not x.failed and not x.abandoned]
        refused = [x for x in o if x.status not in (0, 200) and not x.abandoned]
        abandoned = [x for x in o if x.abandoned]
        failed = [
            x for x in o if x.status in (0, 200) and (x.failed or x.status == 0) and not x.abandoned
        ]
        met = [
            x
            for x in served
            if x.ttft_s is not None and x.ttft_s <= budget_s and (x.tpot_s or 0.0) <= tpot_s
        ]
        ttfts = sorted(x.ttft_s for x in served if x.ttft_s is not None)
        tpots = sorted(x.tpot_s for x in served if x.tpot_s is not None)
        codes: dict[str, int] = {}
        for x in refused:
            k = f"{x.status} {x.code}"
            codes[k] = codes.get(k, 0) + 1
        return {
            "door": self.door,
            "load": self.load,
            "run": self.run,
            "offered": len(o),
            "abandoned": len(abandoned),
            "misses": 1 - len(met) / len(o) if o else 0.0,
            "served": len(served),
            "refused": len(refused),
            "refused_by": codes,
            "failed": len(failed),
            "slo_attainment": len(met) / len(o) if o else 0.0,
            "served_within_slo": len(met) / len(served) if served else 0.0,
            "goodput_per_s": len(met) / duration_s if duration_s else 0.0,
            "goodput_tokens_per_s": sum(x.tokens for x in met) / duration_s if duration_s else 0.0,
            "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p90_s": _pct(ttfts, 90),
            "ttft_p99_s": _pct(ttfts, 99),
            "tpot_p50_ms": 1000 * (_pct(tpots, 50) or 0.0),
            "tpot_p99_ms": 1000 * (_pct(tpots, 99) or 0.0),
            "missed_ttft": sum(1 for x in served if x.ttft_s is None or x.ttft_s > budget_s),
            "missed_tpot": sum(1 for x in served if (x.tpot_s or 0.0) > tpot_s),
            "prefix_hit": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "preemptions": self.preemptions,
            "placed_twice": self.placed_twice,
            "seen_by_id": self.seen_by_id,
            "sim_lag": self.sim_lag,
            "cpu_ms_per_request": 1000 * self.cpu_s / len(o) if o else 0.0,
            "by_class": _breakdown(o, refused, met, served, lambda x: x.klass),
            "by_model": _breakdown(o, refused, met, served, lambda x: x.model),
        }


def _breakdown(
    o: list[Outcome],
    refused: list[Outcome],
    met: list[Outcome],
    served: list[Outcome],
    key: Callable[[Outcome], str],
) -> dict[str, dict[str, int]]:
    """The figures per class (`--classes`) or per model (`--models`): `key` of a request."""
    return {
        k: {
            "offered": sum(1 for x in o if key(x) == k),
            "refused": sum(1 for x in refused if key(x) == k),
            "within_slo": sum(1 for x in met if key(x) == k),
            "served_tokens": sum(x.prompt + x.tokens for x in served if key(x) == k),
        }
        for k in dict.fromkeys(key(x) for x in o)
        if k
    }


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs)) - 1))]


@dataclass(frozen=True)
class Client:
    """How the clients behave (`--protocol`)."""

    hidden_lengths: bool = True  # a generous max_tokens; the answer's length in the prompt
    max_tokens: int = 2048
    patience_s: float | None = None  # unscaled: no first token by then, the client leaves


EXACT = Client(hidden_lengths=False)


def request_body(r: Request, client: Client, model: str = "") -> dict[str, Any]:
    """What a client sends for `r`: under the fair protocol no door can tell the answer's
    length (only the engine reads the prompt's last word)."""
    text = prompt_text(r)
    if client.hidden_lengths:
        text += f" {STOP_MARK}{r.output_length}"
    return {
        "model": model or "main",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max(client.max_tokens, 1) if client.hidden_lengths else r.output_length,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one(
    session: aiohttp.ClientSession,
    url: str,
    r: Request,
    scale: float,
    deadline_s: float,
    out: Outcome,
    client: Client = EXACT,
) -> None:
    task = asyncio.current_task()
    assert task is not None
    first_seen: list[float] = []
    watchdog = None
    if client.patience_s is not None:
        # No first token within its patience: the client closes the connection.
        def give_up() -> None:
            if not first_seen:  # no token yet (once one came, it stays to the end)
                out.abandoned = True
                task.cancel()

        watchdog = asyncio.get_running_loop().call_later(client.patience_s * scale, give_up)
    try:
        await _one(session, url, r, scale, deadline_s, out, client, first_seen)
    except asyncio.CancelledError:
        if not out.abandoned:
            raise
        out.code = "abandoned"
    finally:
        if watchdog is not None:
            watchdog.cancel()


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    r: Request,
    scale: float,
    deadline_s: float,
    out: Outcome,
    client: Client,
    first_seen: list[float],
) -> None:
    body = request_body(r, client, out.model)
    headers = {"content-type": "application/json"}
    if out.rid:
        headers["x-request-id"] = out.rid
    if out.klass:
        headers["authorization"] = f"Bearer key-{out.klass}"
    if r.session:
        headers["x-session-id"] = r.session
        body["user"] = r.session
    sent = time.monotonic()
    first = last = 0.0
    try:
        async with session.post(
            url + "/v1/chat/completions",
            data=orjson.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=deadline_s),
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                raw = await resp.read()
                try:
                    out.code = str(orjson.loads(raw)["error"].get("code"))
                except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                    out.code = raw[:40].decode("utf-8", "replace")
                return
            async for chunk in resp.content.iter_any():
                n = len(TOKEN.findall(chunk))
                if n:
                    now = time.monotonic()
                    if not first:
                        first = now
                        first_seen.append(now)
                    last = now
                    out.tokens += n
                if b"cached_tokens" in chunk and (m := CACHED.search(chunk)):
                    out.cached = int(m.group(1))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.failed = True
        out.code = type(exc).__name__  # in the dump: a reset, say, or a timeout
        return
    if out.tokens < min(r.output_length, body["max_tokens"]):
        out.failed = True  # cut short; an answer longer than the client asked for ends at it
    if first:
        out.ttft_s = (first - sent) / scale
        if out.tokens > 1:
            out.tpot_s = (last - first) / (out.tokens - 1) / scale


async def offer(
    urls: list[str],
    trace: list[Request],
    load: float,
    scale: float,
    classes: list[tuple[str, float]] | None = None,
    only: str | None = None,
    client: Client = EXACT,
    served: list[Served] | None = None,
    ids: str = "q",
) -> tuple[list[Outcome], float]:
    """Every request at its time (open loop): the trace's pace times `load`, spread over
    `urls` in turn (a door's one URL, or the engines themselves for `direct`), each with the
    `x-request-id` `ids` + its index in `trace` (the door's access lines name it); with
    `classes`, each request of a class (in those shares, the same requests every run), and
    with `only` that class's requests alone (the rest are not sent, nor returned)."""
    outs = [
        Outcome(
            klass=klass_of(i, classes),
            model=model_of(i, served),
            prompt=r.input_length,
            rid=f"{ids}{i}",
        )
        for i, r in enumerate(trace)
    ]
    # A pooled connection is let go after 5 s idle (httpx's default; aiohttp's is 15 s): a
    # door that closes idle connections sooner than its client (Narwhal after its
    # `header_timeout_s`, 10 s) races the client's reuse of one and the request is lost
    # before it reaches the door, which is a client's fault, not the door's.
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=5)
    async with aiohttp.ClientSession(connector=conn) as s:
        start = time.monotonic()
        tasks = []
        t0 = trace[0].timestamp_ms
        for i, (r, o) in enumerate(zip(trace, outs, strict=True)):
            if only is not None and o.klass != only:
                continue
            at = start + (r.timestamp_ms - t0) / 1000 / load * scale
            delay = at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url = urls[i % len(urls)]
            tasks.append(asyncio.create_task(one(s, url, r, scale, 600 * scale, o, client)))
        await asyncio.gather(*tasks)
        span = (time.monotonic() - start) / scale
    return [o for o in outs if only is None or o.klass == only], span


@dataclass(frozen=True)
class Served:
    """A model of `--models`: its share of the requests and the engines serving it."""

    name: str
    share: float
    engines: range


def model_of(i: int, served: list[Served] | None) -> str:
    """Request `i`'s model: a fixed scramble of the index (not the classes') against the
    shares."""
    if not served:
        return ""
    u = ((i * 2246822519 + 374761393) % 2**32) / 2**32
    for m in served:
        if u < m.share:
            return m.name
        u -= m.share
    return served[-1].name


def klass_of(i: int, classes: list[tuple[str, float]] | None) -> str:
    """Request `i`'s class: a fixed scramble of the index against the shares."""
    if not classes:
        return ""
    u = ((i * 2654435761) % 2**32) / 2**32
    for name, share in classes:
        if u < share:
            return name
        u -= share
    return classes[-1][0]


async def warm(
    url: str, n: int, scale: float, keyed: bool = False, served: list[Served] | None = None
) -> None:
    """Unique prompts a learning door measures its engines on (not counted, not cached),
    spread over the models where there are several."""
    warmup = [
        Request(i * 150.0, 600 + 400 * (i % 4), 24, [10**9 + i * 100 + k for k in range(3)])
        for i in range(n)
    ]
    critical = [("critical", 1.0)] if keyed else None
    await offer([url], warmup, 1.0, scale, critical, None, EXACT, served, ids="warm")


async def engine_stats(urls: list[str], scale: float) -> tuple[int, int, int, float, int, int]:
    """The fleet's prompt tokens, cached tokens, preemptions, lag (the engines' lateness
    over their step time on the wall clock, `scale` times the model's) and requests admitted
    more than once (by their IDs, over every engine), of the requests seen by ID, since the
    last reset."""
    async with aiohttp.ClientSession() as s:
        p = c = k = 0
        lag = busy = 0.0
        seen: dict[str, int] = {}
        for u in urls:
            async with s.get(u + "/sim/stats") as r:
                d = await r.json()
                p += d["prompt_tokens"]
                c += d["cached_tokens"]
                k += d.get("preemptions", 0)
                lag += d.get("lag_s", 0.0)
                busy += d.get("busy_s", 0.0)
                for rid in d.get("request_ids", ()):
                    seen[rid] = seen.get(rid, 0) + 1
        twice = sum(1 for n in seen.values() if n > 1)
        return p, c, k, lag / (busy * scale) if busy else 0.0, twice, len(seen)


async def snapshot(url: str, where: Path) -> None:
    """`url`'s JSON body written to `where` (any status: a router not ready says why)."""
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        where.write_bytes(await r.read())


async def reset(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for u in urls:
            for _ in range(200):
                async with s.post(u + "/sim/reset") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)


@dataclass
class Door:
    name: str
    cmd: list[str] | None  # None: the engines directly, round robin (no process)
    health: str = "/health"
    port: int = 0
    env: dict[str, str] | None = None  # the process's environment (None: this one's)
    # More routers of the same door (`@activeN`): each its command and port.
    replicas: list[tuple[list[str], int]] = field(default_factory=list)


PEER_SECRET_ENV = "NARWHAL_BENCH_PEER_SECRET"


def doors(
    a: argparse.Namespace, engines: list[str], tmp: Path, etcd: str | None = None
) -> list[Door]:
    out: list[Door] = []
    wanted = a.doors.split(",")
    for name in wanted:
        port = free_port()
        if name == "direct":
            out.append(Door(name, None))
        elif name.startswith("narwhal-"):
            mode, _, variant = name.split("-", 1)[1].partition("@")
            # `@base`, `@activeN`, or both: `@base-activeN`.
            based = variant == "base" or variant.startswith("base-")
            active = variant.removeprefix("base-") if based else variant
            env: dict[str, str] | None = None
            if based:
                if a.baseline_tree is None:
                    raise SystemExit(f"{name}: --baseline-tree names the tree it runs")
                env = {**os.environ, "PYTHONPATH": str(a.baseline_tree.resolve() / "python")}
            if active.startswith("active") and active[6:].isdigit() and etcd is not None:
                env = {**(env or os.environ), PEER_SECRET_ENV: "bench-peer-secret"}
            elif active and active != "base":
                raise SystemExit(
                    f"{name}: Narwhal's door variants are @base, @activeN and @base-activeN"
                )
            variant = "" if active == "base" else active
            n = int(variant[6:]) if variant.startswith("active") else 1
            ports = [port] + [free_port() for _ in range(n - 1)]
            ha = ""
            if n > 1 or variant.startswith("active"):
                ha = (
                    f"ha: {{etcd: ['{etcd}'], key: /bench/{name}-{port}/leader, lease_ttl_s: 5, "
                    f"mode: active, peer_secret_env: {PEER_SECRET_ENV}}}\n"
                )
            lines = "\n".join(
                f'  - {{name: e{i}, url: "{u}", dialect: vllm{engine_models(i, a)}}}'
                for i, u in enumerate(engines)
            )
            tpot = f", tpot_target_s: {a.tpot_target_ms / 1000 * a.time_scale}" if a.tpot else ""
            if a.predictive_extra:
                tpot += ", " + a.predictive_extra
            auth = ""
            if a.classes:  # a tenant each, its key `key-NAME`, a class its priority
                keys = ", ".join(
                    f"{{key: key-{k}, tenant: {k}, priority: {_priority(k)}}}"
                    for k, _ in classes(a)
                )
                auth = f"auth: {{api_keys: [{keys}]}}\n"
            served = models(a)
            cmds = []
            for p in ports:
                cfg = tmp / f"{name}-{p}.yaml"
                cfg.write_text(
                    auth + ha + f"model: {served[0].name if served else 'main'}\n"
                    f"listen: {{port: {p}}}\nadmission: {mode}\n"
                    f"predictive: {{ttft_budget_s: {a.ttft_budget_s * a.time_scale}{tpot}}}\n"
                    "serving: {http_retention_limit: 8192, request_timeout_s: 3600}\n"
                    "queue: {size: 4096, wait_s: 600}\n"
                    "phases: {prefill_concurrency: 64, decode_concurrency: 512}\n"
                    f"engines:\n{lines}\n"
                )
                cmds.append([str(BIN / "narwhal"), "serve", "--config", str(cfg)])
            out.append(
                Door(
                    name, cmds[0], "/ready", port, env, list(zip(cmds[1:], ports[1:], strict=True))
                )
            )
        elif models(a):
            raise SystemExit(f"{name}: --models is for Narwhal's doors (placement by model)")
        elif (name.startswith("sglang-") and a.sglang) or (name.startswith("vllm-") and a.vllm):
            exe = [a.sglang, "launch"] if name.startswith("sglang-") else [a.vllm]
            cmd = peer_command(name, exe, port, engines, a.ttft_budget_s * a.time_scale)
            out.append(Door(name, cmd, "/health", port))
    return out


def peer_command(
    name: str, exe: list[str], port: int, engines: list[str], budget_s: float
) -> list[str]:
    """A Rust router as its operators run it: `PEER-POLICY@CAP` with its own admission (at
    most CAP requests at once, CAP more queued, a queued one refused after the TTFT budget),
    or `PEER-POLICY@defaults` with nothing set. Both routers take the same flags
    (sglang-router's under `launch`), each its own metrics port (both default to 29000)."""
    door, at, cap = name.partition("@")
    if not at or not (cap == "defaults" or cap.isdigit()):
        raise SystemExit(
            f"door {name!r}: say how the peer is run: {door}@CAP (its admission: "
            f"--max-concurrent-requests CAP, a queue of CAP, the budget as its timeout) "
            f"or {door}@defaults"
        )
    cmd = [*exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines]
    cmd += ["--policy", door.split("-", 1)[1], "--prometheus-port", str(free_port())]
    if cap != "defaults":
        cmd += ["--max-concurrent-requests", cap, "--queue-size", cap]
        cmd += ["--queue-timeout-secs", str(max(1, math.ceil(budget_s)))]
    return cmd


def client_of(a: argparse.Namespace) -> Client:
    if a.protocol == "exact":
        return EXACT
    return Client(True, a.max_tokens, a.patience * a.ttft_budget_s)


def duration_s(trace: list[Request], load: float) -> float:
    """The trace's own span at `load` (unscaled): goodput's divisor, the same for every
    door."""
    return (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000 / load


def run_door(
    door: Door,
    engines: list[str],
    trace: list[Request],
    load: float,
    a: argparse.Namespace,
    run: int = 1,
) -> Result:
    asyncio.run(reset(engines))
    res = Result(door.name, load, run=run)
    procs: list[subprocess.Popen[bytes]] = []
    urls = engines
    try:
        if door.cmd is not None:
            urls = []
            for k, (cmd, port) in enumerate([(door.cmd, door.port), *door.replicas]):
                name = door.name if k == 0 else f"{door.name}.{k}"
                # One log a cell, kept (beside the dump where there is one): the access
                # lines say what each request was projected and measured (`projected_ms`,
                # `own_ms`, `due_ms`, `tokens_sized` beside `ttfb_ms`, `tokens_in`); the
                # dump has the client's side.
                procs.append(launch(cmd, door.env, cell_log(a.dump, name, load, run)))
                urls.append(f"http://127.0.0.1:{port}")
                wait_http(urls[-1] + door.health, procs[-1], 60)
            for url in urls:
                asyncio.run(warm(url, a.warmup, a.time_scale, bool(a.classes), models(a) or None))
        asyncio.run(reset_counters_only(engines))
        cpu0 = sum(tree_cpu(p.pid) for p in procs)
        res.outcomes, res.span_s = asyncio.run(
            offer(
                urls,
                trace,
                load,
                a.time_scale,
                classes(a) or None,
                a.only,
                client_of(a),
                models(a) or None,
            )
        )
        res.cpu_s = sum(tree_cpu(p.pid) for p in procs) - cpu0
        if a.dump is not None and door.health == "/ready":
            # What each router had learned by the run's end (profiles, speeds, the fleet's
            # fit, margins, the ledger), beside its access lines.
            for k, url in enumerate(urls):
                name = door.name if k == 0 else f"{door.name}.{k}"
                where = cell_log(a.dump, name, load, run).with_suffix(".ready.json")
                asyncio.run(snapshot(url + "/ready", where))
        stats = asyncio.run(engine_stats(engines, a.time_scale))
        res.prompt_tokens, res.cached_tokens, res.preemptions, res.sim_lag = stats[:4]
        res.placed_twice, res.seen_by_id = stats[4:]
    finally:
        stop(procs)
    return res


def launch(cmd: list[str], env: dict[str, str] | None, log: Path | None) -> subprocess.Popen[bytes]:
    """A door's process, in a session of its own (stopped with its children), its stderr
    to `log` (None: nowhere)."""
    err = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=err
    )


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Every process asked to end, then waited for (killed after 20 s)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cell_log(dump: Path | None, door: str, load: float, run: int) -> Path:
    """Where a door's stderr goes for one cell: beside the dump, or in the temp folder."""
    folder = dump if dump is not None else Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "" if dump is not None else "fleet-"
    return folder / f"{prefix}{door}-{load:g}x-r{run}.log"


async def reset_counters_only(engines: list[str]) -> None:
    """After the warm-up: the counters start at zero, the caches keep what warm-up left
    (unique prompts, which no trace request shares)."""
    async with aiohttp.ClientSession() as s:
        for u in engines:
            async with s.post(u + "/sim/reset?counters=1") as r:
                await r.read()


def dump(folder: Path, res: Result, trace: list[Request]) -> None:
    """Per request, what was offered and what came of it (for looking into the misses)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        orjson.dumps(
            {
                "i": i,
                "at_ms": r.timestamp_ms,
                "input": r.input_length,
                "output": r.output_length,
                "session": r.session,
                "status": o.status,
                "code": o.code,
                "ttft_s": o.ttft_s,
                "tpot_s": o.tpot_s,
                "cached": o.cached,
                "failed": o.failed,
                "klass": o.klass,
                "model": o.model,
            }
        )
        for i, (r, o) in enumerate(zip(trace, res.outcomes, strict=True))
    ]
    (folder / f"{res.door}-{res.load:g}x.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def spread(rows: list[dict[str, Any]]) -> str:
    """Per load and door over the runs: misses and goodput as median [min-max]."""
    out = [
        "| load | door | runs | misses (of offered) | goodput/s | goodput tokens/s | "
        "served within SLO | TTFT p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["load"], r["door"]), []).append(r)
    for (load, door), rs in cells.items():

        def fig(key: str, pct: bool = False, rs: list[dict[str, Any]] = rs) -> str:
            xs = sorted(float(r[key] or 0.0) * (100 if pct else 1) for r in rs)
            mid = xs[len(xs) // 2]
            unit = " %" if pct else ""
            if len(xs) == 1:
                return f"{mid:.1f}{unit}"
            return f"{mid:.1f}{unit} [{xs[0]:.1f}-{xs[-1]:.1f}]"

        out.append(
            f"| {load:g}x | {door} | {len(rs)} | {fig('misses', True)} | "
            f"{fig('goodput_per_s')} | {fig('goodput_tokens_per_s')} | "
            f"{fig('served_within_slo', True)} | {fig('ttft_p99_s')} |"
        )
    return "\n".join(out)


def twice(rows: list[dict[str, Any]]) -> str:
    """Per door, the requests the engines admitted more than once, over every cell."""
    per: dict[str, tuple[int, int]] = {}
    for r in rows:
        n, seen = per.get(r["door"], (0, 0))
        per[r["door"]] = (n + r.get("placed_twice", 0), seen + r.get("seen_by_id", 0))
    return "placed twice (by request ID, over every cell): " + ", ".join(
        f"{door} {n} of {seen} seen by ID" for door, (n, seen) in per.items()
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| load | door | served | refused | failed / abandoned | within SLO (of offered) "
        "| served within SLO "
        "| goodput/s | TTFT p50 | TTFT p99 | TPOT p99 | missed TTFT / TPOT | prefix hit "
        "| door CPU ms/req |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    out = [head]
    for r in rows:
        o = r["offered"]
        out.append(
            f"| {r['load']:g}x | {r['door']} | {100 * r['served'] / o:.1f} % | "
            f"{100 * r['refused'] / o:.1f} % | {r['failed']} / {r.get('abandoned', 0)} | "
            f"{100 * r['slo_attainment']:.1f} % | "
            f"{100 * r['served_within_slo']:.1f} % | {r['goodput_per_s']:.2f} | "
            f"{_s(r['ttft_p50_s'])} | {_s(r['ttft_p99_s'])} | {r['tpot_p99_ms']:.0f} ms | "
            f"{r['missed_ttft']} / {r['missed_tpot']} | {100 * r['prefix_hit']:.0f} % | "
            f"{r['cpu_ms_per_request']:.2f} |"
        )
    return "\n".join(out)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for door in dict.fromkeys(r["door"] for r in rows):
        pts = sorted((r["load"], r) for r in rows if r["door"] == door)
        xs = [p[0] for p in pts]
        ax1.plot(xs, [100 * p[1]["slo_attainment"] for p in pts], marker="o", label=door)
        ax2.plot(xs, [p[1]["goodput_per_s"] for p in pts], marker="o", label=door)
    ax1.set(xlabel="load (x fleet capacity)", ylabel="within SLO, % of offered", xscale="log")
    ax2.set(xlabel="load (x fleet capacity)", ylabel="goodput (SLO-met requests/s)", xscale="log")
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PRIORITIES = ("critical", "standard", "sheddable")


def _priority(tenant: str) -> str:
    return tenant if tenant in PRIORITIES else "standard"


def models(a: argparse.Namespace) -> list[Served]:
    """`--models chat:0.7:0-5,coder:0.3:4-7`: each model's share of the requests and the
    engines (by index, inclusive) that serve it; engines in two ranges serve both."""
    out = []
    for part in (getattr(a, "models", None) or "").split(","):
        if part:
            name, share, span = part.split(":")
            lo, _, hi = span.partition("-")
            out.append(Served(name, float(share), range(int(lo), int(hi or lo) + 1)))
    return out


def engine_models(i: int, a: argparse.Namespace) -> str:
    """Engine `i`'s `models` in Narwhal's config, where `--models` says."""
    served = [m.name for m in models(a) if i in m.engines]
    return f", models: [{', '.join(served)}]" if served else ""


def classes(a: argparse.Namespace) -> list[tuple[str, float]]:
    """`--classes critical:0.2,standard:0.5,sheddable:0.3` as (class, share) pairs."""
    out = []
    for part in (a.classes or "").split(","):
        if part:
            name, _, share = part.partition(":")
            out.append((name, float(share)))
    return out


def share_table(rows: list[dict[str, Any]], by: str, what: str) -> str:
    """Each row's figures per class or model (`by`: "by_class" or "by_model")."""
    out = [
        f"| load | door | run | {what} | offered | refused | within SLO (of the {what}'s "
        "offered) | served tokens |"
    ]
    out.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for k, c in r.get(by, {}).items():
            o = c["offered"] or 1
            out.append(
                f"| {r['load']:g}x | {r['door']} | {r['run']} | {k} | {c['offered']} | "
                f"{100 * c['refused'] / o:.1f} % | {100 * c['within_slo'] / o:.1f} % | "
                f"{c['served_tokens']:,} |"
            )
    return "\n".join(out)


def start_fleet(a: argparse.Namespace) -> tuple[subprocess.Popen[bytes], list[str]]:
    """The simulated engines on N consecutive ports; another run of ports when one of them
    was taken (the first free port says nothing of the N - 1 after it)."""
    for _ in range(5):
        base = free_port() + 1000
        sim = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.fleet.server", "--engines", str(a.engines)),
                *("--port", str(base), "--time-scale", str(a.time_scale), *a.sim_args.split()),
            ],
            cwd=ROOT,
            start_new_session=True,
        )
        engines = [f"http://127.0.0.1:{base + i}" for i in range(a.engines)]
        try:
            for u in engines:
                wait_http(u + "/health", sim, 30)
        except RuntimeError:  # it exited: a port was taken
            continue
        return sim, engines
    raise RuntimeError("no run of free ports for the simulated engines")


def start_etcd() -> tuple[subprocess.Popen[bytes], str]:
    """An etcd of its own on loopback, for doors of several active routers."""
    exe = shutil.which("etcd")
    if exe is None:
        raise SystemExit("@activeN doors need etcd (make setup installs etcd-server)")
    port, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            *(exe, "--data-dir", tempfile.mkdtemp(prefix="bench-etcd-")),
            *("--listen-client-urls", url, "--advertise-client-urls", url),
            *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
            *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_http(url + "/health", proc, 30)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=0, help="the trace's first N (0: all)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--loads", default="0.5,1,2,4")
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--ttft-budget-s", type=float, default=5.0)
    ap.add_argument("--tpot-target-ms", type=float, default=100.0)
    ap.add_argument("--tpot", action="store_true", help="give Narwhal the TPOT target too")
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument(
        "--doors",
        default="direct,narwhal-predictive,sglang-cache_aware@defaults,sglang-cache_aware@64,"
        "vllm-cache_aware@64",
    )
    ap.add_argument("--protocol", choices=("fair", "exact"), default="fair")
    ap.add_argument("--max-tokens", type=int, default=2048, help="fair: what clients ask for")
    ap.add_argument(
        "--patience",
        type=float,
        default=2.0,
        help="fair: a client leaves a request with no first token after this many TTFT budgets",
    )
    ap.add_argument("--runs", type=int, default=1, help="every cell this many times")
    ap.add_argument("--sglang")
    ap.add_argument("--vllm")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--sim-args", default="", help="extra flags for bench.fleet.server")
    ap.add_argument(
        "--predictive-extra",
        default="",
        help="more of Narwhal's `predictive:` settings, e.g. 'critical_reserve: 0'",
    )
    ap.add_argument(
        "--classes",
        help="tenants and their shares of the requests, e.g. "
        "critical:0.2,standard:0.5,sheddable:0.3 (a tenant of each priority class) or "
        "heavy:0.91,light:0.09 (standard tenants): Narwhal gets a key for each (key-NAME), "
        "each request carries its tenant's key, and the figures are given by tenant too",
    )
    ap.add_argument(
        "--only",
        help="with --classes, send that class's requests alone, at the times they have in "
        "the mix (what the class gets with the fleet to itself)",
    )
    ap.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of an older commit (its Rust extension built or copied in): a door "
        "named narwhal-MODE@base runs Narwhal from it, beside the current tree's, in the same "
        "run and with the same clients (an A/B of a router change)",
    )
    ap.add_argument(
        "--dump",
        type=Path,
        help="a folder: one JSONL per door and load, a line a request, and each door's log "
        "a cell (a router's access lines; a Narwhal router's /ready at the cell's end beside "
        "it, .ready.json)",
    )
    ap.add_argument(
        "--models",
        help="several models on one fleet, Narwhal's doors only: NAME:SHARE:FIRST-LAST engine "
        "indexes serving it, e.g. chat:0.7:0-5,coder:0.3:4-7 (engines 4 and 5 serve both)",
    )
    a = ap.parse_args()
    trace = read(a.trace)
    if a.requests:
        trace = trace[: a.requests]
    sim, engines = start_fleet(a)
    etcd = start_etcd() if re.search(r"@(base-)?active", a.doors) else None
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run, load in [
                (k, float(x)) for k in range(1, a.runs + 1) for x in a.loads.split(",")
            ]:
                for door in doors(a, engines, Path(tmp), etcd[1] if etcd else None):
                    res = run_door(door, engines, trace, load, a, run)
                    row = res.summary(
                        a.ttft_budget_s, a.tpot_target_ms / 1000, duration_s(trace, load)
                    )
                    rows.append(row)
                    if a.dump:
                        sent = [
                            r
                            for i, r in enumerate(trace)
                            if a.only is None or klass_of(i, classes(a)) == a.only
                        ]
                        dump(a.dump, res, sent)
                    print(table([row]).splitlines()[-1], flush=True)
    finally:
        os.killpg(sim.pid, signal.SIGTERM)
        sim.wait()
        if etcd is not None:
            os.killpg(etcd[0].pid, signal.SIGTERM)
            etcd[0].wait()
    title = (
        f"{a.trace.name}: {len(trace)} requests, {a.engines} engines, TTFT budget "
        f"{a.ttft_budget_s:g} s, TPOT target {a.tpot_target_ms:g} ms"
    )
    title += f", {a.protocol} protocol"
    print(title)
    print(table(rows))
    print(spread(rows))
    print(twice(rows))
    if a.classes:
        print(share_table(rows, "by_class", "class"))
    if a.models:
        print(share_table(rows, "by_model", "model"))
    if a.json:
        a.json.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    if a.plot:
        plot(rows, a.plot, title)


if __name__ == "__main__":
    main()
