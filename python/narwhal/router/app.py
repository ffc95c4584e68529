"""The router's ASGI application: routes, the request lifecycle, and start-up/shut-down."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp

from narwhal import asgi, bearer, logs, service, silent
from narwhal.asgi import Receive, Scope, Send
from narwhal.background import Background
from narwhal.etcd import EtcdError
from narwhal.router import admin as admin_api
from narwhal.router.admission import Admission
from narwhal.router.config import RouterConfig
from narwhal.router.decisions import Decisions
from narwhal.router.fleet.reload import settle
from narwhal.router.fleet.wiring import Fleet, pool_of
from narwhal.router.ha.leadership import Leadership
from narwhal.router.ha.maintenance import Maintenance
from narwhal.router.ha.profiles import SharedProfiles
from narwhal.router.ha.tenant_windows import SharedTenantWindows
from narwhal.router.lease import Events
from narwhal.router.metrics import RouterMetrics
from narwhal.router.models import Catalog
from narwhal.router.peering.elsewhere import Elsewhere
from narwhal.router.peering.exchange import PATH as PEERING_PATH
from narwhal.router.peering.exchange import Exchange
from narwhal.router.peering.wire import seed_of
from narwhal.router.pipeline.flow import Flow
from narwhal.router.pipeline.gate import Gate, not_leading, not_taking
from narwhal.router.pipeline.judge import Judge
from narwhal.router.pipeline.place import Placer
from narwhal.router.policies.choose import choose
from narwhal.router.predict import Predictor
from narwhal.router.profiling import Profiler
from narwhal.router.relay.relayer import Relayer
from narwhal.router.request import ROUTES
from narwhal.router.status import Status
from narwhal.router.tenants.registry import Tenants, client_keys
from narwhal.router.warming import Warmer
from narwhal.telemetry import tracing_of

log = logging.getLogger("narwhal.router")
access_log = logging.getLogger("narwhal.access")

COMPLETION_ROUTES = ROUTES


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.pool = pool_of(config, self.metrics)
        self.catalog = Catalog(self.pool, lambda: self.config)
        engines = self.pool.engines
        self.managed = [e.managed for e in engines if e.managed is not None]
        # What happens to each lease reaches these three, subscribed here once.
        events = Events()
        self.predictor = (
            Predictor(engines, config.drift_bound, config.drift_min_samples, config.stale_after_s)
            if config.admission == "predictive"
            else None
        )
        self.tenants = Tenants(
            list(config.tenant_keys), self.metrics, config.critical_reserve, config.ttft_budget_s
        )
        ha = config.ha
        peer_secret = (
            os.environ.get(ha.peer_secret_env, "")
            if ha and ha.active and ha.peer_secret_env
            else ""
        )
        self.policy = choose(
            config,
            engines,
            self.predictor,
            self.tenants.reserve,
            seed_of(peer_secret) if peer_secret else None,
        )
        self.admission = Admission(
            self.pool,
            config.http_retention_limit,
            config.queue_size,
            config.queue_wait_s,
            events,
            instead=self.policy.instead,
        )
        if self.predictor is not None:
            self.admission.overrun = self.policy.overrun  # the queue holds the TTFT budget
        events.subscribe(finished=self.pool.answered, fault=self.pool.faulted)
        self.metrics.watch(events)
        self.policy.watch(events)
        paths = {p: self.metrics.relayed_streams.labels(p) for p in ("native", "awaited")}
        secret = os.environ.get(ha.fence_secret_env) if ha and ha.fence_secret_env else None
        self.relayer = Relayer(
            config.stream_idle_timeout_s,
            config.native_relay,
            lambda path: paths[path].inc(),
            secret,
        )
        keys, self.key_tenants = client_keys(config)
        self.client_keys = tuple(k.encode() for k in keys)
        self._ha(config)
        self.exchange = self._active(config, peer_secret, events) if peer_secret else None
        self.gate = Gate(self.leadership, self.maintenance, self.pool, self.policy, self.catalog)
        self.warmer = (
            Warmer(
                self.policy,
                self.pool,
                self.admission,
                self.relayer,
                self.leadership,
                self.metrics.warmed,
            )
            if self.predictor is not None and config.warm_refused
            else None
        )
        self.judge = Judge(
            self.policy,
            self.pool,
            self.metrics.paced_waits.inc,
            self.warmer.offer if self.warmer is not None else None,
            self.warmer.yield_all if self.warmer is not None else None,
            self.exchange,
        )
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
        # Decision records are read on the admin API: kept only where there is one.
        self.decisions = (
            Decisions(config.decision_records) if token and config.decision_records else None
        )
        self.admin = (
            admin_api.Admin(token, self.maintenance, self.fleet.admin, self.reload, self.decisions)
            if token
            else None
        )
        from narwhal import __version__

        self.metrics.info.labels(config.model, __version__).set(1)
        self.metrics.targets(config.ttft_budget_s, config.tpot_target_s)
        self.metrics.serving(config.model)
        c = config
        self.tracing = tracing_of(
            c.otlp_endpoint, c.otel_service_name, c.otel_sample_ratio, "narwhal.router"
        )
        self.flow = self._flow(config)
        self.background = Background(self.metrics.background_errors)
        self.status = Status(self)
        self.session: aiohttp.ClientSession | None = None
        self.profiler: Profiler | None = None

    def _ha(self, config: RouterConfig) -> None:
        """Leadership, the maintenance wave, and what a new leader takes over."""
        ha = config.ha
        self.leadership = Leadership(ha)
        self.maintenance = Maintenance(
            self.pool, self.leadership.etcd, ha.sibling("maintenance") if ha else None
        )
        self.profiles: SharedProfiles | None = None
        # Active routers take each other's profiles and windows from the exchange instead.
        if ha is not None and not ha.active and self.predictor is not None:
            self.profiles = SharedProfiles(ha, self.leadership, self.predictor)
        self.tenant_windows: SharedTenantWindows | None = None
        if ha is not None and not ha.active and config.tenant_keys:
            self.tenant_windows = SharedTenantWindows(ha, self.leadership, self.tenants)
        self.leadership.on_lead = self._take_over
        self.leadership.reaches = lambda: any(e.healthy for e in self.pool.engines)
        self.leadership.on_step_aside = self._turn_away

    def _active(self, config: RouterConfig, secret: str, events: Events) -> Exchange:
        """`ha.mode: active`: this router's picture exchange with the others."""
        ha = config.ha
        assert ha is not None
        advertised = os.environ.get(ha.advertise_url_env, "") if ha.advertise_url_env else ""
        self.leadership.url = (
            advertised or ha.advertise_url or f"http://{config.host}:{config.port}"
        ).rstrip("/")
        self.relayer.fencing_as(self.leadership.name)
        elsewhere = Elsewhere(self.pool, self.admission, self.policy, self.tenants, self.metrics)
        exchange = Exchange(
            self.leadership, self.policy, elsewhere, self.metrics, secret, config.request_timeout_s
        )
        exchange.watch(events)
        self.tenants.told = exchange
        self.policy.tell_evictions(exchange.evicted)
        self.policy.share_headroom(exchange)
        return exchange

    def _flow(self, config: RouterConfig) -> Flow:
        """The stages a completion request goes through, in order."""
        self.placer = Placer(
            self.admission,
            self.pool,
            self.gate,
            self.policy,
            self.relayer,
            self.metrics.queue_time,
            self.tenants,
            self.warmer.yield_to if self.warmer is not None else None,
            self.exchange.placed if self.exchange is not None else None,
        )
        return Flow(
            config,
            self.metrics,
            self.admission,
            self.gate,
            self.judge,
            self.placer,
            self.tenants,
            self.decisions,
            self.tracing,
        )

    def reload(self) -> str | None:
        """The config file read again (SIGHUP, POST /admin/reload); why it was refused."""
        return self.fleet.reloader.reload()

    def _settings(self, new: RouterConfig) -> None:
        """A reloaded config's settings, for requests from now on."""
        self.config = self.flow.config = new
        self.metrics.targets(new.ttft_budget_s, new.tpot_target_s)
        self.metrics.serving(new.model)
        settle(
            new,
            self.admission,
            self.pool,
            self.membership,
            self.relayer,
            self.policy,
            self.tenants,
            self.predictor,
            self.profiler,
        )

    # -- lifecycle ----------------------------------------------------------------------
    async def startup(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        for me in self.managed:
            await me.start()
        c, bg, session = self.config, self.background, self.session
        bg.start(
            "health_probes",
            lambda: self.pool.probe_forever(
                session, self.config.health_interval_s, self.config.health_timeout_s
            ),
        )
        bg.start("queue_drain", self.admission.drain_forever)
        self.fleet.start(bg)
        bg.start("leadership", self.leadership.run_forever)
        bg.start("maintenance_follower", self.maintenance.follow_forever)
        if self.exchange is not None:
            self.exchange.start(session)
            bg.start("picture_exchange", self.exchange.run_forever)
            bg.start("picture_progress", self.exchange.progress_forever)
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
            self.profiler = profiler = Profiler(
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
        if self.warmer is not None:
            bg.start("warming", self.warmer.run_forever)

    async def _take_over(self) -> None:
        """Before a new leader's first placement: the wave and the last leader's profiles
        as they are in etcd now."""
        try:
            await self.maintenance.refresh()
        except (EtcdError, ValueError) as e:
            log.warning("the maintenance wave could not be read on taking the lead: %s", e)
        if self.exchange is not None:
            await self.exchange.join()  # the others' work and picture, not etcd's copies
            return
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
        self.admission.turn_away(lambda: not_taking(not_leading(lead.role), lead.reason))

    async def shutdown(self) -> None:
        await self._resign()
        await self.background.stop()
        await asyncio.gather(*(me.stop() for me in self.managed))
        self.relayer.close()
        await self.leadership.close()
        await self.fleet.close()
        if self.exchange is not None:
            await self.exchange.close()
        if self.session is not None:
            await self.session.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans are sent

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
                # The model the request named, once intake resolved it (a name the catalog
                # holds, never one a client chose): else the router's own.
                model = rec.fields.get("model")
                self.metrics.answered(
                    model if isinstance(model, str) else self.config.model,
                    path,
                    rec.status,
                    time.monotonic() - started,
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
        elif path == PEERING_PATH and self.exchange is not None:
            await self.exchange.handle(scope, receive, send)
        elif self.admin is not None and admin_api.routes(path):
            await self.admin.handle(scope, receive, send)
        else:
            await self.status.answer(path, method, send)


CONFIG_ENV = "NARWHAL_ROUTER_CONFIG_FILE"


def create_app() -> Router:
    """Granian factory: the CLI validated the config and handed it off (service.hand_off)."""
    service.guard_worker()
    logs.setup()
    config = RouterConfig.from_json(service.taken_over(CONFIG_ENV))
    return Router(config)
