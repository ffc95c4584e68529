"""The engine pool: per-engine state, health probing and least-loaded placement.

Which engines exist changes while the router runs (`router/fleet/`): the pool is the one
list of them, and an engine being drained stays in it, out of placement, until its
in-flight requests are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import aiohttp
import orjson

from narwhal.router.config import EngineSpec
from narwhal.router.config_schema import MODEL_NAME
from narwhal.router.fleet.rules import Refused
from narwhal.router.urls import authorization, redact

if TYPE_CHECKING:
    from narwhal.router.fleet.rules import Rules
    from narwhal.router.supervisor import ManagedEngine

log = logging.getLogger("narwhal.engines")


class Seated(Protocol):
    """A request seated on an engine (`lease.Lease`), as the pool sees it: declared here,
    so the pool sits below the lease that names its engines."""

    @property
    def on(self) -> Engine: ...


@dataclass
class Engine:
    spec: EngineSpec
    url: str
    healthy: bool = False
    reason: str = "not probed yet"
    prefill: int = 0  # placed requests before their first token
    decode: int = 0  # requests streaming tokens
    prefill_tokens: int = 0  # sized prompt tokens of the requests in prefill
    prefill_sq: int = 0  # the sum of their squares (attention's cost grows with it)
    # First output tokens ever seen here, and when the last came: prefill runs first come,
    # first served, so a prompt that waited behind others began its own when the one before
    # it ended (Admission reads them to measure each prompt's own prefill, and writes them).
    firsts: int = 0
    first_at: float = 0.0
    # When each projected request in prefill here was due to have its first token (placed
    # at + projected TTFT). Written by Admission alone, as the seats are.
    prefill_due: dict[Seated, float] = field(default_factory=dict, repr=False)
    # Sized prompt tokens of requests waiting in the router's queue for a seat here, by
    # class (critical, standard, sheddable): the prefill ahead of a new request of that
    # class or a lower one. Written by Admission alone, as the seats are.
    queued_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])
    queued_sq: list[int] = field(default_factory=lambda: [0, 0, 0])  # their squares' sums
    strikes: int = 0  # request faults in a row (reset by a full answer or a probe's return)
    managed: ManagedEngine | None = None  # the process behind it, when the router runs it
    api_key: str | None = field(default=None, repr=False)  # sent upstream; never shown
    draining: bool = False  # being removed: nothing new, in-flight requests finish
    cut: bool = False  # drained past its timeout: its streams were ended by the router
    source: str = "config"  # where it came from: config, admin, etcd, dns
    # What a runtime source's engine may be connected to (None: the config file's own).
    rules: Rules | None = field(default=None, repr=False)
    # `models: auto`: what its /v1/models listed at the last probe that read it (the pool's
    # probes write it, and move `Pool.version` when it changes).
    discovered: tuple[str, ...] = ()
    about: dict[str, dict[str, object]] = field(default_factory=dict)  # what it said of each

    def serves(self, default: str) -> tuple[str, ...]:
        """The models it serves now (`default`: the router's `model`, where none are said)."""
        return self.discovered if self.spec.discover else self.spec.serves(default)

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        return "serving" if self.healthy else "unhealthy"

    @property
    def name(self) -> str:
        return self.spec.name

    def ahead_s(self, whole_s: float, now: float) -> float:
        """The prefill ahead of a prompt placed here now: `whole_s`, the prompts in prefill
        here read whole, and how far the engine is behind (`behind_s`); or where each was
        projected, no more than what is left of their projections: the last of them is due
        its first token at the latest due (first come, first served), less the part already
        run. Read whole, a prompt that has run most of its prefill counted all of it, and
        projections with prefill ahead came in 10-50 % early (the fleet bench's access
        lines, by the share of the projection that was work ahead), which widened every
        margin."""
        behind = self.behind_s(now)
        if not self.prefill_due or len(self.prefill_due) < self.prefill:
            return whole_s + behind
        return min(whole_s, max(0.0, max(self.prefill_due.values()) - now)) + behind

    def behind_s(self, now: float) -> float:
        """How far past its projected first token the oldest prompt in prefill here is: the
        engine is behind by at least that (a prompt waiting for KV room, a preempted one,
        one that read slower than projected), and every prompt after it waits it out."""
        if not self.prefill_due:
            return 0.0
        return max(0.0, now - min(self.prefill_due.values()))

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        u = urlsplit(self.url)
        return u.port or (443 if u.scheme == "https" else 80)

    @property
    def token_accounting(self) -> str:
        return "token_ids" if self.spec.token_ids else "unavailable"

    @property
    def inflight(self) -> int:
        return self.prefill + self.decode

    def describe(self, detail: bool = True) -> dict[str, object]:
        """What `/engines` and `/ready` show (`detail=False`: routes open to anyone, where a
        runtime engine's probe results would make a port scanner of the router for whoever
        can register one) and `/admin/engines` (`detail=True`)."""
        reason = None if self.healthy else self.reason
        if reason is not None and not detail and self.rules is not None:
            reason = "unhealthy (details on /admin/engines)"
        out: dict[str, object] = {
            "name": self.name,
            "url": redact(self.url),
            "dialect": self.spec.dialect,
            "healthy": self.healthy,
            "state": self.state,
            "source": self.source,
            "reason": reason,
            "token_accounting": self.token_accounting,
            "prefill": self.prefill,
            "decode": self.decode,
            "behind_s": round(self.behind_s(time.monotonic()), 3),
        }
        if self.spec.models is not None or self.spec.discover:
            out["models"] = list(self.serves(""))
        if self.managed is not None:
            out["process"] = self.managed.describe()
            if reason is not None and self.managed.last_exit is not None:
                out["reason"] = (
                    f"{reason}; the engine process {self.managed.last_exit} "
                    f"(restarts: {self.managed.restarts})"
                )
        return out


MODELS_MAX_BYTES = 1 << 20  # an engine's /v1/models answer, read at most
MODELS_MAX = 256  # models one engine may serve
MODEL = re.compile(MODEL_NAME)  # a name the config could hold


# What of an engine's model entry `/v1/models` passes on: vLLM's and LexiEngine's fields
# saying what a model is (an adapter's base, its context), scalars only.
MODEL_META = ("root", "parent", "max_model_len", "owned_by")


def listed_models(raw: bytes) -> dict[str, dict[str, object]]:
    """The models an OpenAI-shaped `/v1/models` answer lists (`{"data": [{"id", ...}]}`),
    each a model name the config could hold, at most MODELS_MAX, with what it says of each
    (`MODEL_META`, short scalars); ValueError otherwise."""
    body = orjson.loads(raw)  # JSONDecodeError is a ValueError
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("no 'data' list")
    out: dict[str, dict[str, object]] = {}
    for m in data[: MODELS_MAX + 1]:
        name = m.get("id") if isinstance(m, dict) else None
        if isinstance(name, str) and MODEL.fullmatch(name) and name not in out:
            out[name] = {
                k: v
                for k in MODEL_META
                if isinstance(v := m.get(k), (str, int, float))
                and not isinstance(v, bool)
                and (not isinstance(v, str) or len(v) <= 256)
            }
    if len(out) > MODELS_MAX:
        raise ValueError(f"more than {MODELS_MAX} models")
    return out


class Pool:
    def __init__(
        self, engines: list[Engine], prefill_limit: int, decode_limit: int, eject_after: int = 3
    ) -> None:
        self.engines = engines
        self.version = 0  # moves whenever an engine joins or leaves (what serves which model)
        self.eject_after = eject_after
        self.prefill_limit = prefill_limit
        self.decode_limit = decode_limit
        self.changed = asyncio.Event()  # set whenever capacity may have freed up
        self.on_healthy: list[Callable[[Engine], None]] = []  # an engine became healthy
        self._probe_now = asyncio.Event()
        self.maintenance: frozenset[str] = frozenset()  # engine names in the wave (no new work)
        self.probe_interval_s = 2.0  # health probes (probe_forever sets both)
        self.probe_timeout_s = 2.0

    def eligible(self) -> list[Engine]:
        return [
            e
            for e in self.engines
            if e.healthy and not e.draining and e.name not in self.maintenance
        ]

    def named(self, name: str) -> Engine | None:
        return next((e for e in self.engines if e.name == name), None)

    def add(self, e: Engine) -> None:
        # A new list, not an append: loops over the old one (a probe round) run on.
        self.engines = [*self.engines, e]
        self.version += 1

    def remove(self, e: Engine) -> None:
        self.engines = [x for x in self.engines if x is not e]
        self.version += 1

    def notify(self) -> None:
        self.changed.set()

    async def probe_forever(
        self, session: aiohttp.ClientSession, interval: float, timeout: float
    ) -> None:
        """Every engine probed each `interval` (`probe_interval_s` and `probe_timeout_s`,
        read each round: a reload changes them)."""
        self.probe_interval_s, self.probe_timeout_s = interval, timeout
        while True:
            self._probe_now.clear()
            t = self.probe_timeout_s
            await asyncio.gather(*(self.probe(session, e, t) for e in self.engines))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._probe_now.wait(), self.probe_interval_s)

    def probe_soon(self) -> None:
        """An engine joined: the next probe round starts now."""
        self._probe_now.set()

    async def probe(self, session: aiohttp.ClientSession, e: Engine, timeout: float) -> None:
        was = e.healthy
        try:
            if e.rules is not None:
                await e.rules.resolve(e.host, e.port)  # where it points now, before a byte
            async with session.get(
                e.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                ok = r.status == 200
                e.reason = "ok" if ok else f"/health answered {r.status}"
        except Refused as exc:
            ok = False
            e.reason = f"destination refused: {exc}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok = False
            e.reason = f"/health failed: {type(exc).__name__}"
        if ok and e.spec.discover:
            await self._discover(session, e, timeout)
        e.healthy = ok
        if ok and not was:
            e.strikes = 0  # back in: a new streak starts
        if ok != was:
            log.info("engine %s is %s (%s)", e.name, "healthy" if ok else "unhealthy", e.reason)
            self.notify()
            if ok:
                for hook in self.on_healthy:
                    hook(e)

    async def _discover(self, session: aiohttp.ClientSession, e: Engine, timeout: float) -> None:
        """`models: auto`: the models the engine's /v1/models lists now (vLLM lists its LoRA
        adapters there as they load). An answer that cannot be read keeps the last list."""
        auth = authorization(e.url, e.api_key)
        try:
            async with session.get(
                e.url + "/v1/models",
                timeout=aiohttp.ClientTimeout(total=timeout),
                headers={"authorization": auth} if auth else None,
            ) as r:
                if r.status != 200:
                    raise ValueError(f"/v1/models answered {r.status}")
                raw = b""
                async for chunk in r.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MODELS_MAX_BYTES:
                        raise ValueError(f"/v1/models answered more than {MODELS_MAX_BYTES} bytes")
            listed = listed_models(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.warning("engine %s: its models could not be read: %s", e.name, exc)
            return
        found = tuple(listed)
        if found != e.discovered or listed != e.about:
            if found != e.discovered:
                log.info("engine %s serves %s", e.name, ", ".join(found) or "no model")
            e.discovered, e.about = found, listed
            self.version += 1

    def process_exited(self, e: Engine) -> None:
        """The engine's process is gone; a probe brings it back once the restart answers."""
        e.reason = "restarting"  # describe() adds how the process ended
        if e.healthy:
            log.info("engine %s is unhealthy (%s)", e.name, e.reason)
            e.healthy = False
            self.notify()

    # Health from what requests see (subscribed to the leases' events at start): a full
    # answer ends a fault streak, a fault held against the engine adds to it.
    def answered(self, lease: Seated) -> None:
        self.succeeded(lease.on)

    def faulted(self, lease: Seated, kind: str, against_engine: str | None) -> None:
        if against_engine is not None:
            self.mark_failed(lease.on, against_engine)

    def mark_failed(self, e: Engine, reason: str) -> None:
        """A request saw the engine fail (reset, truncation, bad framing, a stall). One fault
        is evidence, not a verdict: after `eject_after` in a row the engine gets nothing new
        until a health probe brings it back (a circuit breaker, as SGLang's router has)."""
        e.strikes += 1
        e.reason = reason
        if e.healthy and e.strikes >= self.eject_after:
            log.warning("engine %s ejected after %d faults in a row: %s", e.name, e.strikes, reason)
            e.healthy = False

    def succeeded(self, e: Engine) -> None:
        """A request was answered in full: the fault streak is over."""
        e.strikes = 0
