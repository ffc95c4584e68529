"""Cache-aware predictive placement, in process: the prefix picture, the TTFT projection that
counts only what each engine must prefill, sessions, the TPOT preference and the engines'
reports correcting the picture. Engines are plain records with learned profiles; leases go
through the real Admission and Events."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import orjson
import pytest

from narwhal.errors import ApiError
from narwhal.router import decisions as why
from narwhal.router.admission import Admission
from narwhal.router.config import EngineSpec
from narwhal.router.decisions import Decision
from narwhal.router.engines import Engine, Pool
from narwhal.router.lease import Events, Lease
from narwhal.router.pipeline import intake
from narwhal.router.pipeline.judge import Judge
from narwhal.router.policies import Plan, least_loaded
from narwhal.router.policies.lengths import MIN_SAMPLES
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.policies.tpot import Streams
from narwhal.router.policies.ttft import NoEngineKeepsPace
from narwhal.router.predict import Predictor
from narwhal.router.request import CHAT, Request, Standing
from narwhal.router.tenants.reserve import CriticalReserve
from tests.support import measured

RATE = 1000.0  # prefill tokens/s every engine has learned
BUDGET = 5.0


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i:04d}" for i in range(n))


def request(text: str, session: str | None = None, max_tokens: int | None = None) -> Request:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if session:
        body["user"] = session
    if max_tokens:
        body["max_tokens"] = max_tokens
    return intake.check(CHAT, orjson.dumps(body), "m")


_loops: list[asyncio.AbstractEventLoop] = []


@pytest.fixture(autouse=True)
def _close_loops() -> Iterator[None]:
    yield
    while _loops:
        loop = _loops.pop()
        loop.run_until_complete(loop.shutdown_asyncgens())  # open leases end
        loop.close()


CRITICAL = Standing(rank=0, order=0)


class Fleet:
    def __init__(
        self,
        n: int = 3,
        tpot_target_s: float | None = None,
        reserve: CriticalReserve | None = None,
        answers_seen: bool = True,
    ) -> None:
        self.engines = [Engine(EngineSpec(f"e{i}"), f"http://e{i}", healthy=True) for i in range(n)]
        self.predictor = Predictor(self.engines)
        for p in self.predictor.profiles.values():
            measured(p, RATE, 5.0)  # "w0000 " is five bytes a word
        self.cache = PrefixCache(self.engines, tokens_per_engine=100_000, block_bytes=256)
        self.policy = PredictivePolicy(
            self.predictor, self.engines, self.cache, tpot_target_s, reserve, BUDGET
        )
        self.events = Events()
        self.policy.watch(self.events)
        if tpot_target_s is not None and answers_seen:
            self.seen_answers(1000)
        self.pool = Pool(self.engines, prefill_limit=64, decode_limit=64)
        self.admission = Admission(
            self.pool, 100, 10, 5.0, self.events, instead=self.policy.instead
        )
        self.loop = asyncio.new_event_loop()
        _loops.append(self.loop)
        self._open: list[object] = []

    def judge(self, req: Request) -> Plan:
        return self.policy.judge(req, self.engines, BUDGET)

    def serve(
        self,
        req: Request,
        cached_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> str:
        """Judge, place and finish one request as the app does; the engine it went to."""
        plan = self.judge(req)

        async def run() -> str:
            now = time.monotonic()
            async with self.admission.place(
                req, now, now + 60, prefer=plan.prefer, tokens=plan.tokens
            ) as lease:
                self.policy.placed(lease, plan)
                lease.measured.cached_tokens = cached_tokens
                lease.measured.prompt_tokens = prompt_tokens
                lease.finished(0)
                return lease.on.name

        return asyncio.run(run())

    def open(self, req: Request, on: str, plan: Plan | None = None) -> Lease:
        """A request placed on engine `on` (as `plan` said, or with a plan for it) and
        still running (release it to end it)."""
        e = next(e for e in self.engines if e.name == on)
        size = self.predictor.size(req.prompt_bytes, e)
        plan = Plan(e, size, None) if plan is None else plan
        now = time.monotonic()
        placing = self.admission.place(req, now, now + 60, prefer=e, tokens=size)
        # On the fleet's own loop, which (unlike asyncio.run) leaves the lease open after.
        lease = self.loop.run_until_complete(placing.__aenter__())
        self._open.append(placing)  # a collected one would release its lease
        assert lease.on is e
        self.policy.placed(lease, plan)
        return lease

    def seen_answers(self, tokens: int, count: int = MIN_SAMPLES) -> None:
        """The router has seen `count` answers of `tokens` tokens: the ledger's verdicts
        rest on measured lengths (with `max_tokens` below them, it is what holds a stream)."""
        for _ in range(count):
            self.policy.lengths.observe("", tokens)

    def learn_tau0(self, seconds: float) -> None:
        for streams in self.policy.streams.values():
            streams.tau0_s = seconds


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


def test_a_cached_history_leaves_its_new_turn_to_prefill_when_sizing_runs_low() -> None:
    f = Fleet()
    history = words("h", 2000)
    home = f.serve(request(history))
    # The engine counts a fifth more tokens than the router sizes (its words are shorter
    # than the router's learned bytes per token says), and reports its cache in that count.
    for k in range(8):
        history += " " + words(f"t{k}", 100)
        plan = f.judge(request(history))
        held = plan.expected[home]
        f.serve(
            request(history), cached_tokens=held.tokens * 6 // 5, prompt_tokens=held.sized * 6 // 5
        )
    new = " " + words("new", 300)
    turn = f.judge(request(history + new))
    # The sizing's error is not the cache's: the new turn is still to prefill.
    assert turn.prefer is not None and turn.prefer.name == home
    tail = f.predictor.size(len(new), turn.prefer)
    assert tail <= turn.tokens < 2 * tail


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


def test_a_conversation_waits_for_its_engine_to_keep_pace_rather_than_move_its_history() -> None:
    f = Fleet(n=2, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    history = words("h", 400)
    home = f.serve(request(history, session="s1"))
    # A short answer streams at home: its allowance cannot take the next turn's prefill...
    short = f.open(request(words("s", 10), max_tokens=5), on=home)
    short.first_output()
    turn = request(history + " " + words("n", 200), session="s1")
    # ... which the other engine could take, at the price of the whole history.
    with pytest.raises(NoEngineKeepsPace) as waiting:
        f.judge(turn)
    assert waiting.value.slack_s > 1  # the budget leaves time for a stream to end
    short.finished(5)
    short.release()
    assert f.judge(turn).prefer.name == home
    # With no time left to wait (its queue near the budget), it moves rather than miss it.
    short = f.open(request(words("t", 10), max_tokens=5), on=home)
    short.first_output()
    next(e for e in f.engines if e.name == home).prefill_tokens = 4000
    with pytest.raises(NoEngineKeepsPace) as waiting:
        f.judge(turn)
    plan = f.policy.judge(turn, f.engines, BUDGET - waiting.value.slack_s + 0.03)
    assert plan.prefer is not None and plan.prefer.name != home


def test_a_long_prefill_goes_where_no_stream_would_miss_its_tpot_target() -> None:
    f = Fleet(tpot_target_s=0.05)
    f.learn_tau0(0.02)  # 20 ms a step without prefill
    # e0 streams a short answer: 4 steps left at most 30 ms over their own, so 120 ms
    # (120 prompt tokens at 1,000/s) of prefill beside it would break its target.
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    for e in f.engines[1:]:
        e.decode = 3  # busier, but with nothing near its target
    long = request(words("L", 3000))
    plan = f.judge(long)
    assert plan.prefer is not None and plan.prefer.name != "e0"
    # Without the target, fewest streams and in flight win: e0.
    f.policy.tpot_target_s = None
    assert f.judge(long).prefer is f.engines[0]


def test_a_prefill_no_engine_can_take_waits_for_a_stream_to_end() -> None:
    f = Fleet(n=2, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    leases = [
        f.open(request(words(f"s{i}", 10), max_tokens=5), on=e.name)
        for i, e in enumerate(f.engines)
    ]
    for lease in leases:
        lease.first_output()
    long = request(words("L", 1000))
    with pytest.raises(NoEngineKeepsPace) as refused:
        f.judge(long)
    assert refused.value.slack_s > 0  # the TTFT budget leaves time to wait
    assert refused.value.refusal.code == "tpot_target_exceeded"

    async def wait_then_judge() -> Plan:
        waiting = asyncio.create_task(f.policy.room(3600))
        await asyncio.sleep(0)
        assert not waiting.done()
        leases[1].finished(5)
        leases[1].release()  # e1's stream ended: room there
        await asyncio.wait_for(waiting, 10)  # woken by the end, not by the timeout
        return f.judge(long)

    plan = f.loop.run_until_complete(wait_then_judge())
    assert plan.prefer is f.engines[1]


def test_a_request_waiting_for_pace_whose_engines_went_away_is_left_to_placement() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    waits: list[int] = []
    judge = Judge(f.policy, f.pool, lambda: waits.append(1))

    async def wait_while_the_engine_goes() -> Plan:
        waiting = asyncio.create_task(judge.plan(request(words("L", 1000)), time.monotonic(), 5))
        await asyncio.sleep(0)
        f.engines[0].healthy = False  # its health probe failed meanwhile
        short.finished(5)
        short.release()
        return await asyncio.wait_for(waiting, 10)

    plan = f.loop.run_until_complete(wait_while_the_engine_goes())
    assert plan.prefer is None  # placement answers it (503), not a judge of no engine
    assert waits == [1]


def test_a_request_that_waited_for_pace_is_not_placed_past_what_its_wait_left() -> None:
    """An engine whose profile cannot vouch for a prompt's size is admitted to while what
    is ahead of the prompt fits (no refusal for length on a guess); but a request that
    waited for pace and whose projection no longer fits what the wait left would start
    late: it is refused for the pace it waited for."""
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    f.predictor.profiles["e0"].prefill_samples = 0  # vouches for nothing
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    judge = Judge(f.policy, f.pool, lambda: None)

    async def wait_while_prefill_arrives() -> Plan:
        # 2.5 s of its 5 s budget left; its own prefill projected at 1.8 s.
        arrived = time.monotonic() - 2.5
        waiting = asyncio.create_task(judge.plan(request(words("L", 1500)), arrived, 5))
        await asyncio.sleep(0)
        assert not waiting.done()  # waiting for the stream's pace
        f.engines[0].prefill_tokens = 1000  # another second of prefill placed there meanwhile
        short.finished(5)
        short.release()
        return await asyncio.wait_for(waiting, 10)

    with pytest.raises(ApiError) as refused:
        f.loop.run_until_complete(wait_while_prefill_arrives())
    assert refused.value.code == "tpot_target_exceeded"
    # Without a wait, the same projection on the same engine is placed (cold start).
    assert f.judge(request(words("M", 1500))).prefer is f.engines[0]


def test_requests_judged_before_either_is_placed_do_not_share_one_headroom() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    # A short answer streams on e0: its allowance, (45 - 20) ms x 4 steps = 100 ms, takes
    # one 60-token prefill (60 ms at 1,000 tokens/s), not two.
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    first, second = request(words("A", 50)), request(words("B", 50))
    assert f.judge(first).prefer is f.engines[0]
    # Woken by the same stream's end, both are judged before either is placed.
    with pytest.raises(NoEngineKeepsPace):
        f.judge(second)


def test_a_stream_that_ended_no_longer_holds_its_engine_back() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    long = request(words("L", 1000))
    with pytest.raises(NoEngineKeepsPace):
        f.judge(long)
    short.finished(5)
    short.release()
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


# A stream held to 0.2 s a token on steps of 0.1 s: 0.1 s of allowance a token.
AIM, TAU0 = 0.2, 0.1


class Counted:
    """The relay's count of a stream's output tokens (a `Tally`), set by the test."""

    def __init__(self, counted: int = 1) -> None:
        self.counted = counted


def test_the_step_without_prefill_is_learned_from_streams_that_had_steps_of_their_own() -> None:
    ledger = Streams()
    quiet = ledger.joined(AIM, TAU0, 11)
    ledger.ended(quiet, output_tokens=11, decode_s=0.2)  # nothing placed after it
    assert ledger.tau0_s == pytest.approx(0.02)
    busy = ledger.joined(AIM, TAU0, 11)
    ledger.charge(2.0)  # 2 s of prefill placed after it: its steps were not its own
    ledger.ended(busy, output_tokens=11, decode_s=2.2)
    assert ledger.tau0_s == pytest.approx(0.02)
    assert len(ledger) == 0 and ledger.headroom_s(now=0.0) is None


def test_a_stream_that_outlives_its_expected_length_no_longer_holds_its_engine_to_it() -> None:
    ledger = Streams()
    # Expected to answer in two tokens: 0.1 s of prefill beside it would break its target.
    short = ledger.joined(AIM, TAU0, 2)
    assert not ledger.fits(1.0, now=100.0)
    ledger.decoding(short, since=100.0)
    # Within target, a stream decoding for d seconds, c of them waiting on prefill, has made
    # (d - c) / target tokens at least: its allowance is half of that here (tau0 is half
    # the target).
    assert not ledger.fits(1.0, now=101.0)
    assert ledger.fits(1.0, now=103.0)
    ledger.charge(1.0)  # 1 s of prefill it may have waited on: 1 s of allowance, spent
    assert ledger.headroom_s(now=103.0) == pytest.approx(0.0)
    assert not ledger.fits(0.5, now=103.0)
    assert ledger.headroom_s(now=105.0) == pytest.approx(1.0)


def test_only_answers_that_end_on_their_own_teach_how_long_answers_run() -> None:
    f = Fleet(n=1, tpot_target_s=0.1, answers_seen=False)

    def answer(max_tokens: int | None, tokens: int, finished: bool = True) -> None:
        lease = f.open(request(words("q", 10), max_tokens=max_tokens), on="e0")
        lease.first_output()
        if finished:
            lease.finished(tokens)
        lease.release()

    # Stopped at their max_tokens (a client's limit, not where answers end), or cut by
    # their clients: the router's /ready counts none of them as ended; until it has seen
    # answers end, new streams are held to what the capped ones ran to.
    for _ in range(MIN_SAMPLES):
        answer(max_tokens=8, tokens=8)
        answer(max_tokens=None, tokens=3, finished=False)
    assert f.policy.lengths.describe() == {"ended": 0, "ready": True, "new_stream_tokens": 8}
    # Ended short of their max_tokens, or with none set: these are answers' lengths.
    for _ in range(MIN_SAMPLES // 2):
        answer(max_tokens=2048, tokens=300)
        answer(max_tokens=None, tokens=300)
    assert f.policy.lengths.describe() == {
        "ended": MIN_SAMPLES,
        "ready": True,
        "new_stream_tokens": f.policy.lengths.of("").at_least(2),  # type: ignore[union-attr]
    }
    assert f.policy.lengths.describe()["new_stream_tokens"] > 8


def test_the_tightest_true_allowance_is_found_below_the_heap_top() -> None:
    ledger = Streams()
    old = ledger.joined(AIM, TAU0, 2)  # expected short, decoding for long
    young = ledger.joined(AIM, TAU0, 4)  # expected a little longer, just started
    roomy = ledger.joined(AIM, TAU0, 51)
    ledger.decoding(old, since=0.0)
    ledger.decoding(young, since=99.0)
    ledger.decoding(roomy, since=99.0)
    # `old` has grown to 50 s of allowance; `young` is the tightest now, below it in the heap.
    assert ledger.headroom_s(now=100.0) == pytest.approx(0.5)
    assert ledger.headroom_s(now=100.0) == pytest.approx(0.5)  # and reading it changed nothing


def test_the_ledger_stays_the_size_of_the_streams_in_it() -> None:
    ledger = Streams()
    ledger.joined(AIM, TAU0, 6)  # the tightest allowance, and it never ends
    for i in range(10_000):
        entry = ledger.joined(AIM, TAU0, 101)
        ledger.decoding(entry, since=0.0, tally=Counted(i % 3))
        ledger.ended(entry, 0, 0.0)
    assert len(ledger) == 1 and ledger.headroom_s(now=0.0) == pytest.approx(0.5)
    for bounded, counted in ledger._heaps:
        assert len(bounded) <= 4 * len(ledger) + 65
        assert len(counted) <= 4 * len(ledger) + 65


def test_a_stream_is_protected_before_its_engine_has_measured_a_step() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)  # no step time learned anywhere yet
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    with pytest.raises(NoEngineKeepsPace):
        f.judge(request(words("L", 1000)))  # a second of prefill beside a 5-token answer


def test_an_engine_with_no_step_of_its_own_measured_borrows_the_fleets() -> None:
    f = Fleet(n=2, tpot_target_s=0.05)
    f.policy.streams["e1"].tau0_s = 0.044  # e1's streams had steps of 44 ms: no room left
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    f.engines[1].healthy = False
    # 45 ms aim less 44 ms a step: 4 ms of allowance; half the aim (the cold guess) would
    # leave 90 ms, enough for this 60 ms prefill.
    with pytest.raises(NoEngineKeepsPace):
        f.policy.judge(request(words("A", 60)), [f.engines[0]], BUDGET)


def test_one_stalled_stream_does_not_teach_its_engine_a_slow_step() -> None:
    ledger = Streams()
    for _ in range(4):
        quiet = ledger.joined(AIM, TAU0, 11)
        ledger.ended(quiet, output_tokens=11, decode_s=0.2)  # 20 ms a step
    # A stream stalled by prefill the ledger never heard of (sized too small, an eviction).
    stalled = ledger.joined(AIM, TAU0, 11)
    ledger.ended(stalled, output_tokens=11, decode_s=6.0)
    assert ledger.tau0_s == pytest.approx(0.02)


def test_a_counted_stream_is_held_to_what_it_measured_not_to_the_charge() -> None:
    ledger = Streams()
    old = ledger.joined(AIM, TAU0, 11)  # 1 s of allowance, expected to run to 11 tokens
    prompt = ledger.charge(5.0)  # 5 s of prefill placed after it: by the charge, spent
    assert not ledger.fits(0.5, now=100.0)
    tally = Counted(1)
    ledger.decoding(old, since=100.0, tally=tally)
    prompt.settle()  # that prefill ran (its first token came): it is in the past now
    tally.counted = 31  # 31 tokens in 3 s: 0.1 s a token, well within 0.2
    # It runs to 31 tokens at least; by 6 s (0.2 x 30) it keeps its target: 3 s to spare.
    assert ledger.headroom_s(now=103.0) == pytest.approx(3.0)
    assert ledger.fits(2.5, now=103.0)
    ledger.charge(2.0)  # placed, not run yet: beside it still
    assert ledger.headroom_s(now=103.0) == pytest.approx(1.0)
    # A stream already behind its target has no room, whatever its charge says.
    slow = ledger.joined(AIM, TAU0, 11)
    ledger.decoding(slow, since=100.0, tally=Counted(3))  # 3 tokens in 3 s
    assert not ledger.fits(0.01, now=103.0)


def test_a_stream_that_made_more_tokens_than_expected_lets_a_long_prefill_in() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.01)
    lease = f.open(request(words("s", 10), max_tokens=20), on="e0")
    tally = Counted(1)
    lease.measured.tally = tally
    lease.first_output()
    long = request(words("L", 3000))  # 3 s of prefill beside it
    with pytest.raises(NoEngineKeepsPace):
        f.judge(long)  # 20 tokens expected: 0.035 s x 19 of allowance, far short of 3 s
    tally.counted = 400  # it has kept streaming: it runs to 400 tokens or more
    plan = f.judge(long)
    assert plan.prefer is f.engines[0]


def test_a_charge_is_let_go_when_its_request_ends_unplaced_or_goes_elsewhere() -> None:
    f = Fleet(n=2, tpot_target_s=0.05)
    f.learn_tau0(0.01)
    ledgers = f.policy.streams
    plan = f.judge(request(words("L", 1000)))
    assert plan.prefer is not None
    assert ledgers[plan.prefer.name].pending_s == pytest.approx(plan.tokens / RATE)
    plan.settle()  # the request ended before it was placed (the client went away, say)
    assert ledgers[plan.prefer.name].pending_s == 0.0
    plan.settle()
    assert ledgers[plan.prefer.name].pending_s == 0.0
    # Judged for one engine, placed on the other: the other waits it out, the first does not.
    plan = f.judge(request(words("M", 1000)))
    assert plan.prefer is not None
    other = next(e for e in f.engines if e is not plan.prefer)
    lease = f.open(request(words("M", 1000)), on=other.name, plan=plan)
    assert ledgers[plan.prefer.name].pending_s == 0.0
    assert ledgers[other.name].pending_s == pytest.approx(lease.tokens / RATE)
    lease.first_output()  # its prefill has run
    assert ledgers[other.name].pending_s == 0.0


def test_a_family_waits_for_the_engine_holding_its_prefix_when_only_pace_keeps_it_out() -> None:
    f = Fleet(n=2, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    system = words("sys", 1200)  # 1,920 tokens at 5 bytes a token
    holder = f.serve(request(system + " " + words("q", 20)))
    # A short answer streams where the family is cached: it cannot take even the tail's
    # prefill (240 tokens, 0.24 s), which the other engine could take whole (2.2 s).
    short = f.open(request(words("s", 10), max_tokens=5), on=holder)
    short.first_output()
    member = request(system + " " + words("m", 200))
    with pytest.raises(NoEngineKeepsPace) as waiting:
        f.judge(member)
    assert waiting.value.slack_s > 1  # the other engine still fits after the wait
    short.finished(5)
    short.release()
    assert f.judge(member).prefer.name == holder
    # When waiting would push the other engine past the budget, the prompt goes there now.
    short = f.open(request(words("t", 10), max_tokens=5), on=holder)
    short.first_output()
    other = next(e for e in f.engines if e.name != holder)
    other.prefill_tokens = 2000  # 2 s queued there: 4.2 s for the whole prompt
    assert f.judge(member).prefer is other


def test_a_lower_class_must_leave_the_streams_more_of_their_allowance() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()  # 4 steps left, 25 ms each to spare: 0.1 s of prefill
    prompt = request(words("p", 64))  # 80 tokens at 1,000/s: 0.08 s
    assert f.judge(prompt).prefer is f.engines[0]
    sheddable = prompt.classified(Standing(share=0.5))  # as if its prefill took twice as long
    with pytest.raises(NoEngineKeepsPace):
        f.judge(sheddable)


def test_lower_classes_leave_critical_streams_the_reserve() -> None:
    # 0.05 s of prefill kept for critical work in critical streams' allowance.
    f = Fleet(n=1, tpot_target_s=0.05, reserve=CriticalReserve(0.05 / BUDGET))
    f.learn_tau0(0.02)
    chat = request(words("s", 10), max_tokens=5).classified(CRITICAL)
    # Critical: 4 steps left, 25 ms each to spare, 0.1 s of prefill.
    f.open(chat, on="e0").first_output()
    batch = request(words("p", 64))  # 80 tokens at 1,000/s: 0.08 s, within the 0.1 s
    with pytest.raises(NoEngineKeepsPace):
        f.judge(batch)  # standard: 0.08 s + the reserve's 0.05 s do not fit
    assert f.judge(batch.classified(CRITICAL)).prefer is f.engines[0]  # critical work takes it


def test_waiters_of_a_higher_class_are_woken_first() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    stream = f.open(request(words("s", 10), max_tokens=5), on="e0")
    stream.first_output()
    woken: list[str] = []

    async def wait(name: str, rank: int) -> None:
        await f.policy.room(60, rank)
        woken.append(name)

    async def run() -> None:
        waiters = [
            asyncio.create_task(wait(name, rank))
            for name, rank in (("sheddable", 4), ("standard", 2), ("critical", 0))
        ]
        await asyncio.sleep(0)
        stream.finished(5)
        stream.release()
        await asyncio.wait_for(asyncio.gather(*waiters), 10)

    f.loop.run_until_complete(run())
    assert woken == ["critical", "standard", "sheddable"]


def test_a_lower_class_waits_behind_a_higher_one_waiting_for_pace() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)

    async def run() -> None:
        waiter = asyncio.create_task(f.policy.room(60, 0))  # a critical request waits
        await asyncio.sleep(0)
        standard = request(words("q", 10))
        with pytest.raises(NoEngineKeepsPace):  # it would spend what the waiter needs
            f.judge(standard)
        critical = request(words("c", 10)).classified(CRITICAL)
        assert f.judge(critical).prefer is f.engines[0]
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        assert f.judge(standard).prefer is f.engines[0]  # none waits now

    f.loop.run_until_complete(run())


def test_a_prompt_spends_lower_classes_allowance_never_a_higher_ones() -> None:
    critical, standard, sheddable = 0, 1, 2
    ledger = Streams(3)
    ledger.joined(AIM, TAU0, 21, rank=critical)  # 2 s of allowance
    ledger.joined(AIM, TAU0, 6, rank=standard)  # 0.5 s
    ledger.joined(AIM, TAU0, 2, rank=sheddable)  # 0.1 s
    # A second of prefill would break the standard and the sheddable stream's targets: a
    # critical prompt may take it, a standard one only the sheddable stream's pace spends.
    assert ledger.fits(1.0, now=0.0, rank=critical)
    assert not ledger.fits(1.0, now=0.0, rank=standard)
    assert ledger.fits(0.4, now=0.0, rank=standard)
    assert not ledger.fits(0.4, now=0.0, rank=sheddable)
    assert not ledger.fits(2.5, now=0.0, rank=critical)
    assert ledger.headroom_s(now=0.0) == pytest.approx(0.1)  # every stream: the tightest


def test_a_prompt_that_waited_behind_another_is_measured_from_that_ones_first_token() -> None:
    """Prefill runs first come, first served: a prompt placed behind another began its own
    prefill when that one's first token came. Its TTFT is not its prefill's, and learning
    a rate only from prompts that had the engine alone left a loaded engine (where none
    has) unmeasured: long prompts projected from a few short ones, and placed late."""
    f = Fleet()
    first = f.open(request(words("a", 500)), "e0")
    second = f.open(request(words("b", 500)), "e0")
    for lease in (first, second):
        lease.measured.sent_at = time.monotonic() - 3.0
    first.first_output()
    second.first_output()
    assert first.prefill_s == first.measured.first_at - first.measured.sent_at
    assert not first.queued  # nothing ahead of it: its overhead is in its time
    assert second.queued
    assert second.prefill_s == second.measured.first_at - first.measured.first_at
    # Out of order (a later prompt's first token came first), or one ahead of it gone
    # before its first token: who prefilled when cannot be told, and nothing is measured.
    third = f.open(request(words("c", 500)), "e1")
    fourth = f.open(request(words("d", 500)), "e1")
    fifth = f.open(request(words("e", 500)), "e2")
    sixth = f.open(request(words("g", 500)), "e2")
    for lease in (third, fourth, fifth, sixth):
        lease.measured.sent_at = time.monotonic()
    fourth.first_output()
    third.first_output()
    f.admission.release(fifth)
    sixth.first_output()
    assert third.prefill_s is None and fourth.prefill_s is None and sixth.prefill_s is None


def test_an_engine_never_alone_still_learns_its_prefill() -> None:
    f = Fleet()
    prof = f.predictor.profiles["e0"]
    before = prof.prefill_samples
    prof.largest_measured = 0
    leases = [f.open(request(words(f"w{i}-", 300 * (i + 1))), "e0") for i in range(4)]
    for lease in leases:  # each placed while the ones before it are in prefill
        lease.measured.sent_at = time.monotonic()
        lease.measured.prompt_tokens = lease.tokens
    for lease in leases:
        lease.first_output()
        lease.finished(10)
    assert prof.prefill_samples == before + 4
    assert prof.largest_measured == leases[-1].tokens  # the longest prompt vouches


def test_lateness_is_learned_at_the_first_token_and_from_prompts_gone_past_due() -> None:
    """An answer can stream for minutes after its first token came late: the edge learns
    then, not at the answer's end; and a prompt whose client gave up past its due (or
    whose engine failed it) was late too, though no first token ever came."""
    for how in ("first token", "gone past due"):
        f = Fleet(n=1)
        edge = request(words("q", 4080))  # 4.9 s of prefill: within the 5 s budget, just
        assert f.judge(edge).prefer is f.engines[0]
        for i in range(5):
            lease = f.open(request(words(f"r{i}-", 10)), on="e0")
            lease.ttft_by = time.monotonic() - 1.0
            if how == "first token":
                lease.first_output()  # still streaming: not finished, not released
            else:
                lease.release()
        with pytest.raises(ApiError) as refused:
            f.judge(edge)
        assert refused.value.code == "ttft_budget_exceeded", how


def test_an_engine_without_misses_of_its_own_is_judged_by_the_fleets() -> None:
    """A fresh router's engines, or a new one, were placed at the budget's edge with no
    margin until each had five projections scored: the first ones came late."""
    f = Fleet(n=2)
    for i in range(6):  # e0's first tokens came 1.25x their projections
        lease = f.open(request(words(f"m{i}-", 100)), on="e0")
        lease.predicted_s = 1.0
        lease.projected_at = lease.measured.sent_at = time.monotonic() - 1.25
        lease.measured.prompt_tokens = lease.tokens
        lease.first_output()
        lease.finished(5)
        lease.release()
    p = f.predictor
    e0, e1 = p.profiles["e0"], p.profiles["e1"]
    assert e1.drift is None  # nothing scored there
    assert p.margin(e1) == pytest.approx(p.margin(e0))
    assert p.margin(e1) > 1.5
    assert Fleet(n=2).predictor.margin(e1) == 1.0  # nothing scored anywhere: no margin


def _a_new_stream_after(lengths: list[int]) -> tuple[Fleet, Counted]:
    """One engine (TPOT target 50 ms, steps of 10 ms) that has answered `lengths`, and a
    stream that asked for 2,048 tokens, its first counted: the fleet and its tally."""
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.01)
    for i, tokens in enumerate(lengths):
        done = f.open(request(words(f"d{i}-", 10)), on="e0")
        done.first_output()
        done.finished(tokens)
        done.release()
    lease = f.open(request(words("s", 10), max_tokens=2048), on="e0")
    tally = Counted(1)
    lease.measured.tally = tally
    lease.first_output()
    return f, tally


def test_a_generous_max_tokens_does_not_hide_that_most_answers_are_short() -> None:
    """Clients ask for 2,048 tokens and most answers stop after a few dozen: the ledger holds
    a new stream to what answers here run to (a low quantile of them), so the prefill that
    would break a short answer's TPOT waits; past the short answers' lengths, the stream is
    held to what the answers that got as far ran to."""
    # Four answers in five are 20 tokens, one is 2,000.
    f, tally = _a_new_stream_after([2000 if i % 5 == 4 else 20 for i in range(100)])
    long = request(words("L", 1000))  # 1 s of prefill: a 20-token answer beside it misses
    with pytest.raises(NoEngineKeepsPace):
        f.judge(long)
    tally.counted = 200  # past the short answers: this one runs as the long ones do
    assert f.judge(long).prefer is f.engines[0]


def test_a_prefill_that_would_break_one_answer_in_eight_waits() -> None:
    """Held to the quarter of answers that stop soonest, a new stream beside which one
    answer in eight is short was read as long (the quarter's length is the long answers'),
    and the prefill that breaks the short ones was placed beside it: the fleet bench's
    streams over the TPOT target were such short answers, a few in every hundred served.
    Held to the tenth, it waits."""
    # One answer in eight is 20 tokens, the rest 2,000.
    f, _ = _a_new_stream_after([20 if i % 8 == 0 else 2000 for i in range(160)])
    long = request(words("L", 1000))  # 1 s of prefill: a 20-token answer beside it misses
    with pytest.raises(NoEngineKeepsPace):
        f.judge(long)


def test_late_first_tokens_widen_every_projection_until_lateness_is_rare() -> None:
    """What the projection misses at the edge of the budget, where a full fleet places what
    it admits, is learned from the first tokens that came late: a request projected just
    within its budget is refused while they do, and fits again once they have stopped."""
    f = Fleet(n=1)
    edge = request(words("q", 4080))  # 4.9 s of prefill: within the 5 s budget, only just
    assert f.judge(edge).prefer is f.engines[0]

    def served(i: int, late: bool) -> None:
        lease = f.open(request(words(f"r{i}-", 10)), on="e0")
        lease.ttft_by = time.monotonic() + (-1.0 if late else 60.0)
        lease.first_output()
        lease.finished(5)
        lease.release()

    for i in range(5):
        served(i, late=True)
    with pytest.raises(ApiError) as refused:
        f.judge(edge)
    assert refused.value.code == "ttft_budget_exceeded"
    for i in range(1000):  # none late since: one in two hundred is what it aims at
        served(i, late=False)
    assert f.judge(edge).prefer is f.engines[0]


def test_a_fresh_router_places_what_pace_would_hold_until_it_has_seen_answers() -> None:
    f = Fleet(n=1, tpot_target_s=0.05, answers_seen=False)
    f.learn_tau0(0.02)
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    long = request(words("L", 1000))  # a second of prefill beside a 5-token answer
    record = Decision("r", "", "standard", long.prompt_bytes)
    plan = f.policy.judge(long, f.engines, BUDGET, record)
    # Nothing measured says how long answers run: placed, and the record says why.
    assert plan.prefer is f.engines[0] and record.why == why.PACE_UNSURE
    plan.settle()
    f.seen_answers(1000)
    with pytest.raises(NoEngineKeepsPace):
        f.judge(long)


def test_an_engine_serving_two_models_learns_each_ones_prefill_rate() -> None:
    """A second model on an engine (an adapter, say) prefills at a rate of its own: its
    prompts are projected at what its own prompts measured there, begun from the engine's
    profile; the engine's profile goes on learning from every prompt, and an engine that
    serves one model keeps no profile per model."""
    specs = [EngineSpec("two", models=("base", "slow")), EngineSpec("one")]
    engines = [Engine(s, f"http://{s.name}", healthy=True) for s in specs]
    predictor = Predictor(engines)
    for p in predictor.profiles.values():
        measured(p, RATE, 5.0)
    events = Events()
    predictor.watch(events)
    admission = Admission(Pool(engines, 64, 64), 100, 10, 5.0, events, instead=least_loaded)

    def served(e: Engine, model: str, words_: int, rate: float) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": words("w", words_)}]}
        req = intake.check(CHAT, orjson.dumps(body), lambda name: name or "base")

        async def run() -> None:
            now = time.monotonic()
            tokens = predictor.size(req.prompt_bytes, e)
            async with admission.place(req, now, now + 60, prefer=e, tokens=tokens) as lease:
                lease.measured.prompt_tokens = tokens
                lease.measured.sent_at = time.monotonic() - tokens / rate  # its prefill took
                lease.first_output()
                lease.finished(5)

        asyncio.run(run())

    two, one = engines
    for i in range(12):
        served(two, "slow", 400 + 200 * (i % 4), RATE / 2)  # half the engine's rate
        served(two, "base", 400 + 200 * (i % 4), RATE)
        served(one, "base", 400 + 200 * (i % 4), RATE)
    prompt = request(words("q", 1000)).prompt_bytes
    slow = predictor.project(prompt, two, model="slow").own_s
    base = predictor.project(prompt, two, model="base").own_s
    unseen = predictor.project(prompt, two, model="other").own_s  # the engine's own
    assert slow is not None and base is not None and unseen is not None
    assert slow > 1.5 * base
    assert base < slow and unseen < slow
    assert set(predictor.models) == {"two"} and set(predictor.models["two"]) == {"slow", "base"}
