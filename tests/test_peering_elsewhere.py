"""The other active routers' work folded into this router's picture (router/peering/
elsewhere.py), in process: what a peer placed holds a seat here and what it let in counts
against its tenant, and both are let go however that peer's work ends, a lost delta
included."""

from __future__ import annotations

from narwhal.router.admission import Admission
from narwhal.router.config import EngineSpec, TenantKey
from narwhal.router.engines import Engine, Pool
from narwhal.router.metrics import RouterMetrics
from narwhal.router.peering.elsewhere import Elsewhere
from narwhal.router.peering.wire import Admitted, Batch, Ended, Placed, Snapshot
from narwhal.router.policies import least_loaded
from narwhal.router.policies.open import OpenPolicy
from narwhal.router.tenants.registry import Tenants


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
