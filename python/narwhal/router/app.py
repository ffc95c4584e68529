"""The router's ASGI application: routes, the request lifecycle, and start-up/shut-down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client import generate_latest

from narwhal import asgi, bearer, logs, silent
from narwhal.asgi import Receive, Scope, Send
from narwhal.background import Background
from narwhal.errors import ApiError
from narwhal.etcd import EtcdError
from narwhal.router import admin as admin_api
from narwhal.router import intake
from narwhal.router.admission import Admission, Expired
from narwhal.router.config import RouterConfig
from narwhal.router.engines import Engine, Pool
from narwhal.router.leadership import Leadership
from narwhal.router.lease import Events, Lease
from narwhal.router.maintenance import Maintenance
from narwhal.router.metrics import RouterMetrics
from narwhal.router.policies import OPEN_PLAN, Plan, Policy
from narwhal.router.policies.open import OpenPolicy
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.predict import NoEngineKeepsPace, Predictor
from narwhal.router.profiling import Profiler
from narwhal.router.relay import EngineBusy, EngineFailed, EngineFenced, Relayer
from narwhal.router.supervisor import ManagedEngine

log = logging.getLogger("narwhal.router")
access_log = logging.getLogger("narwhal.access")

COMPLETION_ROUTES = (intake.CHAT, intake.COMPLETION, intake.RESPONSES)
GET_ROUTES = frozenset({"/health", "/ready", "/v1/models", "/engines", "/metrics"})
# A request that would wait less than this for an engine to keep pace is refused at once.
MIN_WAIT_S = 0.01
TTFT_REFUSALS = frozenset({"ttft_budget_exceeded", "prompt_exceeds_ttft_budget"})


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.managed: list[ManagedEngine] = []
        engines = []
        for spec in config.engines:
            if spec.launch is not None:
                me = ManagedEngine(spec, config.model, on_fatal=_fatal)
                self.managed.append(me)
                engines.append(Engine(spec, me.url, managed=me))
            else:
                assert spec.url is not None
                key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
                engines.append(Engine(spec, spec.url.rstrip("/"), api_key=key))
        self.pool = Pool(
            engines, config.prefill_concurrency, config.decode_concurrency, config.eject_after
        )
        for e in engines:
            if e.managed is not None:
                restarts = self.metrics.engine_restarts.labels(e.name)
                e.managed.on_exit = _exited(self.pool, e, restarts)
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
        self.policy = _policy(config, engines, self.predictor)
        self.pool.watch(events)
        self.metrics.watch(events)
        self.policy.watch(events)
        paths = {p: self.metrics.relayed_streams.labels(p) for p in ("native", "awaited")}
        self.relayer = Relayer(
            config.stream_idle_timeout_s, config.native_relay, lambda path: paths[path].inc()
        )
        ha = config.ha
        shared = ha is not None and self.predictor is not None
        self.leadership = Leadership(ha, on_lead=self._take_over_profiles if shared else None)
        self.maintenance = Maintenance(
            self.pool, self.leadership.etcd, ha.sibling("maintenance") if ha else None
        )
        token = os.environ.get(config.admin_token_env, "") if config.admin_token_env else ""
        self.admin = admin_api.Admin(token, self.maintenance) if token else None
        self.client_keys = tuple(k.encode() for k in client_keys(config))
        from narwhal import __version__

        self.metrics.info.labels(config.model, __version__).set(1)
        self._queue_time = self.metrics.queue_time.labels(config.model)
        self.background = Background(self.metrics.background_errors)
        self.session: aiohttp.ClientSession | None = None

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
        bg.start("leadership", self.leadership.run_forever)
        bg.start("maintenance_follower", self.maintenance.follow_forever)
        if c.ha is not None and self.predictor is not None:
            bg.start("profile_sharing", self._share_profiles_forever)
        _on_stop_signal(lambda: asyncio.ensure_future(self.leadership.resign()))
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
                self._degraded,
                self.leadership,
            )
            bg.start("profiling", profiler.run_forever)

    async def shutdown(self) -> None:
        await self.leadership.resign()
        await self.background.stop()
        await asyncio.gather(*(me.stop() for me in self.managed))
        self.relayer.close()
        await self.leadership.close()
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
        if self.client_keys and path.startswith("/v1/"):
            bearer.require(scope, self.client_keys)
        if path in COMPLETION_ROUTES:
            if method != "POST":
                raise asgi.method_not_allowed(method, path, "POST")
            await self._completion(path, scope, receive, send)
        elif path in admin_api.ROUTES and self.admin is not None:
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
            self._refresh_gauges()
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
        down = self._unavailable()
        reason = down[1] if down else None
        if reason is None and not self.pool.eligible():
            reason = "no placement-eligible engine"
        if self.predictor is not None:
            for e in engines:
                e["profile"] = self.predictor.profiles[str(e["name"])].describe()
        body["ready"] = reason is None
        if reason is not None:
            body["reason"] = reason
        failing = self.background.failing()
        if failing:
            body["background_failing"] = failing
        await asgi.send_json(send, 200 if reason is None else 503, body)

    def _unavailable(self) -> tuple[str, str] | None:
        """Why this router takes no completion request now: (code, reason), or None. The
        spec's last refusal row: standby, fenced, whole-wave maintenance, monitoring-degraded
        are each a retryable 503."""
        why = self.leadership.serving()
        if why is not None:
            return self.leadership.role.value, why
        if self.maintenance.whole:
            return "maintenance", "whole-wave maintenance: every engine is in the wave"
        degraded = self._degraded()
        if degraded is not None:
            return "monitoring_degraded", "monitoring-degraded: " + degraded
        return None

    async def _share_profiles_forever(self, every_s: float = 2.0) -> None:
        """The leader publishes what its predictor learned, so the next one admits as
        sharply on its first request as this one does now."""
        assert self.predictor is not None and self.config.ha is not None
        etcd, key = self.leadership.etcd, self.config.ha.sibling("profiles").encode()
        assert etcd is not None
        while True:
            await asyncio.sleep(every_s)
            if self.leadership.serving() is None:
                with contextlib.suppress(EtcdError):
                    await etcd.put(key, self.predictor.export())

    async def _take_over_profiles(self) -> None:
        assert self.predictor is not None and self.config.ha is not None
        etcd = self.leadership.etcd
        assert etcd is not None
        try:
            kv = await etcd.get(self.config.ha.sibling("profiles").encode())
        except EtcdError as e:
            log.warning("the last leader's predictor profiles could not be read: %s", e)
            return
        if kv is not None:
            n = self.predictor.load(kv.value)
            log.info("took over the last leader's predictor profiles (%d engines)", n)

    def _degraded(self) -> str | None:
        if self.predictor is None or not self.pool.eligible():
            return None
        return self.predictor.degraded(self.pool.eligible())

    def _refresh_gauges(self) -> None:
        m = self.metrics
        for e in self.pool.engines:
            m.engine_healthy.labels(e.name).set(1 if e in self.pool.eligible() else 0)
        m.retained.set(self.admission.retained)
        m.queued.set(self.admission.queued)
        for e in self.pool.engines:
            m.inflight.labels(e.name, "prefill").set(e.prefill)
            m.inflight.labels(e.name, "decode").set(e.decode)
            if self.predictor is not None:
                prof = self.predictor.profiles[e.name]
                m.prediction_drift.labels(e.name).set(prof.drift or 0.0)
                m.sizing_error.labels(e.name).set(prof.sizing_error or 0.0)

    # -- a completion request's way through --------------------------------------------
    def _budget(self, scope: Scope) -> float:
        ms = _ms_header(scope, b"x-narwhal-ttft-target-ms")
        return self.config.ttft_budget_s if ms is None else ms / 1000

    def _deadline(self, scope: Scope, arrived: float) -> float:
        ms = _ms_header(scope, b"x-narwhal-timeout-ms")
        timeout = self.config.request_timeout_s
        return arrived + (timeout if ms is None else min(timeout, ms / 1000))

    async def _completion(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.metrics
        arrived = time.monotonic()
        m.offered.inc()
        end = Ending()
        try:
            try:
                self.admission.retain()
            except ApiError:
                m.rejected.labels("retention").inc()
                end.outcome = "rejected"
                raise
            try:
                await self._intake_and_serve(path, scope, receive, send, arrived, end)
            finally:
                self.admission.release_retention()
        finally:
            m.finished.labels(end.outcome).inc()
            rec = asgi.current.get()
            if rec is not None:
                rec.fields["outcome"] = end.outcome

    async def _intake_and_serve(
        self, path: str, scope: Scope, receive: Receive, send: Send, arrived: float, end: Ending
    ) -> None:
        m = self.metrics
        end.outcome = "invalid"  # until the body is read and checked
        try:
            raw = await asgi.read_body(
                receive, self.config.max_request_bytes, self.config.body_timeout_s
            )
        except asgi.BodyTooLarge:
            m.invalid_requests.inc()
            raise ApiError(
                413,
                f"request body exceeds {self.config.max_request_bytes} bytes",
                code="request_too_large",
            ) from None
        except asgi.ClientGone:
            m.unsized_offered.inc()
            end.outcome = "client_gone"
            raise
        try:
            deadline = self._deadline(scope, arrived)
            budget = self._budget(scope)
            req = intake.check(path, raw, self.config.model)
            session = asgi.header(scope, b"x-session-id")
            if session:
                req.session = session[:256]
        except ApiError as e:
            if e.status == 400:
                m.invalid_requests.inc()
            raise
        end.outcome = "client_gone"  # until the request is refused or answered
        await self._serve(req, receive, send, arrived, deadline, budget, end)

    async def _serve(
        self,
        req: intake.Intake,
        receive: Receive,
        send: Send,
        arrived: float,
        deadline: float,
        budget: float,
        end: Ending,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(asgi.watch_disconnect(receive, task))
        try:
            try:
                self._refuse_if_unavailable()
            except ApiError as e:
                self.metrics.rejected.labels(e.code or "unavailable").inc()
                end.outcome = "rejected"
                raise
            plan = OPEN_PLAN
            if self.pool.eligible():
                try:
                    plan = await self._judge(req, arrived, budget)
                except ApiError as e:
                    self.metrics.refused.labels(e.code or "predictive").inc()
                    end.outcome = "refused"
                    raise
            # Engines not to place on: those that cannot serve the route, then those that
            # answered this request 429.
            try:
                busy = self._cannot_serve(req)
            except ApiError:
                end.outcome = "invalid"
                raise
            while True:
                try:
                    end.outcome = await self._place_and_relay(
                        req, send, arrived, deadline, plan, busy, end
                    )
                    return
                except EngineBusy as e:
                    busy = busy | {e.engine}
                    if not self._may_retry(busy, deadline):
                        self.metrics.rejected.labels("engine_busy").inc()
                        end.outcome = "rejected"
                        await e.refusal.send(send)
                        return
        except asyncio.CancelledError:
            end.outcome = "client_gone"
            if not watcher.done():
                raise  # not the client's doing: shutting down
        finally:
            watcher.cancel()

    async def _judge(self, req: intake.Intake, arrived: float, budget: float) -> Plan:
        """The policy's plan; a request no engine can take without breaking others' time
        per output token waits for a stream to end while its TTFT budget allows."""
        deferred: ApiError | None = None
        while True:
            left = budget - (time.monotonic() - arrived)
            try:
                return self.policy.judge(req, self.pool.eligible(), left)
            except NoEngineKeepsPace as e:
                if e.slack_s <= MIN_WAIT_S:
                    raise e.refusal from None
                if deferred is None:
                    self.metrics.paced_waits.inc()
                deferred = e.refusal
                await self.policy.room(e.slack_s)
            except ApiError as e:
                # Waiting used up the budget: the reason is still the pace.
                if deferred is not None and e.code in TTFT_REFUSALS:
                    raise deferred from None
                raise

    def _refuse_unless_leading(self) -> None:
        why = self.leadership.serving()
        if why is not None:
            raise _unavailable_error(self.leadership.role.value, why)

    def _refuse_if_unavailable(self) -> None:
        down = self._unavailable()
        if down is not None:
            raise _unavailable_error(*down)

    def _cannot_serve(self, req: intake.Intake) -> frozenset[str]:
        if req.route != intake.RESPONSES:
            return frozenset()
        names = frozenset(
            e.name for e in self.pool.engines if e.spec.dialect not in intake.RESPONSES_DIALECTS
        )
        if len(names) == len(self.pool.engines):
            raise ApiError(
                404,
                f"no engine behind this router serves {req.route} (dialects that do: "
                + ", ".join(sorted(intake.RESPONSES_DIALECTS))
                + ")",
                code="unsupported",
            )
        return names

    def _may_retry(self, busy: frozenset[str], deadline: float) -> bool:
        """Another engine may take a request that engines in `busy` refused with 429, while
        its deadline has time left."""
        return time.monotonic() < deadline and any(e.name not in busy for e in self.pool.eligible())

    async def _place_and_relay(
        self,
        req: intake.Intake,
        send: Send,
        arrived: float,
        deadline: float,
        plan: Plan,
        busy: frozenset[str],
        end: Ending,
    ) -> str:
        placed = False
        try:
            async with self.admission.place(
                req,
                arrived,
                deadline,
                prefer=plan.prefer,
                tokens=plan.tokens,
                predicted_s=plan.predicted_s,
                exclude=busy,
            ) as lease:
                # Again once placed (the queue may have waited), but only leadership: the
                # token the request carries must be one this router still holds. (The engine
                # it got is out of the wave; a degraded predictor has already admitted it.)
                self._refuse_unless_leading()
                lease.fence = self.leadership.token
                lease.plan = plan
                self.policy.placed(lease)
                placed = True
                self._queue_time.observe(time.monotonic() - arrived)
                try:
                    return await self.relayer.run(lease, send)
                except EngineFailed as e:
                    raise ApiError(
                        502,
                        f"engine {lease.on.name} failed: {e}",
                        type="server_error",
                        code="engine_failed",
                    ) from None
                finally:
                    _note(lease)
        except EngineFenced as e:
            self.leadership.fence(str(e))
            self.metrics.rejected.labels("fenced").inc()
            end.outcome = "rejected"
            raise ApiError(
                503,
                f"this router was fenced ({e}); retry shortly",
                type="server_error",
                code="fenced",
                headers={"retry-after": "1"},
            ) from None
        except Expired:
            self.metrics.rejected.labels("wait_expired").inc()
            end.outcome = "rejected"
            raise ApiError(
                504,
                "no engine had room before the wait or deadline ran out",
                type="timeout_error",
                code="admission_timeout",
            ) from None
        except ApiError as e:
            if placed:
                end.outcome = "deadline" if e.status == 504 else "engine_failed"
            else:  # admission refused it
                self.metrics.rejected.labels(e.code or "capacity").inc()
                end.outcome = "rejected"
            raise


def _policy(config: RouterConfig, engines: list[Engine], predictor: Predictor | None) -> Policy:
    """The admission and placement policy, chosen once."""
    if predictor is None:
        return OpenPolicy()
    cache = (
        PrefixCache(engines, config.prefix_cache_tokens, config.prefix_block_bytes)
        if config.prefix_cache_tokens
        else None
    )
    return PredictivePolicy(predictor, engines, cache, config.tpot_target_s)


class Ending:
    """How one request ended: exactly one outcome each, so `narwhal_finished_total` adds
    up to `narwhal_offered_total`."""

    __slots__ = ("outcome",)

    def __init__(self) -> None:
        self.outcome = "client_gone"


def _unavailable_error(code: str, reason: str) -> ApiError:
    return ApiError(
        503,
        f"this router takes no requests now ({reason}); retry shortly",
        type="server_error",
        code=code,
        headers={"retry-after": "1"},
    )


def _note(lease: Lease) -> None:
    """What the access log line says of the engine's part."""
    rec = asgi.current.get()
    if rec is None:
        return
    rec.fields.update(
        engine=lease.on.name,
        ttfb_ms=round((lease.first_byte_at - lease.arrived) * 1000, 1)
        if lease.first_byte_at
        else None,
        tokens_in=lease.prompt_tokens,
        tokens_out=lease.output_tokens,
    )


def client_keys(config: RouterConfig) -> list[str]:
    """The accepted client keys: `auth.api_keys` and those in `auth.api_keys_env`."""
    keys = list(config.api_keys)
    if config.api_keys_env:
        keys += [k.strip() for k in os.environ.get(config.api_keys_env, "").split(",") if k.strip()]
    return keys


def _on_stop_signal(callback: Callable[[], object]) -> None:
    """The main process tells the worker a stop began (service.serve sends SIGUSR1 before it
    stops the worker): the router resigns its leadership at once, then drains."""
    import signal

    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, callback)


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


def _ms_header(scope: Scope, name: bytes) -> int | None:
    """A positive integer of milliseconds from a request header, or a 400."""
    raw = asgi.header(scope, name)
    if raw is None:
        return None
    try:
        ms = int(raw) if len(raw) <= 18 else (1 << 62 if raw.isdigit() else 0)
    except ValueError:
        ms = 0
    if ms <= 0:
        raise ApiError(
            400, f"{name.decode()} must be a positive integer of milliseconds", param=name.decode()
        )
    return min(ms, _MAX_MS)


_MAX_MS = 10**9  # 11.6 days: more than any timeout, and a float without overflow


CONFIG_ENV = "NARWHAL_ROUTER_CONFIG_FILE"


def create_app() -> Router:
    """Granian factory: the CLI validated the config and handed it off (service.hand_off)."""
    from narwhal import service

    service.guard_worker()
    logs.setup()
    config = RouterConfig.from_json(service.taken_over(CONFIG_ENV))
    return Router(config)
