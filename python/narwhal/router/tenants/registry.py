"""The tenants `auth.api_keys` names, found by the key a request came with.

A key without a tenant (a plain string in `auth.api_keys`, or one of `api_keys_env`) is
no tenant: its requests are limited by nothing but the router's own admission, as before.
Tenants are metric labels by name; keys never are.
"""

from __future__ import annotations

from typing import Any

from narwhal.router.config import TenantKey
from narwhal.router.tenants.limits import Limits, Tenant, TenantLimited, Ticket


class Tenants:
    def __init__(self, keys: list[TenantKey], requests: Any, tokens: Any) -> None:
        self.by_name: dict[str, Tenant] = {}
        for k in keys:
            if k.tenant not in self.by_name:
                self.by_name[k.tenant] = Tenant(k.tenant, Limits(k.rpm, k.tpm, k.max_concurrent))
        self._requests = requests  # Counter(["tenant", "result"])
        self._tokens = tokens  # Counter(["tenant"])
        for name in self.by_name:
            self._requests.labels(name, "admitted")

    def admit(self, name: str | None, estimate: int) -> Ticket | None:
        """Let a request of tenant `name` in (a Ticket to end), or TenantLimited."""
        if name is None:
            return None
        tenant = self.by_name[name]
        try:
            ticket = tenant.admit(estimate)
        except TenantLimited as e:
            self._requests.labels(name, f"refused_{e.reason}").inc()
            raise
        self._requests.labels(name, "admitted").inc()
        return ticket

    def end(self, ticket: Ticket | None, tokens: int | None) -> None:
        if ticket is None:
            return
        ticket.end(tokens)
        if tokens:
            self._tokens.labels(ticket.tenant.name).inc(tokens)
