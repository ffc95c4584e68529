"""The tenants `auth.api_keys` names, found by the key a request came with.

A key without a tenant (a plain string in `auth.api_keys`, or one of `api_keys_env`) is
no tenant: its requests are limited by nothing but the router's own admission, as before.
Tenants are metric labels by name; keys never are.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

import orjson

from narwhal.errors import ApiError
from narwhal.router.config import RouterConfig, TenantKey
from narwhal.router.endings import End
from narwhal.router.metrics import RouterMetrics
from narwhal.router.tenants.fair_queue import CLASSES, RANK
from narwhal.router.tenants.limits import Limits, Tenant, TenantLimited, Ticket
from narwhal.router.tenants.reserve import CriticalReserve
from narwhal.router.tenants.shares import Shares


class Told(Protocol):
    """What hears of every request a tenant's limits let in, and of its end."""

    def admitted(self, ticket: Ticket, tenant: str, estimate: int) -> None: ...

    def ended(self, ticket: Ticket, tokens: int | None) -> None: ...


class Tenants:
    def __init__(
        self,
        keys: list[TenantKey],
        metrics: RouterMetrics,
        critical_reserve: float = 0.0,
        budget_s: float = 5.0,
    ) -> None:
        self.by_name: dict[str, Tenant] = {}
        self.ceiling: dict[str, int] = {}  # the highest class a tenant's requests may take
        self.models: dict[str, frozenset[str]] = {}  # what a tenant may ask for, where limited
        for k in keys:
            if k.tenant not in self.by_name:
                self.by_name[k.tenant] = Tenant(k.tenant, Limits(k.rpm, k.tpm, k.max_concurrent))
                self.ceiling[k.tenant] = RANK[k.priority]
                if k.models is not None:
                    self.models[k.tenant] = frozenset(k.models)
        # Lower classes leave critical work room only where a key may send it.
        critical = RANK["critical"] in self.ceiling.values()
        self.reserve = CriticalReserve(critical_reserve, critical, budget_s)
        self.shares = Shares(budget_s)
        self._requests = metrics.tenant_requests
        self._tokens = metrics.tenant_tokens
        self._finished = metrics.tenant_finished
        self._queue_time = metrics.tenant_queue_time
        for name, rank in self.ceiling.items():
            self._requests.labels(name, CLASSES[rank], "admitted")
        # `ha.mode: active`: told of every request let in and ended here, for the other
        # routers' windows (router/peering).
        self.told: Told | None = None

    def may_use(self, name: str | None, model: str) -> None:
        """403 `model_not_allowed` where tenant `name`'s keys list the models they may use
        and `model` (as the request names it) is not one."""
        allowed = self.models.get(name) if name is not None else None
        if allowed is not None and model not in allowed:
            raise ApiError(
                403,
                f"this key may not use the model '{model[:200]}'",
                param="model",
                code="model_not_allowed",
            ).ended(End.INVALID)

    def rank(self, name: str | None, asked: str | None) -> int:
        """A request's class: what `x-narwhal-priority` asks, never above its key's
        (standard for a key without a tenant, or no key); 400 for a class that is none."""
        ceiling = self.ceiling.get(name or "", RANK["standard"])
        if asked is None:
            return ceiling
        rank = RANK.get(asked.strip().lower())
        if rank is None:
            raise ApiError(
                400,
                f"x-narwhal-priority must be one of {', '.join(CLASSES)}",
                param="x-narwhal-priority",
                code="invalid_priority",
            ).ended(End.INVALID)
        return max(rank, ceiling)

    def admit(self, name: str | None, estimate: int, rank: int) -> Ticket | None:
        """Let a request of tenant `name` in (a Ticket to end), or TenantLimited."""
        if name is None:
            return None
        tenant = self.by_name[name]
        try:
            ticket = tenant.admit(estimate)
        except TenantLimited as e:
            self._requests.labels(name, CLASSES[rank], f"refused_{e.reason}").inc()
            raise
        self._requests.labels(name, CLASSES[rank], "admitted").inc()
        if self.told is not None:
            self.told.admitted(ticket, name, estimate)
        return ticket

    def admitted_elsewhere(self, name: str, estimate: int) -> Ticket | None:
        """Another active router let a request of tenant `name` in: it counts here too (a
        tenant unknown here counts nowhere: the routers' configs differ)."""
        tenant = self.by_name.get(name)
        return tenant.count(estimate) if tenant is not None else None

    def ended_elsewhere(self, ticket: Ticket, tokens: int | None) -> None:
        ticket.end(tokens)

    def export(self) -> bytes:
        """Every tenant's last minute, for the next leader."""
        now = time.monotonic()
        return orjson.dumps({name: t.export(now) for name, t in self.by_name.items()})

    def load(self, raw: bytes) -> int:
        """Take over the last leader's windows: a tenant cannot double its limits by
        hitting a new leader. How many tenants it knew."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return 0
        if not isinstance(data, dict):
            return 0
        now = time.monotonic()
        taken = 0
        for name, entries in data.items():
            tenant = self.by_name.get(name)
            if tenant is not None and isinstance(entries, list):
                tenant.load(entries, now)
                taken += 1
        return taken

    def end(self, ticket: Ticket | None, tokens: int | None) -> None:
        if ticket is None:
            return
        ticket.end(tokens)
        if self.told is not None:
            self.told.ended(ticket, tokens)
        if tokens:
            self._tokens.labels(ticket.tenant.name).inc(tokens)
            self.shares.served(ticket.tenant.name, tokens)

    def finished(self, name: str, rank: int | None, outcome: str, reason: str | None) -> None:
        """A request of tenant `name` ended (its class: None when it was never read)."""
        klass = CLASSES[self.ceiling[name] if rank is None else rank]
        self._finished.labels(name, klass, outcome, reason or "").inc()

    def queued(self, name: str, rank: int, seconds: float) -> None:
        """A request of tenant `name` was placed `seconds` after it arrived."""
        self._queue_time.labels(name, CLASSES[rank]).observe(seconds)

    def fair_share(self, name: str | None) -> float:
        """The share of its budget a request of tenant `name` is judged against (fair
        shares while the fleet is full)."""
        return 1.0 if name is None else self.shares.fair_share(name)


def auth_problem(config: RouterConfig) -> str | None:
    """Why the client keys as configured cannot be used, or None. Auth is on as soon as
    `auth` lists a key or names a variable: then a variable that holds no key, or no key at
    all, is an error, never a router that serves anyone."""
    if config.api_keys_env and not _split(os.environ.get(config.api_keys_env, "")):
        return f"auth.api_keys_env: the environment variable {config.api_keys_env} holds no key"
    for t in config.tenant_keys:
        if t.key_env is not None and not os.environ.get(t.key_env, "").strip():
            return f"auth.api_keys[{t.tenant}].key_env: the variable {t.key_env} holds no key"
    configured = config.api_keys or config.api_keys_env or config.tenant_keys
    if configured and not client_keys(config)[0]:
        return "auth: client keys are configured but none results: the router would serve anyone"
    return None


def _split(raw: str) -> list[str]:
    return [k.strip() for k in raw.split(",") if k.strip()]


def client_keys(config: RouterConfig) -> tuple[list[str], list[str | None]]:
    """The accepted client keys (`auth.api_keys`, those in `auth.api_keys_env`, the
    tenants' keys), and the tenant each key is for (None: no tenant)."""
    keys = list(config.api_keys)
    if config.api_keys_env:
        keys += _split(os.environ.get(config.api_keys_env, ""))
    tenants: list[str | None] = [None] * len(keys)
    for t in config.tenant_keys:
        key = t.key if t.key is not None else os.environ.get(t.key_env or "", "").strip()
        if key:
            keys.append(key)
            tenants.append(t.tenant)
    return keys, tenants
