"""The gate on its own, in process: whether this router takes a request now (the spec's last
refusal row: a retryable 503 for standby, fenced, whole-wave maintenance and
monitoring-degraded), and which engines cannot serve a request (its route's dialect, its
model). No sockets: the stages around it have tests of their own, and end-to-end tests
drive the whole router."""

from __future__ import annotations

import time

import orjson
import pytest

from narwhal.errors import ApiError
from narwhal.router.config import EngineSpec, RouterConfig
from narwhal.router.endings import End
from narwhal.router.engines import Engine, Pool
from narwhal.router.ha.leadership import Leadership, Role
from narwhal.router.ha.maintenance import Maintenance
from narwhal.router.models import Catalog
from narwhal.router.pipeline import intake
from narwhal.router.pipeline.gate import Gate
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.predict import Predictor
from narwhal.router.request import CHAT, RESPONSES, Request
from tests.support import measured


def gate(*specs: EngineSpec, model: str = "main") -> tuple[Gate, Predictor]:
    engines = [Engine(s, f"http://{s.name}", healthy=True) for s in specs]
    pool = Pool(engines, 4, 4)
    config = RouterConfig(engines=tuple(specs), model=model)
    predictor = Predictor(engines)
    for p in predictor.profiles.values():
        measured(p, 1000.0, 4.0)
        p.measured_at = time.monotonic()
    policy = PredictivePolicy(predictor, engines, None, None, None, 5.0)
    catalog = Catalog(pool, lambda: config)
    return Gate(Leadership(None), Maintenance(pool), pool, policy, catalog), predictor


def request(route: str, g: Gate, model: str | None = None) -> Request:
    body: dict[str, object] = (
        {"input": "hi"} if route == RESPONSES else {"messages": [{"role": "user", "content": "hi"}]}
    )
    if model is not None:
        body["model"] = model
    return intake.check(route, orjson.dumps(body), g.catalog.resolve)


def refused(g: Gate) -> ApiError:
    with pytest.raises(ApiError) as e:
        g.check()
    return e.value


def test_a_router_that_leads_with_engines_to_place_on_takes_work() -> None:
    g, _ = gate(EngineSpec("a"), EngineSpec("b"))
    g.check()
    assert g.unavailable() is None


def test_standby_fenced_maintenance_and_degraded_are_each_a_retryable_503() -> None:
    g, predictor = gate(EngineSpec("a"), EngineSpec("b"))
    for role, reason in ((Role.STANDBY, "standby: campaigning"), (Role.FENCED, "fenced: x")):
        g.leadership.role, g.leadership.reason = role, reason
        e = refused(g)
        assert (e.status, e.code, e.cause) == (503, role.value, End(("rejected", role.value)))
        assert e.headers == {"retry-after": "1"}
    g.leadership.role = Role.LEADER
    g.pool.maintenance = frozenset({"a"})
    g.check()  # part of the fleet in the wave: the rest serves
    g.pool.maintenance = frozenset({"a", "b"})
    e = refused(g)
    assert (e.status, e.code, e.cause) == (503, "maintenance", End.MAINTENANCE)
    g.pool.maintenance = frozenset()
    for p in predictor.profiles.values():  # every engine's projections 3x off, many times
        p.drift, p.drift_samples = 1.2, 10
    e = refused(g)
    assert (e.status, e.code) == (503, "monitoring_degraded")
    assert "prediction drift 1.20" in e.message


def test_engines_that_cannot_serve_a_request_are_named_once_for_judge_and_placement() -> None:
    g, _ = gate(
        EngineSpec("old", dialect="sglang", models=("chat",)),
        EngineSpec("new", dialect="lexi", models=("chat",)),
        EngineSpec("coder", dialect="vllm", models=("code",)),
        model="chat",
    )
    assert g.cannot_serve(request(CHAT, g)) == {"coder"}
    assert g.cannot_serve(request(CHAT, g, "code")) == {"old", "new"}
    # The Responses route: the dialect that cannot serve it, and the model's other engines.
    assert g.cannot_serve(request(RESPONSES, g)) == {"old", "coder"}


def test_a_route_no_engine_s_dialect_serves_is_404_not_a_wait() -> None:
    g, _ = gate(EngineSpec("s", dialect="sglang"))
    with pytest.raises(ApiError) as e:
        g.cannot_serve(request(RESPONSES, g))
    assert (e.value.status, e.value.code, e.value.cause) == (404, "unsupported", End.INVALID)
