"""Cache-aware predictive placement, in process: the prefix picture, the TTFT projection that
counts only what each engine must prefill, sessions, the TPOT preference and the engines'
reports correcting the picture. Engines are plain records with learned profiles; leases go
through the real Admission and Events."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from narwhal.errors import ApiError
from narwhal.router import intake
from narwhal.router.admission import Admission
from narwhal.router.config import EngineSpec
from narwhal.router.engines import Engine, Pool
from narwhal.router.lease import Events
from narwhal.router.policies import Plan
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.predict import Predictor

RATE = 1000.0  # prefill tokens/s every engine has learned
BUDGET = 5.0


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i:04d}" for i in range(n))


def request(text: str, session: str | None = None) -> intake.Intake:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if session:
        body["user"] = session
    return intake.check(intake.CHAT, orjson.dumps(body), "m")


class Fleet:
    def __init__(self, n: int = 3, tpot_target_s: float | None = None) -> None:
        self.engines = [Engine(EngineSpec(f"e{i}"), f"http://e{i}", healthy=True) for i in range(n)]
        self.predictor = Predictor(self.engines)
        for p in self.predictor.profiles.values():
            p.prefill_tps = RATE
            p.bytes_per_token = 5.0  # "w0000 " is five bytes a word
        self.cache = PrefixCache(self.engines, tokens_per_engine=100_000, block_bytes=256)
        self.policy = PredictivePolicy(self.predictor, self.engines, self.cache, tpot_target_s)
        self.events = Events()
        self.policy.watch(self.events)
        self.pool = Pool(self.engines, prefill_limit=64, decode_limit=64)
        self.admission = Admission(self.pool, 100, 10, 5.0, self.events)

    def judge(self, req: intake.Intake) -> Plan:
        return self.policy.judge(req, self.engines, BUDGET)

    def serve(self, req: intake.Intake, cached_tokens: int | None = None) -> str:
        """Judge, place and finish one request as the app does; the engine it went to."""
        plan = self.judge(req)

        async def run() -> str:
            now = time.monotonic()
            async with self.admission.place(
                req, now, now + 60, prefer=plan.prefer, tokens=plan.tokens
            ) as lease:
                lease.plan = plan
                self.policy.placed(lease)
                lease.cached_tokens = cached_tokens
                lease.finished(0)
                return lease.on.name

        return asyncio.run(run())


def test_a_family_follows_its_prefix() -> None:
    f = Fleet()
    system = words("sys", 2000)
    first = f.serve(request(system + " question one"))
    # Every engine idle and equally fast: only the cache tells them apart.
    for q in ("question two", "question three", "another one"):
        plan = f.judge(request(system + " " + q))
        assert plan.prefer is not None and plan.prefer.name == first
        assert plan.tokens < 100  # only the unshared tail is expected to be prefilled
    other = f.judge(request(words("new", 2000)))
    assert other.tokens >= 2000  # an unseen prompt is prefilled whole, wherever it goes


def test_a_hot_engine_sheds_a_family_member_when_the_projection_says_so() -> None:
    f = Fleet()
    system = words("sys", 2000)
    home = f.serve(request(system + " q"))
    hot = next(e for e in f.engines if e.name == home)
    hot.prefill_tokens = 4500  # 4.5 s of prefill queued there
    hot.prefill = 3
    plan = f.judge(request(system + " q2"))
    # 4.5 s + its tail there vs ~2 s for the whole prompt on an idle engine.
    assert plan.prefer is not None and plan.prefer.name != home
    hot.prefill_tokens = 1500  # 1.5 s queued: still better than prefilling 2,000 tokens
    plan = f.judge(request(system + " q3"))
    assert plan.prefer is hot


def test_a_prompt_too_long_alone_is_admitted_where_it_is_cached() -> None:
    f = Fleet()
    doc = words("doc", 6000)  # 6 s of prefill anywhere it is not cached: over the budget
    with pytest.raises(ApiError) as refused:
        f.judge(request(doc + " first"))
    assert refused.value.code == "prompt_exceeds_ttft_budget"
    f.cache.placed("e2", f.cache.blocks(request(doc + " seed").prefix_text()))
    plan = f.judge(request(doc + " second"))
    assert plan.prefer is not None and plan.prefer.name == "e2"


def test_reported_cached_tokens_correct_the_picture() -> None:
    f = Fleet()
    system = words("sys", 2000)
    home = f.serve(request(system + " q1"), cached_tokens=0)
    again = f.judge(request(system + " q2"))
    assert again.expected[home].tokens > 1500
    # The engine says it served none of it from cache (evicted since): the picture drops
    # what it thought was there, and that engine is trusted less for the next prompts.
    f.serve(request(system + " q2"), cached_tokens=0)
    after = f.judge(request(system + " q3"))
    assert home not in after.expected or after.expected[home].tokens < 200
    assert f.cache.realised[f.cache.index[home]] < 1.0


def test_a_full_report_keeps_the_picture() -> None:
    f = Fleet()
    system = words("sys", 2000)
    home = f.serve(request(system + " q1"))
    expected = f.judge(request(system + " q2")).expected[home].tokens
    f.serve(request(system + " q2"), cached_tokens=expected)
    assert f.judge(request(system + " q3")).expected[home].tokens >= 0.9 * expected


def test_a_conversation_stays_on_its_engine_while_it_fits() -> None:
    f = Fleet()
    first = f.serve(request(words("a", 50), session="s1"))
    # Later turns share nothing cached (say the picture lost them) yet stay home...
    home = next(e for e in f.engines if e.name == first)
    home.prefill_tokens = 1000  # ... even with 1 s queued there, within the 5 s budget
    plan = f.judge(request(words("b", 50), session="s1"))
    assert plan.prefer is home
    home.prefill_tokens = 6000  # and move when home would break the budget
    plan = f.judge(request(words("c", 50), session="s1"))
    assert plan.prefer is not None and plan.prefer is not home


def test_a_long_prefill_goes_where_it_stalls_no_streams_past_the_tpot_target() -> None:
    f = Fleet(tpot_target_s=0.05)
    for load in f.policy.loads.values():
        load.tau0_s = 0.02  # 20 ms a step without prefill, learned
    # e0 has just been given 8,000 uncached tokens: its streams already run at the limit.
    f.policy.loads["e0"].placed(8000, time.monotonic())
    for e in f.engines[1:]:
        e.decode = 5
    long = request(words("L", 3000))
    plan = f.judge(long)
    assert plan.prefer is not None and plan.prefer.name != "e0"
    # Without the target, TTFT alone decides: e0 is as fast and has no streams in decode.
    f.policy.tpot_target_s = None
    assert f.judge(long).prefer is f.engines[0]


def test_the_picture_is_bounded_by_what_an_engine_holds() -> None:
    f = Fleet(n=1)
    f.cache.map.set_capacity(0, 40)  # 40 blocks of 256 bytes
    for i in range(20):
        f.serve(request(words(f"p{i}", 400)))
    assert f.cache.map.blocks(0) <= 40


def test_a_long_prefill_goes_where_it_stalls_the_fewest_streams() -> None:
    f = Fleet(n=2, tpot_target_s=0.05)
    busy, quiet = f.engines
    busy.decode = 12  # streams decoding beside any prefill placed there
    quiet.decode = 1
    quiet.prefill_tokens = 500  # half a second of prefill queued: TTFT alone prefers `busy`
    long = request(words("L", 2000))
    assert f.judge(long).prefer is quiet
    f.policy.tpot_target_s = None
    assert f.judge(long).prefer is busy
