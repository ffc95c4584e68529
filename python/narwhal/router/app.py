"""The router's ASGI application: routes, the request lifecycle, and start-up/shut-down."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client import generate_latest

from narwhal import asgi, bearer, logs, service, silent
from narwhal.asgi import Receive, Scope, Send
from narwhal.background import Background
from narwhal.errors import ApiError
from narwhal.etcd import EtcdError
from narwhal.router import admin as admin_api
from narwhal.router.admission import Admission
from narwhal.router.config import RouterConfig
from narwhal.router.engines import Engine, Pool
from narwhal.router.fleet.wiring import Fleet
from narwhal.router.ha.leadership import Leadership
from narwhal.router.ha.maintenance import Maintenance
from narwhal.router.ha.profiles import SharedProfiles
from narwhal.router.ha.tenant_windows import SharedTenantWindows
from narwhal.router.lease import Events
from narwhal.router.metrics import RouterMetrics
from narwhal.router.pipeline import intake
from narwhal.router.pipeline.flow import Flow
from narwhal.router.pipeline.gate import Gate, Unavailable
from narwhal.router.pipeline.judge import Judge
from narwhal.router.pipeline.place import Placer
from narwhal.router.policies.choose import choose
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.predict import Predictor
from narwhal.router.profiling import Profiler
from narwhal.router.relay.relayer import Relayer
from narwhal.router.supervisor import ManagedEngine
from narwhal.router.tenants.registry import Tenants, client_keys

log = logging.getLogger("narwhal.router")
access_log = logging.getLogger("narwhal.access")

COMPLETION_ROUTES = (intake.CHAT, intake.COMPLETION, intake.RESPONSES)
GET_ROUTES = frozenset({"/health", "/ready", "/v1/models", "/engines", "/metrics"})


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.pool = _pool(config, self.metrics)
        engines = self.pool.engines
        self.managed = [e.managed for e in engines if e.managed is not None]
        # What happens to each lease reaches these three, subscribed here once.
        events = Events()
        self.admission = Admission(
            self.pool, config.http_retention_limit, config.queue_size, config.queue_wait_s, events
        )
        self.predictor = (
            Predictor(engines, config.drift_bound, config.drift_min_samples, config.stale_after_s)
            if config.admission == "predictive"
            else None
        )
        self.policy = choose(config, engines, self.predictor)
        self.pool.watch(events)
        self.metrics.watch(events)
        self.policy.watch(events)
        paths = {p: self.metrics.relayed_streams.labels(p) for p in ("native", "awaited")}
        self.relayer = Relayer(
            config.stream_idle_timeout_s, config.native_relay, lambda path: paths[path].inc()
        )
        keys, self.key_tenants = client_keys(config)
        self.client_keys = tuple(k.encode() for k in keys)
        self.tenants = Tenants(
            list(config.tenant_keys), self.metrics.tenant_requests, self.metrics.tenant_tokens
        )
        ha = config.ha
        self.leadership = Leadership(ha)
        self.maintenance = Maintenance(
            self.pool, self.leadership.etcd, ha.sibling("maintenance") if ha else None
        )
        self.profiles: SharedProfiles | None = None
        if ha is not None and self.predictor is not None:
            self.profiles = SharedProfiles(ha, self.leadership, self.predictor)
        self.tenant_windows: SharedTenantWindows | None = None
        if ha is not None and config.tenant_keys:
            self.tenant_windows = SharedTenantWindows(ha, self.leadership, self.tenants)
        self.leadership.on_lead = self._take_over
        self.leadership.reaches = lambda: any(e.healthy for e in self.pool.engines)
        self.leadership.on_step_aside = self._turn_away
        self.gate = Gate(self.leadership, self.maintenance, self.pool, self.policy)
        self.judge = Judge(self.policy, self.pool, self.metrics.paced_waits.inc)
        self.fleet = Fleet(
            config,
            self.pool,
            self.policy,
            self.relayer,
            self.metrics,
            self.leadership,
            self._settings,
        )
        self.membership = self.fleet.membership
        token = os.environ.get(config.admin_token_env, "") if config.admin_token_env else ""
        self.admin = (
            admin_api.Admin(token, self.maintenance, self.fleet.admin, self.reload)
            if token
            else None
        )
        from narwhal import __version__

        self.metrics.info.labels(config.model, __version__).set(1)
        self.placer = Placer(
            self.admission,
            self.pool,
            self.gate,
            self.policy,
            self.relayer,
            self.metrics.queue_time.labels(config.model),
        )
        self.flow = Flow(
            config, self.metrics, self.admission, self.gate, self.judge, self.placer, self.tenants
        )
        self.background = Background(self.metrics.background_errors)
        self.session: aiohttp.ClientSession | None = None

    def reload(self) -> str | None:
        """The config file read again (SIGHUP, POST /admin/reload); why it was refused."""
        return self.fleet.reloader.reload()

    def _settings(self, new: RouterConfig) -> None:
        """A reloaded config's settings, for requests from now on."""
        self.config = self.flow.config = new
        a = self.admission
        a.retention_limit, a.queue_size, a.wait_s = (
            new.http_retention_limit,
            new.queue_size,
            new.queue_wait_s,
        )
        self.pool.prefill_limit, self.pool.decode_limit = (
            new.prefill_concurrency,
            new.decode_concurrency,
        )
        self.pool.eject_after = new.eject_after
        self.membership.drain_timeout_s = new.drain_timeout_s
        self.relayer.idle_s = new.stream_idle_timeout_s
        if isinstance(self.policy, PredictivePolicy):
            self.policy.tpot_target_s = new.tpot_target_s
        self.pool.notify()  # a larger queue or more seats may take waiting requests

    # -- lifecycle ----------------------------------------------------------------------
    async def startup(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        for me in self.managed:
            await me.start()
        c, bg, session = self.config, self.background, self.session
        bg.start(
            "health_probes",
            lambda: self.pool.probe_forever(session, c.health_interval_s, c.health_timeout_s),
        )
        bg.start("queue_drain", self.admission.drain_forever)
        self.fleet.start(bg)
        bg.start("leadership", self.leadership.run_forever)
        bg.start("maintenance_follower", self.maintenance.follow_forever)
        if self.profiles is not None:
            bg.start("profile_sharing", self.profiles.publish_forever)
        if self.tenant_windows is not None:
            bg.start("tenant_window_sharing", self.tenant_windows.publish_forever)
        service.on_stop_signal(lambda: asyncio.ensure_future(self._resign()))
        service.on_reload_signal(self.reload)
        bg.start(
            "silent_reaper",
            lambda: silent.close_silent_forever(c.header_timeout_s, self.metrics.silent_closed.inc),
        )
        if self.predictor is not None:
            profiler = Profiler(
                c.model,
                self.pool,
                self.admission,
                self.predictor,
                self.relayer,
                c.probe_interval_s,
                self.gate.degraded,
                self.leadership,
            )
            bg.start("profiling", profiler.run_forever)
            self.pool.on_healthy.append(lambda e: profiler.wake())

    async def _take_over(self) -> None:
        """Before a new leader's first placement: the wave and the last leader's profiles
        as they are in etcd now."""
        try:
            await self.maintenance.refresh()
        except (EtcdError, ValueError) as e:
            log.warning("the maintenance wave could not be read on taking the lead: %s", e)
        if self.profiles is not None:
            await self.profiles.take_over()
        if self.tenant_windows is not None:
            await self.tenant_windows.take_over()

    async def _resign(self) -> None:
        """Stop leading at once; those waiting in the queue are told to retry (elsewhere)."""
        await self.leadership.resign()
        self._turn_away()

    def _turn_away(self) -> None:
        lead = self.leadership
        self.admission.turn_away(lambda: Unavailable(lead.role.value, lead.reason))

    async def shutdown(self) -> None:
        await self._resign()
        await self.background.stop()
        await asyncio.gather(*(me.stop() for me in self.managed))
        self.relayer.close()
        await self.leadership.close()
        await self.fleet.close()
        if self.session is not None:
            await self.session.close()

    # -- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send, self.startup, self.shutdown)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        rec = asgi.begin(scope)
        started = time.monotonic()
        try:
            await asgi.in_envelope(
                send, self._route(path, method, scope, receive, send), log, f"{method} {path}"
            )
        finally:
            if path in COMPLETION_ROUTES:
                self.metrics.answered(
                    self.config.model, path, rec.status, time.monotonic() - started
                )
            if path in COMPLETION_ROUTES or rec.status >= 400 or path.startswith("/admin/"):
                logs.access(access_log, method, path, rec, started)

    async def _route(
        self, path: str, method: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        tenant = None
        if self.client_keys and path.startswith("/v1/"):
            tenant = self.key_tenants[bearer.match(scope, self.client_keys)]
        if path in COMPLETION_ROUTES:
            if method != "POST":
                raise asgi.method_not_allowed(method, path, "POST")
            await self.flow(path, scope, receive, send, tenant)
        elif self.admin is not None and admin_api.routes(path):
            await self.admin.handle(scope, receive, send)
        elif path.startswith("/v1/models/"):
            if method != "GET":
                raise asgi.method_not_allowed(method, path, "GET")
            await asgi.send_json(send, 200, self._model(path[len("/v1/models/") :]))
        elif path not in GET_ROUTES:
            raise ApiError(404, f"no route {method} {path}", code="not_found")
        elif method != "GET":
            raise asgi.method_not_allowed(method, path, "GET")
        elif path == "/health":
            await asgi.send_json(send, 200, {"status": "ok"})
        elif path == "/ready":
            await self._ready(send)
        elif path == "/v1/models":
            await asgi.send_json(send, 200, {"object": "list", "data": [self._model()]})
        elif path == "/engines":
            await asgi.send_json(send, 200, {"engines": [e.describe() for e in self.pool.engines]})
        elif path == "/metrics":
            self.metrics.refresh(self.pool, self.admission, self.predictor)
            await asgi.send_bytes(
                send, 200, generate_latest(self.metrics.registry), b"text/plain; version=0.0.4"
            )
        else:
            raise ApiError(404, f"no route {method} {path}", code="not_found")

    def _model(self, model_id: str | None = None) -> dict[str, Any]:
        """The one model the router serves (`GET /v1/models/{id}`: it, or 404)."""
        if model_id is not None and model_id != self.config.model:
            raise ApiError(
                404,
                f"The model '{model_id[:200]}' does not exist",
                param="model",
                code="model_not_found",
            )
        return {"id": self.config.model, "object": "model", "created": 0, "owned_by": "narwhal"}

    async def _ready(self, send: Send) -> None:
        engines = [e.describe() for e in self.pool.engines]
        body: dict[str, Any] = {
            "ready": False,
            "admission": self.config.admission,
            "leadership": self.leadership.describe(),
            "maintenance": sorted(self.maintenance.wave),
            "engines": engines,
        }
        down = self.gate.unavailable()
        reason = down[1] if down else None
        if reason is None and not self.pool.eligible():
            reason = "no placement-eligible engine"
        if self.predictor is not None:
            for e in engines:
                e["profile"] = self.predictor.profiles[str(e["name"])].describe()
        body["ready"] = reason is None
        if reason is not None:
            body["reason"] = reason
        if self.fleet.reloader.error is not None:
            body["reload_error"] = self.fleet.reloader.error  # the running config stays
        stale = self.fleet.stale()
        if stale:
            body["engines_from_stale"] = stale  # the last good set serves meanwhile
        failing = self.background.failing()
        if failing:
            body["background_failing"] = failing
        await asgi.send_json(send, 200 if reason is None else 503, body)


def _pool(config: RouterConfig, metrics: RouterMetrics) -> Pool:
    """The config file's engines: called, or launched and supervised here."""
    engines = []
    for spec in config.engines:
        if spec.launch is not None:
            me = ManagedEngine(spec, config.model, on_fatal=_fatal)
            engines.append(Engine(spec, me.url, managed=me))
        else:
            assert spec.url is not None
            key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
            engines.append(Engine(spec, spec.url.rstrip("/"), api_key=key))
    pool = Pool(engines, config.prefill_concurrency, config.decode_concurrency, config.eject_after)
    for e in engines:
        if e.managed is not None:
            e.managed.on_exit = _exited(pool, e, metrics.engine_restarts.labels(e.name))
    return pool


def _exited(pool: Pool, engine: Engine, restarts: Any) -> Callable[[str], None]:
    """A managed engine's process ended: counted, and out of placement at once rather than
    at the next health probe (until then /ready would call a dead engine ready)."""

    def exited(_: str) -> None:
        restarts.inc()
        pool.process_exited(engine)

    return exited


def _fatal(report: str) -> None:
    """A managed engine can never start: the router stops with the engine's own words.
    The worker exits at once; Granian's main process then ends with this status, and the
    other managed engines follow (each dies with this process, see supervisor)."""
    print(f"narwhal: error: {report}", file=sys.stderr, flush=True)
    os._exit(FATAL_EXIT)


FATAL_EXIT = 3


CONFIG_ENV = "NARWHAL_ROUTER_CONFIG_FILE"


def create_app() -> Router:
    """Granian factory: the CLI validated the config and handed it off (service.hand_off)."""
    service.guard_worker()
    logs.setup()
    config = RouterConfig.from_json(service.taken_over(CONFIG_ENV))
    return Router(config)
