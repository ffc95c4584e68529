"""Discrete-event simulation of admission policies: open vs predictive.

The engines follow a batching cost model: prefill is compute-bound and serial per engine
(`PREFILL_TPS` prompt tokens/s, shrunk by `DECODE_DRAG` per sequence decoding beside it),
decode runs batched at `TPOT` per token. Arrivals are Poisson at a multiple of the
cluster's prefill capacity, prompts log-normal. The predictive policy is Narwhal's own
TTFT judgement (narwhal/router/policies/ttft.py), fed the learned rate a real run would have.

    .venv/bin/python -m bench.admission_sim [--engines 256] [--seconds 60] [--plot PATH]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from dataclasses import dataclass
from typing import Any

from narwhal.errors import ApiError
from narwhal.router.config import EngineSpec
from narwhal.router.engines import Engine
from narwhal.router.policies.ttft import judge
from narwhal.router.predict import Predictor

PREFILL_TPS = 4000.0  # prompt tokens/s per engine with nothing decoding
DECODE_DRAG = 0.004  # prefill slows by this fraction per sequence in decode
TPOT = 0.02  # s per output token, batched
OUTPUT_TOKENS = 200
PROMPT_MEDIAN = 800  # tokens
BUDGET_S = 2.0
BYTES_PER_TOKEN = 4.0


@dataclass
class SimEngine:
    engine: Engine
    prefill_free_at: float = 0.0  # when its serial prefill queue drains
    decoding: int = 0


def run(policy: str, load: float, engines: int, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    sims = [
        SimEngine(Engine(EngineSpec(f"e{i}"), f"sim://{i}", healthy=True)) for i in range(engines)
    ]
    predictor = Predictor([s.engine for s in sims])
    for s in sims:
        prof = predictor.profiles[s.engine.name]
        prof.prefill_tps, prof.bytes_per_token = PREFILL_TPS, BYTES_PER_TOKEN
    mean_prompt = PROMPT_MEDIAN * math.exp(0.5 * 0.6**2)
    capacity = engines * PREFILL_TPS / mean_prompt  # requests/s the cluster can prefill
    rate = load * capacity
    # (time, seq, kind, engine, tokens, ttft, projected): "first" events feed the predictor
    # what a real run would observe, so its decode correction learns the drag.
    events: list[tuple[float, int, str, int, int, float, float | None]] = []
    seq = 0
    t = 0.0
    ttfts: list[float] = []
    refused = 0
    by_name = {s.engine.name: i for i, s in enumerate(sims)}
    while t < seconds:
        t += rng.expovariate(rate)
        # Retire everything that happened before this arrival.
        while events and events[0][0] <= t:
            _, _, kind, i, tokens, ttft, projected = heapq.heappop(events)
            s = sims[i]
            if kind == "first":
                s.engine.prefill -= 1
                s.engine.prefill_tokens -= tokens
                s.decoding += 1
                if policy == "predictive":
                    predictor.profiles[s.engine.name].observe(
                        int(tokens * BYTES_PER_TOKEN), tokens, ttft, False, 0, 0.0, projected
                    )
            else:
                s.decoding -= 1
        prompt = max(16, int(rng.lognormvariate(math.log(PROMPT_MEDIAN), 0.6)))
        eligible = [s.engine for s in sims]
        projected = None
        if policy == "predictive":
            try:
                proj = judge(
                    predictor,
                    int(prompt * BYTES_PER_TOKEN),
                    eligible,
                    BUDGET_S,
                    lender=predictor.lender(eligible),
                )
            except ApiError:
                refused += 1
                continue
            i = by_name[proj.engine.name]
            projected = proj.total_s
        else:
            i = min(range(engines), key=lambda k: (sims[k].engine.prefill, sims[k].decoding))
        s = sims[i]
        speed = PREFILL_TPS / (1 + DECODE_DRAG * s.decoding)
        start = max(t, s.prefill_free_at)
        first = start + prompt / speed
        s.prefill_free_at = first
        s.engine.prefill += 1
        s.engine.prefill_tokens += prompt
        ttfts.append(first - t)
        seq += 1
        heapq.heappush(events, (first, seq, "first", i, prompt, first - t, projected))
        seq += 1
        heapq.heappush(events, (first + OUTPUT_TOKENS * TPOT, seq, "done", i, 0, 0.0, None))
    ttfts.sort()
    good = sum(1 for x in ttfts if x <= BUDGET_S)
    admitted = len(ttfts)
    return {
        "policy": policy,
        "load": load,
        "offered": admitted + refused,
        "admitted": admitted,
        "refused": refused,
        "goodput": good / seconds,
        "capacity": capacity,
        "within": good / max(admitted, 1),
        "p99": ttfts[min(admitted - 1, int(0.99 * admitted))] if admitted else math.nan,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--plot")
    a = ap.parse_args()
    rows = [
        run(p, load, a.engines, a.seconds, seed=7)
        for load in (0.5, 1.0, 2.0, 4.0)
        for p in ("open", "predictive")
    ]
    print(
        f"{a.engines} engines, {a.seconds:g} s simulated, TTFT budget {BUDGET_S:g} s, "
        f"capacity {rows[0]['capacity']:.0f} req/s\n"
    )
    print(
        "| load | policy | offered | admitted | admitted within budget | goodput req/s "
        "| goodput / capacity | p99 TTFT admitted s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['load']:g}x | {r['policy']} | {r['offered']:.0f} | {r['admitted']:.0f} "
            f"| {r['within']:.1%} | {r['goodput']:.0f} | {r['goodput'] / r['capacity']:.0%} "
            f"| {r['p99']:.2f} |"
        )
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for p in ("open", "predictive"):
            rs = [r for r in rows if r["policy"] == p]
            loads = [r["load"] for r in rs]
            ax1.plot(loads, [r["goodput"] / r["capacity"] for r in rs], marker="o", label=p)
            ax2.plot(loads, [r["p99"] for r in rs], marker="o", label=p)
        ax1.set(
            xlabel="offered load (x capacity)",
            ylabel="goodput / capacity",
            title="Requests within the TTFT budget",
        )
        ax2.set(
            xlabel="offered load (x capacity)",
            ylabel="p99 TTFT of admitted (s)",
            yscale="log",
            title="Latency of what was admitted",
        )
        ax2.axhline(BUDGET_S, color="grey", linestyle="--", label="budget")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main()
