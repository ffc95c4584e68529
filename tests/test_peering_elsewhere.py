"""The other active routers' work folded into this router's picture (router/peering/
elsewhere.py), in process: what a peer placed holds a seat here and what it let in counts
against its tenant, and both are let go however that peer's work ends, a lost delta
included; an eviction one router finds leaves every router's picture; room for pace goes
to the fleet's oldest waiter; the answers another router relayed in full teach this one's
answer lengths; what a router placed that the others have not heard of yet spends only its
share of an engine's room for pace."""

from __future__ import annotations

import asyncio
import time

import pytest

from narwhal.errors import ApiError
from narwhal.router.admission import Admission
from narwhal.router.config import EngineSpec, TenantKey
from narwhal.router.engines import Engine, Pool
from narwhal.router.ha.leadership import Leadership
from narwhal.router.lease import Lease
from narwhal.router.metrics import RouterMetrics
from narwhal.router.peering.elsewhere import Elsewhere
from narwhal.router.peering.exchange import Exchange, Outbox
from narwhal.router.peering.wire import (
    Admitted,
    Batch,
    Ended,
    Evicted,
    First,
    Placed,
    Snapshot,
    Waited,
    decode,
    encode_batch,
)
from narwhal.router.pipeline.judge import Judge
from narwhal.router.policies import Plan, least_loaded
from narwhal.router.policies.lengths import MIN_SAMPLES
from narwhal.router.policies.open import OpenPolicy
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.policies.ttft import NoEngineKeepsPace
from narwhal.router.predict import Predictor
from narwhal.router.tenants.registry import Tenants
from tests.test_placement import BUDGET, Fleet, request, words


def setup() -> tuple[Elsewhere, Engine, Tenants, RouterMetrics]:
    gpu = Engine(EngineSpec("gpu0", "vllm", "http://127.0.0.1:1"), "http://127.0.0.1:1")
    pool = Pool([gpu], 64, 512)
    admission = Admission(pool, 1024, 16, 1.0, instead=least_loaded)
    metrics = RouterMetrics()
    tenants = Tenants([TenantKey("team", key="k", max_concurrent=2)], metrics)
    return Elsewhere(pool, admission, OpenPolicy(), tenants, metrics), gpu, tenants, metrics


def placed(i: int) -> Placed:
    return Placed(i, "gpu0", 100, None, None, None, None, None, 1, None, "team")


def test_a_peers_work_holds_seats_and_tenant_places_until_it_ends() -> None:
    elsewhere, gpu, tenants, _ = setup()
    elsewhere.snapshot(Snapshot("peer", 5, 1, [placed(1)], [], [Admitted(2, "team", 10)]))
    assert (gpu.prefill, gpu.prefill_tokens) == (1, 100)
    assert tenants.by_name["team"].inflight == 1
    assert elsewhere.batch(Batch("peer", 5, 1, [Ended(1, 3, 0.1)])) is None
    assert (gpu.prefill, gpu.prefill_tokens) == (0, 0)
    # A batch that does not start where the last ended is refused, and folds nothing.
    assert elsewhere.batch(Batch("peer", 5, 7, [placed(9)])) == 2
    assert gpu.prefill == 0


def test_what_a_peer_never_said_the_end_of_is_swept() -> None:
    elsewhere, gpu, tenants, _ = setup()
    elsewhere.snapshot(Snapshot("peer", 5, 1, [placed(1)], [1], [Admitted(2, "team", 10)]))
    assert gpu.decode == 1 and tenants.by_name["team"].inflight == 1
    elsewhere.sweep(0.0)  # everything is older than no time at all
    assert gpu.decode == 0
    assert tenants.by_name["team"].inflight == 0  # else the tenant's max_concurrent shrank for good


def test_a_snapshot_replaces_what_was_held_and_keeps_the_peers_series() -> None:
    elsewhere, gpu, tenants, metrics = setup()
    elsewhere.snapshot(Snapshot("peer", 5, 1, [placed(1)], [], [Admitted(2, "team", 10)]))
    elsewhere.snapshot(Snapshot("peer", 5, 3, [placed(1), placed(3)], [], []))
    assert gpu.prefill == 2 and tenants.by_name["team"].inflight == 0
    assert metrics.placements.labels("peer")._value.get() == 3
    elsewhere.drop("peer")
    assert gpu.prefill == 0


def _router(fleet: list[Engine]) -> tuple[PredictivePolicy, PrefixCache]:
    predictor = Predictor(fleet)
    for prof in predictor.profiles.values():
        prof.prefill_tps, prof.bytes_per_token = 1000.0, 5.0
    cache = PrefixCache(fleet, tokens_per_engine=100_000, block_bytes=256)
    cache.seeded(7)  # active routers hash prompts alike (the peer secret's seed)
    return PredictivePolicy(predictor, fleet, cache, tpot_target_s=0.1), cache


def test_an_eviction_one_router_finds_drops_from_every_routers_picture() -> None:
    fleet = [
        Engine(EngineSpec(n, url=f"http://{n}"), f"http://{n}", healthy=True) for n in ("e0", "e1")
    ]
    a, a_cache = _router(fleet)
    b, b_cache = _router(fleet)
    told: list[Evicted] = []
    a.tell_evictions(
        lambda engine, blocks, keep: told.append(Evicted(engine, blocks.packed(), keep))
    )
    system = words("sys", 1000)
    blocks = a_cache.blocks(request(system).prefix_text())
    for cache in (a_cache, b_cache):  # placed on e1 and told: both pictures hold it there
        cache.placed("e1", blocks)
    assert b.judge(request(system + " q"), fleet, 5.0).prefer is fleet[1]
    # e1's answer to A says it held none of it: A's picture drops it, and tells.
    plan = a.judge(request(system + " q"), fleet, 5.0)
    a_cache.reported("e1", blocks, plan.expected["e1"], 0, plan.expected["e1"].sized)
    assert [(d.engine, d.keep) for d in told] == [("e1", 0)]
    for d in told:
        b.evicted_elsewhere(d)
    assert "e1" not in b.judge(request(system + " q"), fleet, 5.0).expected


def _waiting_here(f: Fleet) -> tuple[Exchange, Elsewhere, Judge, Lease]:
    """One engine whose short stream keeps a long prefill out (room when it ends), a judge
    whose waits the other active routers are told of, and what it holds of router b."""
    f.learn_tau0(0.02)
    short = f.open(request(words("s", 10), max_tokens=5), on="e0")
    short.first_output()
    metrics = RouterMetrics()
    elsewhere = Elsewhere(f.pool, f.admission, f.policy, Tenants([], metrics), metrics)
    exchange = Exchange(Leadership(None, "a"), f.policy, elsewhere, metrics, "secret", 60)
    return exchange, elsewhere, Judge(f.policy, f.pool, lambda: None, waiters=exchange), short


def _plan_once_room_comes(f: Fleet, judge: Judge, short: Lease) -> Plan:
    """A long prompt waits for pace on e0 until `short`'s stream there ends: its plan."""

    async def run() -> Plan:
        waiting = asyncio.create_task(
            judge.plan(request(words("L", 1000)), time.monotonic(), BUDGET)
        )
        await asyncio.sleep(0)
        short.finished(5)
        short.release()
        return await asyncio.wait_for(waiting, 10)

    return f.loop.run_until_complete(run())


def test_room_goes_first_to_the_fleets_oldest_waiter() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    exchange, elsewhere, judge, short = _waiting_here(f)
    # Router b has had a standard request of a short prompt waiting for pace for a second.
    elsewhere.snapshot(Snapshot("b", 5, 1, [], [], [], [(1, 2, 500, 1.0)]))
    yields = exchange.metrics.peer_yields

    async def run() -> Plan:
        # 0.8 s of its budget left after its own second of prefill: time to wait a little.
        arrived = time.monotonic() - (BUDGET - 1.8)
        waiting = asyncio.create_task(judge.plan(request(words("L", 1000)), arrived, BUDGET))
        await asyncio.sleep(0)
        short.finished(5)
        short.release()  # room on e0: this router heard first (it relayed the stream)
        while not yields._value.get():
            await asyncio.sleep(0.001)
        # While this one gives way, b's older request takes the room: a short answer whose
        # stream a second of prefill beside it would break.
        placed = Placed(2, "e0", 100, None, None, None, 0.1, 5, 1, 5, None)
        assert elsewhere.batch(Batch("b", 5, 1, [placed, First(2), Waited(1)])) is None
        return await asyncio.wait_for(waiting, 10)

    with pytest.raises(ApiError) as refused:
        f.loop.run_until_complete(asyncio.wait_for(run(), 10))
    assert refused.value.code == "tpot_target_exceeded"  # its wait ran out behind b's
    assert yields._value.get() == 1


def test_a_waiter_gives_way_once_then_takes_room_nobody_older_took() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    exchange, elsewhere, judge, short = _waiting_here(f)
    elsewhere.snapshot(Snapshot("b", 5, 1, [], [], [], [(1, 2, 500, 1.0)]))  # never placed

    assert _plan_once_room_comes(f, judge, short).prefer is f.engines[0]
    assert exchange.metrics.peer_yields._value.get() == 1
    # Its wait was told, and its end: a snapshot for the others holds no waiter of it.
    assert exchange._snapshot().waiting == []


def test_room_is_not_given_to_an_older_waiter_it_would_not_fit() -> None:
    f = Fleet(n=1, tpot_target_s=0.05)
    exchange, elsewhere, judge, short = _waiting_here(f)
    # b's older request is of a longer prompt: room for this one is not room for it.
    elsewhere.snapshot(Snapshot("b", 5, 1, [], [], [], [(1, 2, 10**6, 1.0)]))

    assert _plan_once_room_comes(f, judge, short).prefer is f.engines[0]
    assert exchange.metrics.peer_yields._value.get() == 0


def test_answers_another_router_relayed_in_full_teach_this_routers_lengths() -> None:
    a = Fleet(n=1, tpot_target_s=0.05, answers_seen=False)
    b = Fleet(n=1, tpot_target_s=0.05, answers_seen=False)
    metrics = RouterMetrics()
    a_elsewhere = Elsewhere(a.pool, a.admission, a.policy, Tenants([], metrics), metrics)
    exchange = Exchange(Leadership(None, "a"), a.policy, a_elsewhere, metrics, "secret", 60)
    exchange.watch(a.events)
    box = exchange.outboxes["b"] = Outbox("b", "http://b")
    box.resync = False  # b holds this term's picture: what follows goes as deltas
    e0 = a.engines[0]

    def relay(i: int, answered: bool) -> None:
        req = request(words(f"q{i}", 10))
        plan = Plan(e0, a.predictor.size(req.prompt_bytes, e0), None)
        lease = a.open(req, on="e0", plan=plan)
        exchange.placed(lease, plan)
        lease.first_output()
        if answered:
            lease.finished(8 + 4 * i)
        else:
            lease.measured.output_tokens = 3  # its client left: three tokens, no end of text
        lease.release()

    for i in range(MIN_SAMPLES):
        relay(i, answered=True)
    relay(MIN_SAMPLES, answered=False)
    # Router b folds what a told, as it travels.
    b_metrics = RouterMetrics()
    b_elsewhere = Elsewhere(b.pool, b.admission, b.policy, Tenants([], b_metrics), b_metrics)
    b_elsewhere.snapshot(Snapshot("a", 5, 1, [], [], []))
    told = [d for _, _, d in box.pending]
    assert told
    batch, _ = decode(encode_batch(Batch("a", 5, 1, told)))
    assert isinstance(batch, Batch)
    assert b_elsewhere.batch(batch) is None
    # b never relayed an answer, and holds a new stream to what a's answers ran to (the
    # cut one says nothing of its length), as a does: its /ready says so.
    assert a.policy.lengths.describe()["ended"] == MIN_SAMPLES
    assert b.policy.lengths.describe() == a.policy.lengths.describe()


def _one_of_three(share: bool) -> tuple[Fleet, Exchange]:
    """One engine whose stream leaves about 5 s of prefill room, judged by a router that
    has two active peers (told, with `share`, to spend only its share of unheard room)."""
    f = Fleet(n=1, tpot_target_s=0.05)
    f.learn_tau0(0.02)
    f.open(request(words("s", 10), max_tokens=200), on="e0").first_output()
    metrics = RouterMetrics()
    elsewhere = Elsewhere(f.pool, f.admission, f.policy, Tenants([], metrics), metrics)
    exchange = Exchange(Leadership(None, "a"), f.policy, elsewhere, metrics, "secret", 60)
    for peer in ("b", "c"):
        exchange.outboxes[peer] = Outbox(peer, f"http://{peer}")
    if share:
        f.policy.share_headroom(exchange)
    return f, exchange


@pytest.mark.parametrize("share", [True, False])
def test_a_burst_at_one_router_spends_only_its_share_of_an_engines_room(share: bool) -> None:
    f, exchange = _one_of_three(share)
    # A prompt whose prefill takes two fifths of the room: more than a third, but the
    # first placement the others have not heard of may take what fits.
    big = request(words("a", 2000))
    plan = f.judge(big)
    assert plan.prefer is f.engines[0]
    exchange.placed(f.open(big, on="e0", plan=plan), plan)
    # A second one at once would fit what is left, but the other two routers may be
    # filling the same room this moment: it waits for the others to hear (or a stream to
    # end) rather than spend more than this router's third.
    small = request(words("b", 500))
    if not share:
        assert f.judge(small).prefer is f.engines[0]
        return
    with pytest.raises(NoEngineKeepsPace):
        f.judge(small)

    # Once both peers acknowledge (their answers are the process boundary), they hold the
    # first placement, judge by it, and the second one fits what is left.
    async def acknowledged(box: Outbox, body: bytes) -> int:
        return 200

    exchange._post = acknowledged  # type: ignore[method-assign]
    exchange._term = 5  # this router's term, as its member key's lease proved

    async def heard() -> None:
        boxes = list(exchange.outboxes.values())
        senders = [asyncio.create_task(exchange._send_forever(b)) for b in boxes]
        while min(b.heard for b in boxes) < 1:  # the placement was this term's first delta
            await asyncio.sleep(0)
        for t in senders:
            t.cancel()
        await asyncio.gather(*senders, return_exceptions=True)

    f.loop.run_until_complete(asyncio.wait_for(heard(), 10))
    assert f.judge(small).prefer is f.engines[0]
