"""What the router says of itself: `/health`, `/ready`, `/v1/models`, `/engines`, `/metrics`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import generate_latest

from narwhal import asgi
from narwhal.asgi import Send
from narwhal.errors import ApiError

if TYPE_CHECKING:
    from narwhal.background import Background
    from narwhal.router.admission import Admission
    from narwhal.router.config import RouterConfig
    from narwhal.router.engines import Pool
    from narwhal.router.fleet.wiring import Fleet
    from narwhal.router.ha.leadership import Leadership
    from narwhal.router.ha.maintenance import Maintenance
    from narwhal.router.metrics import RouterMetrics
    from narwhal.router.models import Catalog
    from narwhal.router.pipeline.gate import Gate
    from narwhal.router.policies import Policy
    from narwhal.router.predict import Predictor

ROUTES = frozenset({"/health", "/ready", "/v1/models", "/engines", "/metrics"})


class Router(Protocol):
    """What the routes read of the router (`app.Router`): declared here, so they sit below
    the app that serves them."""

    config: RouterConfig
    admission: Admission
    background: Background
    catalog: Catalog
    fleet: Fleet
    gate: Gate
    leadership: Leadership
    maintenance: Maintenance
    metrics: RouterMetrics
    policy: Policy
    pool: Pool
    predictor: Predictor | None


class Status:
    def __init__(self, router: Router) -> None:
        self.router = router  # read, never written: its config changes on a reload

    async def answer(self, path: str, method: str, send: Send) -> None:
        """A GET route's answer; 405 for another method, 404 for a path that is none."""
        if path.startswith("/v1/models/"):
            if method != "GET":
                raise asgi.method_not_allowed(method, path, "GET")
            model = self.router.catalog.entry(path[len("/v1/models/") :])
            await asgi.send_json(send, 200, model)
            return
        if path not in ROUTES:
            raise ApiError(404, f"no route {method} {path}", code="not_found")
        if method != "GET":
            raise asgi.method_not_allowed(method, path, "GET")
        r = self.router
        if path == "/health":
            await asgi.send_json(send, 200, {"status": "ok"})
        elif path == "/ready":
            await self._ready(send)
        elif path == "/v1/models":
            await asgi.send_json(
                send, 200, {"object": "list", "data": self.router.catalog.listed()}
            )
        elif path == "/engines":
            await asgi.send_json(
                send, 200, {"engines": [e.describe(False) for e in r.pool.engines]}
            )
        else:
            r.metrics.refresh(r.pool, r.admission, r.predictor)
            await asgi.send_bytes(
                send, 200, generate_latest(r.metrics.registry), b"text/plain; version=0.0.4"
            )

    async def _ready(self, send: Send) -> None:
        r = self.router
        engines = [e.describe(False) for e in r.pool.engines]
        body: dict[str, Any] = {
            "ready": False,
            "admission": self.router.config.admission,
            "leadership": r.leadership.describe(),
            "maintenance": sorted(r.maintenance.wave),
            "engines": engines,
        }
        down = r.gate.unavailable()
        reason = down[1] if down else None
        if reason is None and not r.pool.eligible():
            reason = "no placement-eligible engine"
        if r.predictor is not None:
            body["projection"] = r.predictor.describe()
            for e in engines:
                prof = r.predictor.profiles[str(e["name"])]
                e["profile"] = {**prof.describe(), "margin": r.predictor.margin(prof)}
                own = r.predictor.models.get(str(e["name"]))
                if own:
                    e["model_profiles"] = {m: p.describe() for m, p in own.items()}
        pace = r.policy.describe()
        if pace is not None:
            body["lengths"] = pace["lengths"]
            for e in engines:
                e["pace"] = pace["engines"].get(str(e["name"]))
        body["ready"] = reason is None
        if reason is not None:
            body["reason"] = reason
        if r.fleet.reloader.error is not None:
            body["reload_error"] = r.fleet.reloader.error  # the running config stays
        stale = r.fleet.stale()
        if stale:
            body["engines_from_stale"] = stale  # the last good set serves meanwhile
        failing = r.background.failing()
        if failing:
            body["background_failing"] = failing
        await asgi.send_json(send, 200 if reason is None else 503, body)
