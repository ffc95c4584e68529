"""What cache-aware placement costs per request, as the pool grows, and what its picture
of the fleet's caches weighs.

    .venv/bin/python -m bench.fleet.placement_cost [--engines 8,32] [--prompt-words 8000]

Per pool size: the predictive policy's `judge` (hash the prompt's text blocks, ask every
engine's picture, project TTFT on each, pick), with a TPOT target and 32 streams in every
engine's ledger, then without, for prompts of `--prompt-words` words that
share a system prompt with earlier ones, every engine's picture filled to capacity; then
the same judge with the picture off (`prefix_cache.tokens_per_engine: 0`), in the same run.
Then what learning from a finished request costs: one prefill sample into its engine's fit,
the fleet's pool and the engine's speed against the pool (`Predictor._pooled`).
Memory: one PrefixMap of 32 engines x 100,000 blocks, filled, as the Rust side counts its
heap and as the process's resident size grows.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import orjson

from narwhal._native import PrefixMap, PromptBlocks
from narwhal.router.config import EngineSpec
from narwhal.router.engines import Engine
from narwhal.router.pipeline import intake
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.predict import Predictor
from narwhal.router.request import CHAT, Request


def _request(i: int, words: int) -> Request:
    system = " ".join(f"s{j % 97}x{j}" for j in range(words // 2))
    tail = " ".join(f"q{i}w{j}" for j in range(words // 2))
    body = {"model": "m", "messages": [{"role": "user", "content": system + " " + tail}]}
    return intake.check(CHAT, orjson.dumps(body), "m")


class _Counted:
    """A stream's token count, as the relay keeps it."""

    def __init__(self, counted: int) -> None:
        self.counted = counted


def judge_us(
    engines: int, words: int, cache_on: bool, tpot: bool = False, rounds: int = 400
) -> float:
    pool = [Engine(EngineSpec(f"e{i}"), f"http://e{i}", healthy=True) for i in range(engines)]
    predictor = Predictor(pool)
    for p in predictor.profiles.values():
        p.prefill_tps, p.bytes_per_token = 10_000.0, 4.0
    cache = PrefixCache(pool, 400_000, 512) if cache_on else None
    policy = PredictivePolicy(predictor, pool, cache, 0.1 if tpot else None)
    if tpot:  # 32 streams on every engine, each in the ledger, decoding, tokens counted
        for streams in policy.streams.values():
            for k in range(32):
                streams.charge(0.01)
                entry = streams.joined(0.09, 0.01, 26 + k)
                streams.decoding(entry, time.monotonic(), _Counted(1 + k))
    reqs = [_request(i, words) for i in range(64)]
    if cache is not None:  # every engine's picture full of other prompts, and this family
        for e in pool:
            for k in range(cache.map.blocks(0), 3200, 100):
                cache.placed(e.name, cache.blocks(f"{e.name}-{k}".encode() * 4000))
        cache.placed(pool[-1].name, cache.blocks(reqs[0].prefix_text()))
    times = []
    for r in range(rounds):
        req = reqs[r % len(reqs)]
        charged = {name: s.charged_s for name, s in policy.streams.items()}
        t = time.perf_counter_ns()
        plan = policy.judge(req, pool, 5.0)
        times.append(time.perf_counter_ns() - t)
        # A judged prompt is charged to its engine's ledger: taken back, so that every
        # round judges the same fleet (400 rounds would otherwise spend every allowance).
        plan.settle()
        for name, s in policy.streams.items():
            s.charged_s = charged[name]
    return statistics.median(times) / 1000


def sample_us(engines: int, rounds: int = 4000) -> float:
    """What a finished prompt's prefill sample costs the router to learn: its engine's fit,
    the fleet's pool and the engine's speed against it (`Predictor._pooled`), every engine
    having measured (three kinds of device, samples with 10 % noise)."""
    pool = [Engine(EngineSpec(f"e{i}"), f"http://e{i}", healthy=True) for i in range(engines)]
    predictor = Predictor(pool)
    rng = random.Random(7)

    def sample(i: int) -> None:
        fresh = rng.choice((200, 1000, 4000, 12000))
        seconds = (0.02 + fresh / 20_000) * (1 + 0.1 * (i % 3)) * rng.lognormvariate(0, 0.1)
        predictor.profiles[f"e{i}"]._sample(fresh, fresh, seconds)
        predictor._pooled(f"e{i}")

    for k in range(12 * engines):  # a dozen samples an engine: every one measured
        sample(k % engines)
    times = []
    for _ in range(rounds):
        i = rng.randrange(engines)
        t = time.perf_counter_ns()
        sample(i)
        times.append(time.perf_counter_ns() - t)
    return statistics.mean(times) / 1000


def picture_memory(engines: int = 32, blocks: int = 100_000) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = PrefixMap(engines, blocks)
    text = bytes(range(256)) * 4
    for e in range(engines):
        for k in range(blocks // 1000):
            m.record(e, PromptBlocks(text * 125, 128, e * 7919 + k))  # 1,000 blocks each
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert all(m.blocks(e) == blocks for e in range(engines))
    return m.heap_bytes / 2**20, (after - before) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", default="8,32")
    ap.add_argument("--prompt-words", type=int, default=8000)
    a = ap.parse_args()
    print(
        "| engines | judge, cache-aware + TPOT ledger (µs) | judge, cache-aware (µs) "
        "| judge, no picture (µs) |\n|---|---|---|---|"
    )
    for n in (int(x) for x in a.engines.split(",")):
        paced = judge_us(n, a.prompt_words, True, tpot=True)
        on = judge_us(n, a.prompt_words, True)
        off = judge_us(n, a.prompt_words, False)
        print(f"| {n} | {paced:.1f} | {on:.1f} | {off:.1f} |")
    heap, rss = picture_memory()
    print(
        f"\npicture of 32 engines x 100,000 blocks: {heap:.0f} MiB heap (Rust), {rss:.0f} MiB RSS"
    )
    print("\n| engines | a finished prompt's prefill sample learned (µs, mean) |\n|---|---|")
    for n in (int(x) for x in a.engines.split(",")):
        print(f"| {n} | {sample_us(n):.1f} |")


if __name__ == "__main__":
    main()
