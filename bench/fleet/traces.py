"""Synthetic request traces in Mooncake's public JSONL format, and prompts built from them.

    .venv/bin/python -m bench.fleet.traces --shape production --requests 1000 --engines 8 \\
        --out bench/fleet/traces/production-8.jsonl

Each line: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per
512-token block of the prompt; equal leading ids are a shared prefix), and, ours, an optional
`session` (a conversation's routing key). Four shapes, ours, with the structure public
traces show (Mooncake's, Azure's LLM inference traces, ShareGPT-style conversations):

- `production`: families of shared system prompts of several lengths (Zipf popularity),
  each request a family's prompt plus a long-tailed unique part; a quarter of the requests
  continue a conversation; long-tailed outputs; Poisson arrivals with bursts.
- `chat`: multi-turn sessions that extend their own history (each turn = the last turn's
  prompt + its answer + a new question), over a few shared system prompts.
- `longtail` (added for the fair protocol, never tuned on): short prompts and long,
  heavy-tailed answers (lognormal, median 300 tokens, sigma 1.1, up to 3,000).
- `mixed` (the same): RAG questions (long unique contexts, short answers), agent loops
  (sessions growing by tool results over a shared tools prompt, short steps) and chats with
  long answers, arriving on and off (bursts at 2.5x the mean rate, lulls at a third).

Arrivals are paced so that 1x is the fleet's capacity: the rate at which `--engines`
simulated engines (bench/fleet/gpu.py's cost model) would be busy all the time if each
served every prefix it had seen from its cache (a lower bound on the work, so 1x is
already a little over what any placement achieves).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.fleet.gpu import GpuModel

BLOCK = 512
# Decode cost per output token at a typical running batch (its share of a step).
TYPICAL_BATCH = 32


@dataclass
class Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str | None = None

    def line(self) -> bytes:
        d: dict[str, Any] = {
            "timestamp": round(self.timestamp_ms),
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        }
        if self.session is not None:
            d["session"] = self.session
        return orjson.dumps(d)


def read(path: Path) -> list[Request]:
    out = []
    for raw in path.read_bytes().splitlines():
        if raw.strip():
            d = orjson.loads(raw)
            out.append(
                Request(
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    [int(h) for h in d["hash_ids"]],
                    d.get("session"),
                )
            )
    return out


def prompt_text(r: Request) -> str:
    """The prompt: each block id becomes 512 words that only that id makes (a partial last
    block the first words of it), so equal ids are equal text, word for word. Every word
    has the same width, as a tokenizer's tokens have about the same bytes on one kind of
    text: a door that sizes prompts by their bytes sizes them all alike."""
    words = []
    left = r.input_length
    for h in r.hash_ids:
        n = min(BLOCK, left)
        words.append(" ".join(f"{h:08x}{j:03x}" for j in range(n)))
        left -= n
        if left <= 0:
            break
    return " ".join(words)


class _Ids:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def _blocks(tokens: int) -> int:
    return max(1, math.ceil(tokens / BLOCK))


def production(n: int, rng: random.Random) -> Iterator[tuple[list[int], int, int, str | None]]:
    """(hash_ids, input_length, output_length, session) in arrival order."""
    ids = _Ids()
    families = []
    for _ in range(24):
        length = rng.choice([1, 2, 4, 6, 8, 12]) * BLOCK
        families.append(ids.take(_blocks(length)))
    weights = [1 / (k + 1) ** 1.1 for k in range(len(families))]
    live: list[tuple[str, list[int], int]] = []  # open conversations: key, ids, tokens
    sessions = 0
    for _ in range(n):
        out_len = _lognormal(rng, 180, 0.9, 8, 2000)
        if live and rng.random() < 0.25:
            i = rng.randrange(len(live))
            key, hist, tokens = live[i]
            add = _lognormal(rng, 700, 0.8, 64, 8000)
            ext = ids.take(_blocks(add + 300))
            hist = hist + ext
            tokens = len(hist) * BLOCK - rng.randrange(BLOCK)
            if tokens > 60_000 or rng.random() < 0.2:
                live.pop(i)
            else:
                live[i] = (key, hist, tokens)
            yield hist, tokens, out_len, key
            continue
        fam = rng.choices(families, weights)[0]
        unique = _lognormal(rng, 3000, 1.0, 32, 40_000)
        hist = fam + ids.take(_blocks(unique))
        tokens = len(fam) * BLOCK + unique
        key = None
        if rng.random() < 0.3:
            sessions += 1
            key = f"s{sessions}"
            live.append((key, hist, tokens))
            if len(live) > 64:
                live.pop(0)
        yield hist, tokens, out_len, key


def chat(n: int, rng: random.Random) -> Iterator[tuple[list[int], int, int, str | None]]:
    ids = _Ids()
    systems = [ids.take(rng.choice([2, 4, 6])) for _ in range(4)]
    live: list[tuple[str, list[int], int]] = []
    sessions = 0
    for _ in range(n):
        out_len = _lognormal(rng, 250, 0.7, 16, 1500)
        if live and (rng.random() < 0.8 or len(live) >= 96):
            i = rng.randrange(len(live))
            key, hist, tokens = live[i]
            add = _lognormal(rng, 300, 0.8, 16, 4000) + out_len
            hist = hist + ids.take(_blocks(add))
            tokens = len(hist) * BLOCK - rng.randrange(BLOCK)
            if tokens > 60_000 or rng.random() < 0.1:
                live.pop(i)
            else:
                live[i] = (key, hist, tokens)
            yield hist, tokens, out_len, key
            continue
        sessions += 1
        key = f"c{sessions}"
        system = rng.choice(systems)
        first = _lognormal(rng, 1500, 1.0, 32, 20_000)
        hist = system + ids.take(_blocks(first))
        tokens = len(system) * BLOCK + first
        live.append((key, hist, tokens))
        yield hist, tokens, out_len, key


def longtail(n: int, rng: random.Random) -> Iterator[tuple[list[int], int, int, str | None]]:
    """Short prompts, long heavy-tailed answers (assistants asked to write: stories, code,
    reports): one shared system prompt of a block, a short unique question, and an answer
    whose length spans two orders of magnitude."""
    ids = _Ids()
    system = ids.take(1)
    for _ in range(n):
        question = _lognormal(rng, 150, 0.8, 8, 3000)
        out_len = _lognormal(rng, 300, 1.1, 4, 3000)
        yield system + ids.take(_blocks(question)), BLOCK + question, out_len, None


def mixed(n: int, rng: random.Random) -> Iterator[tuple[list[int], int, int, str | None]]:
    """A product's mix: retrieval-augmented questions (a long unique context of retrieved
    documents, a short answer), agent loops (a session that grows by tool results, a short
    step each), and chats with long answers; arrivals come on and off (`ONOFF`)."""
    ids = _Ids()
    tools = ids.take(4)  # the agents' shared tool-definitions prompt
    chat_system = ids.take(2)
    agents: list[tuple[str, list[int], int]] = []
    started = 0
    for _ in range(n):
        kind = rng.random()
        if kind < 0.35:  # RAG
            docs = _lognormal(rng, 6000, 0.6, 1000, 30_000)
            yield ids.take(_blocks(docs)), docs, _lognormal(rng, 120, 0.7, 8, 1000), None
        elif kind < 0.75:  # an agent's next step, or a new agent
            if agents and rng.random() < 0.85:
                i = rng.randrange(len(agents))
                key, hist, tokens = agents[i]
                hist = hist + ids.take(_blocks(_lognormal(rng, 800, 0.9, 50, 8000)))
                tokens = len(hist) * BLOCK - rng.randrange(BLOCK)
                if tokens > 50_000 or rng.random() < 0.08:
                    agents.pop(i)
                else:
                    agents[i] = (key, hist, tokens)
            else:
                started += 1
                key = f"a{started}"
                hist = tools + ids.take(_blocks(_lognormal(rng, 400, 0.8, 16, 4000)))
                tokens = len(hist) * BLOCK - rng.randrange(BLOCK)
                agents.append((key, hist, tokens))
                if len(agents) > 48:
                    agents.pop(0)
            yield hist, tokens, _lognormal(rng, 60, 0.8, 4, 600), key
        else:  # a chat turn with a long answer
            q = _lognormal(rng, 300, 1.0, 16, 6000)
            hist = chat_system + ids.take(_blocks(q))
            yield hist, 2 * BLOCK + q, _lognormal(rng, 700, 0.8, 32, 6000), None


SHAPES = {"production": production, "chat": chat, "longtail": longtail, "mixed": mixed}
# Shapes whose arrivals come on and off (bursts of a few seconds at 2.5x the mean rate,
# lulls at a third of it) rather than Poisson with rare bursts.
ONOFF = {"mixed"}


def engine_seconds(reqs: list[tuple[list[int], int, int, str | None]], model: GpuModel) -> float:
    """The work a request set makes for one engine that kept every prefix it ever saw."""
    seen: set[int] = set()
    total = 0.0
    per_token = model.step_per_seq_s + model.step_base_s / TYPICAL_BATCH
    for hist, tokens, out_len, _ in reqs:
        hit = 0
        for h in hist:
            if h in seen:
                hit += 1
            else:
                break
        seen.update(hist)
        cached = min(hit * BLOCK, tokens - 1)
        total += (tokens - cached) / model.prefill_tps + out_len * per_token
    return total


def generate(shape: str, n: int, engines: int, seed: int, model: GpuModel) -> list[Request]:
    rng = random.Random(seed)
    reqs = list(SHAPES[shape](n, rng))
    rate = engines * len(reqs) / engine_seconds(reqs, model)  # requests/s at 1x
    out = []
    t = 0.0
    burst_until = -1.0
    on, switch_at = True, rng.expovariate(1 / 8)
    for hist, tokens, out_len, key in reqs:
        if shape in ONOFF:
            t += rng.expovariate(rate * (2.5 if on else 0.33))
            while t >= switch_at:
                on = not on
                switch_at += rng.expovariate(1 / (8 if on else 12))
        else:
            if rng.random() < 0.01:  # a burst: a few seconds at three times the rate
                burst_until = t + rng.uniform(2, 6)
            r = rate * (3 if t < burst_until else 1)
            t += rng.expovariate(r) * (1 if t < burst_until else 1.5)
        out.append(Request(t * 1000, tokens, out_len, hist, key))
    # Rescale so the mean rate is exactly `rate` (bursts and pauses keep their shape).
    span = out[-1].timestamp_ms / 1000
    k = (len(out) / rate) / span
    for r in out:
        r.timestamp_ms *= k
    return out


def describe(reqs: list[Request]) -> dict[str, float]:
    seen: set[int] = set()
    shared = 0
    for r in reqs:
        for h in r.hash_ids:
            if h in seen:
                shared += 1
            else:
                break
        seen.update(r.hash_ids)
    tokens = sum(r.input_length for r in reqs)
    return {
        "requests": len(reqs),
        "mean_input": tokens / len(reqs),
        "mean_output": sum(r.output_length for r in reqs) / len(reqs),
        "shared_fraction": min(1.0, shared * BLOCK / tokens),
        "rate_per_s": len(reqs) / (reqs[-1].timestamp_ms / 1000),
        "sessions": len({r.session for r in reqs if r.session}),
    }


def main() -> None:
    from bench.fleet.server import add_model_flags, model_from

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="production")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    add_model_flags(ap)
    a = ap.parse_args()
    reqs = generate(a.shape, a.requests, a.engines, a.seed, model_from(a))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_bytes(b"\n".join(r.line() for r in reqs) + b"\n")
    print(orjson.dumps(describe(reqs)).decode())


if __name__ == "__main__":
    main()
