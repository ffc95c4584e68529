"""Continuous batching: aggregate output tokens/s and time per output token at 1, 2, 4 and 8
concurrent streams, LexiEngine `--parallel 8` vs `--parallel 1` vs llama-cpp-python's own
server (and llama.cpp's own llama-server when given), same model, same prompts, same run.
All servers are started first and the waves interleaved, so each comparison is made within
seconds of the machine's state; each figure is the median over `--rounds`.

    .venv/bin/python -m bench.engine_batching [--tokens 96] [--threads N] [--model GGUF]
                                              [--plot bench/engine_batching.png]
                                              [--llama-server PATH]

Each stream is a streaming text completion of a distinct prompt at temperature 0; a token is
one streamed chunk with text (both servers send one token a chunk). Per stream: TPOT = time
from its first to its last token / (tokens - 1). Aggregate = all tokens / wall time of the
whole wave.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass

import aiohttp
import orjson

from narwhal.bundled_model import smollm2_path
from tests.support import Server, free_port, start_engine

LEVELS = (1, 2, 4, 8)
TOPICS = (
    "a lighthouse keeper",
    "a mountain village",
    "a clockmaker",
    "a river pilot",
    "a desert caravan",
    "a lost violin",
    "a city garden",
    "a night train",
)


@dataclass
class Stream:
    start: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.tokens - 1)


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, n: int) -> Stream:
    s = Stream(time.perf_counter())
    body = {
        "prompt": f"Write a long story about {TOPICS[i % len(TOPICS)]}.\n\n",
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
    }
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            choices = orjson.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                now = time.perf_counter()
                s.first = s.first or now
                s.last = now
                s.tokens += 1
    return s


async def _wave(url: str, concurrency: int, n: int) -> tuple[float, list[Stream]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(
            *(one_stream(session, url, i, n) for i in range(concurrency))
        )
    return t0, list(streams)


def wave(url: str, concurrency: int, n: int) -> dict[str, float]:
    """One wave of `concurrency` streams from one event loop (a light client: it shares
    the 2 cores with the server under test)."""
    t0, streams = asyncio.run(_wave(url, concurrency, n))
    wall = max(s.last or t0 for s in streams) - t0
    tpots = sorted(x for s in streams if (x := s.tpot) is not None)
    return {
        "agg": sum(s.tokens for s in streams) / wall,
        "p50": statistics.median(tpots),
        "p99": tpots[min(len(tpots) - 1, round(0.99 * (len(tpots) - 1)))],
        "worst": tpots[-1],
    }


def in_process(model: str, threads: int, rounds: int = 3) -> dict[int, tuple[float, float]]:
    """The decode loop without HTTP: tokens/s and the share of wall time inside llama_decode
    (what llama.cpp itself costs), at each level."""
    import llama_cpp

    from narwhal.engine.batch import DecodeLoop
    from narwhal.engine.config import EngineConfig
    from narwhal.engine.generation import Finish, Request, Sampling
    from narwhal.engine.model import Model

    m = Model(EngineConfig(model=model, parallel=8, ctx_size=8192, threads=threads))
    loop = DecodeLoop(m, 8, 256, threads)
    inner = llama_cpp.llama_decode
    spent = [0.0]

    def timed(ctx: object, batch: object) -> int:
        t = time.perf_counter()
        try:
            return int(inner(ctx, batch))
        finally:
            spent[0] += time.perf_counter() - t

    llama_cpp.llama_decode = timed
    out: dict[int, tuple[float, float]] = {}

    async def level(c: int) -> None:
        reqs = [
            Request(
                m.tokenize(f"Write a long story about {TOPICS[i]}.\n\n"), Sampling(0, 1, 0, 0, 96)
            )
            for i in range(c)
        ]
        spent[0] = 0.0
        t = time.perf_counter()
        for i, r in enumerate(reqs):
            loop.submit(i, r)
        tokens = 0
        for r in reqs:
            while not isinstance(item := await r.queue.get(), Finish):
                pass
            tokens += item.completion_tokens
        wall = time.perf_counter() - t
        out[c] = (tokens / wall, spent[0] / wall)

    got: dict[int, list[tuple[float, float]]] = {c: [] for c in LEVELS}
    try:
        for _ in range(rounds):  # interleaved, like the servers: drift hits all levels alike
            for c in LEVELS:
                asyncio.run(level(c))
                got[c].append(out[c])
    finally:
        llama_cpp.llama_decode = inner
        loop.stop()
    return {
        c: (statistics.median(r for r, _ in got[c]), statistics.median(f for _, f in got[c]))
        for c in LEVELS
    }


def decode_ceiling(
    model: str, threads: int, rounds: int = 5, block: int = 20
) -> dict[int, tuple[float, float, float]]:
    """Tokens/s of bare `llama_decode` steps of 1, 2, 4 and 8 tokens (one per sequence, all
    with logits), nothing else: what any batching engine over this build and model can reach.
    Its 8-token figure over its 1-token figure bounds the scaling at 8 streams. The sizes are
    interleaved in short blocks (same positions each time) so machine drift hits them alike;
    returns, per size, the median tok/s and the range of its per-round ratio to 1 token."""
    import llama_cpp as lc

    lc.llama_backend_init()
    from narwhal.engine import kernels

    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = kernels.for_this_build().repack  # LexiEngine's choice (AMX-safe)
    llm = lc.llama_model_load_from_file(model.encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, 8
    cp.kv_unified = False
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm, cp)
    batch = lc.llama_batch_init(512, 0, 8)

    def step(pos: int, n: int) -> None:
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = 100 + i, pos, 1
            batch.seq_id[i][0], batch.logits[i] = i, 1
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    rates: dict[int, list[float]] = {n: [] for n in LEVELS}
    try:
        for _ in range(rounds):
            for n in LEVELS:
                lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
                for pos in range(5):
                    step(pos, n)
                t = time.perf_counter()
                for pos in range(5, 5 + block):
                    step(pos, n)
                rates[n].append(n * block / (time.perf_counter() - t))
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(llm)
    out = {}
    for n in LEVELS:
        ratios = sorted(r / b for r, b in zip(rates[n], rates[1], strict=True))
        out[n] = (statistics.median(rates[n]), ratios[0], ratios[-1])
    return out


def llama_cpp_server(model: str, n_threads: str) -> Server:
    port = free_port()
    return Server(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            model,
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--n_threads",
            n_threads,
            "--n_threads_batch",
            n_threads,
            "--verbose",
            "false",
        ],
        "/v1/models",
        port,
        timeout=120,
    )


def llama_server(exe: str, model: str, n_threads: str) -> Server:
    """llama.cpp's own server (built from the llama.cpp that llama-cpp-python vendors), with
    the same slots and context as LexiEngine --parallel 8."""
    port = free_port()
    return Server(
        [
            exe,
            "-m",
            model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "-np",
            "8",
            "-c",
            "8192",
            "-t",
            n_threads,
            "-tb",
            n_threads,
        ],
        "/health",
        port,
        timeout=120,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--plot", default=None)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", help="GGUF model (default: the SmolLM2 test model)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary, measured too")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model = a.model or str(smollm2_path())
    n_threads = str(a.threads)  # the same for every server
    threads = ("--threads", n_threads)
    servers = {
        "LexiEngine --parallel 8": lambda: start_engine(
            model, "--parallel", "8", "--ctx-size", "8192", *threads
        ),
        "LexiEngine --parallel 1": lambda: start_engine(
            model, "--parallel", "1", "--queue-wait", "600", *threads
        ),
        "llama-cpp-python server": lambda: llama_cpp_server(model, n_threads),
    }
    if a.llama_server:
        exe = a.llama_server
        servers["llama.cpp llama-server -np 8"] = lambda: llama_server(exe, model, n_threads)
    # All servers up at once (an idle one costs nothing) and the waves interleaved: round
    # by round, level by level, server by server. The machine's speed drifts over minutes;
    # interleaving keeps every comparison within seconds, and each figure is a median.
    started: dict[str, Server] = {}
    rounds: dict[str, dict[int, list[dict[str, float]]]] = {}
    try:
        for name, start in servers.items():
            started[name] = start()
            wave(started[name].url, 1, 8)  # warm-up
            rounds[name] = {c: [] for c in LEVELS}
        for _ in range(a.rounds):
            for c in LEVELS:
                for name, s in started.items():
                    rounds[name][c].append(wave(s.url, c, a.tokens))
    finally:
        for s in started.values():
            s.stop()

    def med(name: str, c: int, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name][c])

    def scaling(name: str, c: int, base: str | None = None) -> list[float]:
        """Per round: aggregate at `c` streams over `base`'s (default: own) at one stream."""
        ref = rounds[base or name][c if base else 1]
        return sorted(r["agg"] / b["agg"] for r, b in zip(rounds[name][c], ref, strict=True))

    print(f"{a.rounds} rounds; medians, and the range of the per-round scaling\n")
    print(
        "| server | streams | aggregate tok/s | scaling vs 1 stream (range) | p50 TPOT ms "
        "| p99 TPOT ms | worst stream TPOT / 1-stream TPOT |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in rounds:
        for c in LEVELS:
            sc = scaling(name, c)
            worst = statistics.median(
                r["worst"] / b["p50"] for r, b in zip(rounds[name][c], rounds[name][1], strict=True)
            )
            print(
                f"| {name} | {c} | {med(name, c, 'agg'):.1f} "
                f"| {statistics.median(sc):.2f}x ({sc[0]:.2f}-{sc[-1]:.2f}) "
                f"| {med(name, c, 'p50') * 1e3:.1f} | {med(name, c, 'p99') * 1e3:.1f} "
                f"| {worst:.2f}x |"
            )
    print(
        "\n| decode loop in process (no HTTP) | streams | tok/s | scaling | time in "
        "llama_decode |\n|---|---|---|---|---|"
    )
    ip = in_process(model, a.threads, a.rounds)
    for c in LEVELS:
        print(
            f"| DecodeLoop, 8 slots | {c} | {ip[c][0]:.1f} | {ip[c][0] / ip[1][0]:.2f}x "
            f"| {ip[c][1]:.0%} |"
        )
    print(
        "\n| bare llama_decode (the ceiling) | tokens per step | tok/s (median) "
        "| scaling (range over rounds) |\n|---|---|---|---|"
    )
    ceil = decode_ceiling(model, a.threads)
    for c in LEVELS:
        rate, lo, hi = ceil[c]
        print(
            f"| {os.path.basename(model)} | {c} | {rate:.1f} | {rate / ceil[1][0]:.2f}x "
            f"({lo:.2f}-{hi:.2f}) |"
        )
    vs = scaling("LexiEngine --parallel 8", 8, "LexiEngine --parallel 1")
    print(
        f"\nat 8 streams: --parallel 8 / --parallel 1 aggregate = {statistics.median(vs):.2f}x "
        f"({vs[0]:.2f}-{vs[-1]:.2f} over rounds)"
    )
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in rounds:
            ax.plot(LEVELS, [med(name, c, "agg") for c in LEVELS], marker="o", label=name)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate output tokens/s")
        ax.set_xticks(LEVELS)
        ax.set_title(f"{os.path.basename(model)}, {a.threads} threads")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)


if __name__ == "__main__":
    main()
