"""LexiEngine's ASGI application: routes, auth, slots, and the generation hand-off."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import generate_latest

from narwhal import asgi, bearer, logs, registrar, service, silent
from narwhal.asgi import Receive, Scope, Send
from narwhal.background import Background
from narwhal.engine.batch import DecodeLoop
from narwhal.engine.config import EngineConfig
from narwhal.engine.fence import Fence
from narwhal.engine.generation import Finish, Piece, Request
from narwhal.engine.metrics import Metrics
from narwhal.engine.model import Model, ModelLoadError
from narwhal.engine.protocol import Job
from narwhal.engine.render import Output, ToolCallFailed
from narwhal.engine.routes import JOBS, writer_for
from narwhal.engine.slots import Busy, Slots
from narwhal.engine.tracing import GenerationTrace
from narwhal.errors import ApiError, json_object
from narwhal.etcd import Etcd, EtcdError
from narwhal.telemetry import tracing_of

log = logging.getLogger("lexi_engine")
access_log = logging.getLogger("lexi.access")

MAX_BODY = 16 * 1024 * 1024


class LexiEngine:
    def __init__(self, config: EngineConfig, model: Model) -> None:
        self.config = config
        self.model = model
        self.slots = Slots(config.parallel, config.queue_wait)
        self.metrics = Metrics(config.parallel)
        self.decoder = DecodeLoop(model, config.parallel, config.prefill_chunk, config.threads)
        self.decoder.on_step = self.metrics.batch.observe  # prometheus metrics are thread-safe
        self.keys = tuple(k.encode() for k in config.api_keys)
        self.fence = (
            Fence(
                self.metrics.fencing_token.set,
                config.fence_state,
                Etcd(config.fence_etcd.split(",")) if config.fence_etcd else None,
                config.fence_key,
                config.fence_secret,
            )
            if config.fence
            else None
        )
        self.background = Background(self.metrics.background_errors)
        self.stopping = False
        self.registrar = _registrar(config, self._healthy)
        self.tracing = tracing_of(
            config.otlp_endpoint, config.otel_service_name, config.otel_sample_ratio, "lexi_engine"
        )

    # -- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send, self._startup, self._shutdown)
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
            if path in JOBS or rec.status >= 400:
                logs.access(access_log, method, path, rec, started)

    async def _route(
        self, path: str, method: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if path == "/health" and method == "GET":
            health: dict[str, object] = {"status": "ok"}
            failing = self.background.failing()
            if failing:
                health["background_failing"] = failing
            if self.fence is not None and self.fence.unsure is not None:
                health["fence"] = self.fence.unsure
            await asgi.send_json(send, 200, health)
            return
        self._authorize(scope)
        model_id = path[len("/v1/models/") :] if path.startswith("/v1/models/") else None
        if (path in ("/v1/models", "/metrics", "/health") or model_id) and method != "GET":
            raise asgi.method_not_allowed(method, path, "GET")
        if path == "/v1/models":
            await asgi.send_json(send, 200, self._models())
        elif model_id:
            await asgi.send_json(send, 200, self._model(model_id))
        elif path == "/metrics":
            self._refresh_gauges()
            await asgi.send_bytes(
                send, 200, generate_latest(self.metrics.registry), b"text/plain; version=0.0.4"
            )
        elif path in JOBS:
            if method != "POST":
                raise asgi.method_not_allowed(method, path, "POST")
            await self._generate(path, scope, receive, send)
        else:
            raise ApiError(404, f"no route {method} {path}", code="not_found")

    async def _startup(self) -> None:
        c, m = self.config, self.metrics
        self.background.start(
            "silent_reaper",
            lambda: silent.close_silent_forever(c.header_timeout_s, m.silent_closed.inc),
        )
        if self.fence is not None and c.fence_etcd is not None:
            self.background.start("fence_follower", self.fence.follow_etcd_forever)
        if self.registrar is not None:
            self.background.start("registration", self.registrar.run_forever)
            service.on_stop_signal(lambda: asyncio.ensure_future(self._withdraw()))

    async def _withdraw(self) -> None:
        """A stop began: routers stop placing here before the engine drains."""
        self.stopping = True
        if self.registrar is not None:
            with contextlib.suppress(EtcdError):
                await self.registrar.retire()

    async def _healthy(self) -> bool:
        return not self.stopping

    async def _shutdown(self) -> None:
        self.stopping = True
        await self.background.stop()
        if self.registrar is not None:
            await self.registrar.close()
        await asyncio.to_thread(self.decoder.stop)
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans are sent

    def _authorize(self, scope: Scope) -> None:
        if self.keys:
            bearer.require(scope, self.keys)

    def _check_fence(self, scope: Scope) -> int | None:
        if self.fence is None:
            return None
        try:
            return self.fence.check(scope)
        except ApiError as e:
            self._count_fenced(e)
            raise

    async def _take_fence(self, token: int, scope: Scope) -> None:
        assert self.fence is not None
        try:
            await self.fence.take(token, scope)
        except ApiError as e:
            self._count_fenced(e)
            raise

    def _count_fenced(self, e: ApiError) -> None:
        if e.status == 409:  # a 503 fence_unknown is not a refused token
            self.metrics.fenced.inc()

    def _models(self) -> dict[str, Any]:
        created = int(os.path.getmtime(self.config.model))
        data = [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "lexi-engine",
                **({"root": self.model.id} if i else {"meta": {"n_ctx": self.model.n_ctx}}),
            }
            for i, n in enumerate(self.model.names)
        ]
        return {"object": "list", "data": data}

    def _model(self, model_id: str) -> dict[str, Any]:
        """`GET /v1/models/{id}`: one of the names (OpenAI's retrieve), or 404."""
        for m in self._models()["data"]:
            if m["id"] == model_id:
                return dict(m)
        raise ApiError(
            404,
            f"The model '{model_id[:200]}' does not exist",
            param="model",
            code="model_not_found",
        )

    def _refresh_gauges(self) -> None:
        self.metrics.queue_depth.set(self.slots.waiting)
        self.metrics.slots_busy.set(self.slots.busy)

    # -- generation ---------------------------------------------------------------------
    async def _generate(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        trace = (
            GenerationTrace(
                self.tracing, asgi.header(scope, b"traceparent"), f"POST {path}", time.monotonic()
            )
            if self.tracing is not None
            else None
        )
        if trace is None:
            await self._generation(path, scope, receive, send, None)
            return
        status = 500
        try:
            await self._generation(path, scope, receive, send, trace)
            status = trace.status
        except asyncio.CancelledError:
            status = 499
            raise
        except ApiError as e:
            status = e.status
            raise
        finally:
            trace.ended(status, time.monotonic())

    async def _generation(
        self,
        path: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        trace: GenerationTrace | None,
    ) -> None:
        route = path.rsplit("/", 1)[-1]
        status = 200
        try:
            raw = await asgi.read_body(receive, MAX_BODY, self.config.body_timeout_s)
        except asgi.BodyTooLarge:
            raise ApiError(413, "request body too large", code="request_too_large") from None
        try:
            token = self._check_fence(scope)
            body = json_object(raw)
            # Rendering the template and tokenizing run off the event loop: a template can
            # be slow (bounded in engine.template), and /health must not wait for it.
            job = await asyncio.to_thread(JOBS[path], body, self.config, self.model)
            if token is not None:
                await self._take_fence(token, scope)  # only an accepted request moves the floor
            if trace is not None:
                trace.rendered(job)
        except ApiError as e:
            self.metrics.requests.labels(route, str(e.status)).inc()
            raise
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(asgi.watch_disconnect(receive, task))
        try:
            prompt = job.prompt_ids
            try:
                name = job.body.get("model")
                adapter = name if isinstance(name, str) and name in self.model.adapters else None
                slot = await self.slots.acquire(
                    lambda s: self.decoder.prefix_with(s, prompt, adapter)
                )
            except Busy:
                status = 429
                raise ApiError(
                    429,
                    "all slots are busy",
                    type="server_error",
                    code="inference_busy",
                    headers={"retry-after": "1"},
                ) from None
            try:
                self._check_fence(scope)  # again: a newer leader may have come while it waited
            except ApiError:
                self.slots.release(slot)
                raise
            gen = Request(prompt, job.sampling, job.cache_prompt, adapter)
            if trace is not None:
                trace.seated_at, trace.gen = gen.started_at, gen
            # The slot goes back when the decode loop has let go of the request, not when
            # this task ends: a task cancelled twice must not hand on a slot still decoding.
            gen.done.add_done_callback(lambda _: self.slots.release(slot))
            self.decoder.submit(slot, gen)
            try:
                await self._run(job, gen, send, trace)
            finally:
                gen.cancel()
        except asyncio.CancelledError:
            status = 499  # the client went away; nothing is left to answer
            if not watcher.done():
                raise
        except ApiError as e:
            status = e.status
            raise
        finally:
            watcher.cancel()
            self.metrics.requests.labels(route, str(status)).inc()
            if trace is not None:
                trace.status = status

    async def _run(
        self, job: Job, gen: Request, send: Send, trace: GenerationTrace | None = None
    ) -> None:
        out = Output(job)
        if trace is not None:
            out.checks = trace.checks  # each tool call's check timed, for its span
        writer = writer_for(job, self.model.id)
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        finish: Finish | None = None
        try:
            if job.stream:
                await asgi.start_stream(send)
                first = writer.first()
                if first:
                    await asgi.stream_chunk(send, first)
            try:
                while True:
                    item = await gen.queue.get()
                    if isinstance(item, Piece):
                        d = out.piece(item)
                        if d is not None and job.stream:
                            await asgi.stream_chunk(send, writer.delta(d))
                        continue
                    finish = item
                    if trace is not None:
                        trace.finish, trace.finished_at = finish, time.monotonic()
                    break
                rec = asgi.current.get()
                if rec is not None:
                    rec.fields.update(
                        tokens_in=len(job.prompt_ids),
                        tokens_out=finish.completion_tokens,
                        finish=finish.reason,
                    )
                if finish.error:
                    raise ApiError(500, finish.error, type="server_error", code="generation_failed")
                d = out.finish()
            except ToolCallFailed as e:
                raise ApiError(
                    422,
                    str(e),
                    type="invalid_response_error",
                    code="tool_call_invalid",
                    param="tool_choice",
                ) from None
            if job.stream:
                tail = writer.delta(d) if d is not None else b""
                last = writer.last(finish, out.finish_reason(finish))
                await _settled(gen)  # the slot is free by the time the client has the end
                await asgi.stream_chunk(send, tail + last, more=False)
            else:
                await asgi.send_json(send, 200, writer.whole(out, finish))
        except ApiError as e:  # a generation that cannot be answered
            if e.status >= 500:
                log.error("%s", e.message)
            if not job.stream:
                raise
            # Headers are out: the stream ends with the error as its last event, once the
            # slot is free (a request sent right after the end must find it free).
            await _settled(gen)
            await asgi.stream_chunk(
                send, b"data: " + orjson.dumps(e.envelope()) + b"\n\n", more=False
            )
        finally:
            await _settled(gen)  # decoding has stopped: its numbers are final
            self._observe(gen, finish)

    def _observe(self, gen: Request, finish: Finish | None) -> None:
        if finish is None or gen.first_token_at is None:
            return
        m = self.metrics
        m.output_tokens.inc(finish.completion_tokens)
        m.cached_tokens.inc(finish.cached_tokens)
        m.ttft.observe(gen.first_token_at - gen.started_at)
        if finish.completion_tokens > 1:
            m.tpot.observe((time.monotonic() - gen.first_token_at) / (finish.completion_tokens - 1))


async def _settled(gen: Request) -> None:
    """The decode loop has let go of `gen` (its slot released: the release is the first
    callback on `gen.done`, added when the slot was taken)."""
    gen.cancel()
    await asyncio.shield(gen.done)


def _registrar(
    c: EngineConfig, healthy: Callable[[], Awaitable[bool]]
) -> registrar.Registrar | None:
    """`--register-etcd`: this engine's key, held while it serves."""
    if c.register_etcd is None or c.register_key is None:
        return None
    url = c.advertise or f"http://{c.host}:{c.port}"
    name = c.register_key.rstrip("/").rsplit("/", 1)[-1]
    return registrar.Registrar(
        c.register_etcd.split(","),
        c.register_key,
        registrar.value(url, "lexi", name),
        healthy,
        c.register_ttl_s,
    )


def create_app() -> LexiEngine:
    """Granian factory: reads the validated config the CLI handed off (service.hand_off)."""
    from narwhal.engine.cli import CONFIG_ENV

    service.guard_worker()
    logs.setup()
    # The decode thread hands the GIL back and forth with the event loop every step; the
    # default 5 ms switch interval would let either side stall the other for that long.
    sys.setswitchinterval(0.0005)
    config = EngineConfig.from_json(service.taken_over(CONFIG_ENV))
    try:
        model = Model(config)
    except ModelLoadError as e:
        print(f"lexi-engine: error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    log.info(
        "serving %s as %s (%d slots, ctx %d)",
        config.model,
        ", ".join(model.names),
        config.parallel,
        model.n_ctx,
    )
    return LexiEngine(config, model)
