"""Profiling probes: an idle engine whose telemetry is getting old gets a small request, so
the predictor stays fresh (and recovers from degradation) without live traffic.

A probe is placed like any request (a lease from admission, on the engine it measures) and
relayed to nowhere; the predictor learns from it through the same events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import orjson

from narwhal.errors import ApiError
from narwhal.router.admission import Admission
from narwhal.router.endings import End
from narwhal.router.engines import Engine, Pool
from narwhal.router.ha.leadership import Leadership
from narwhal.router.pipeline import intake
from narwhal.router.predict import Predictor
from narwhal.router.relay.errors import EngineBusy, EngineFailed, EngineFenced
from narwhal.router.relay.relayer import Relayer
from narwhal.router.request import CHAT, Request

log = logging.getLogger("narwhal.profiling")

# About 250 tokens of ordinary text: enough prefill to measure a rate, not just the fixed
# per-request overhead a tiny prompt would show.
_TEXT = "Narwhal measures how fast this engine reads a prompt of ordinary text. " * 14


def probe_request(model: str, e: Engine) -> Request:
    # A fresh prompt each time: an engine that reuses a cached prefix (LexiEngine, vLLM,
    # SGLang) would otherwise answer the repeat at once and teach the predictor a prefill
    # rate no new prompt gets. LexiEngine is also told not to reuse (`cache_prompt`,
    # llama-server's switch); others ignore what it says.
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 1,
        "stream": True,
        "messages": [{"role": "user", "content": f"[{secrets.token_hex(6)}] {_TEXT}"}],
    }
    if e.spec.dialect in ("lexi", "llamacpp"):
        body["cache_prompt"] = False
    return intake.check(CHAT, orjson.dumps(body), model)


async def _discard(_: Any) -> None:
    pass


class Profiler:
    def __init__(
        self,
        model: str,
        pool: Pool,
        admission: Admission,
        predictor: Predictor,
        relayer: Relayer,
        interval_s: float,
        degraded: Callable[[], str | None],
        leadership: Leadership,
    ):
        self.model = model
        self.pool = pool
        self.admission = admission
        self.predictor = predictor
        self.relayer = relayer
        self.interval_s = interval_s
        self.degraded = degraded
        self.leadership = leadership  # only the leader probes, under its fencing token
        self._woken = asyncio.Event()

    def wake(self) -> None:
        """An engine joined: measure it now, not at the next round."""
        self._woken.set()

    async def run_forever(self) -> None:
        await asyncio.sleep(0.2)  # the first measurement as soon as engines are healthy
        while True:
            if self.leadership.serving() is not None:
                await asyncio.sleep(0.25)  # a standby measures nothing; it may lead soon
                continue
            degraded = self.degraded() is not None
            for e in self.pool.eligible():
                if self.leadership.serving() is not None:
                    break
                profile = self.predictor.profiles[e.name]
                age = profile.age_s(time.monotonic())
                if e.inflight or (age < self.interval_s and not degraded):
                    continue
                await self.measure(e, rebase=degraded)
            self._woken.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.interval_s)

    async def measure(self, e: Engine, rebase: bool = False) -> None:
        req = probe_request(e.spec.serves(self.model)[0], e)
        now = time.monotonic()
        proj = self.predictor.project(req.prompt_bytes, e)
        async with self.admission.place_on(
            e, req, now, now + 30, proj.tokens, proj.total_s
        ) as lease:
            if lease is None:
                return  # live traffic came first: it measures the engine too
            lease.fence = self.leadership.token
            lease.probe = True
            try:
                outcome = await self.relayer.run(lease, _discard)
            except EngineFenced as exc:
                self.leadership.fence(str(exc))
                return
            except (ApiError, EngineFailed, EngineBusy) as exc:
                log.info("profile probe of %s failed: %s", e.name, exc)
                return
            if outcome is not End.COMPLETED:  # the engine refused it (a model name it lacks?)
                log.warning("profile probe of %s: %s", e.name, outcome.outcome)
                return
            if rebase and lease.measured.first_at:
                # Half-open: a good measurement lets live traffic be judged again.
                self.predictor.profiles[e.name].rebase()
