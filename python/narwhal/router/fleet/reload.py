"""Reload: the config file read again while the router runs (SIGHUP, or `POST
/admin/reload`).

A file that does not load, or that changes what only a restart can (where the router
listens, its model, admission, `ha`, the managed engines, the client and admin keys), is
refused: the running config stays, the error is logged and shown on `/ready`
(`reload_error`) until a good reload.
Otherwise the config-file engines are made to match (new ones added, gone ones drained,
changed ones drained and added again) and the admission and serving settings apply to
requests from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from narwhal.router.admission import Admission
from narwhal.router.config import RouterConfig, RouterConfigError, load
from narwhal.router.engines import Pool
from narwhal.router.fleet.membership import Conflict, Membership
from narwhal.router.policies import Policy
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.relay.relayer import Relayer
from narwhal.router.tenants.reserve import CriticalReserve

log = logging.getLogger("narwhal.fleet")

# What a running router cannot take on without a restart.
# What a reload refuses to change: the listener, the model, the admission mode, HA, the
# router's CPUs and relay, and the client and admin keys (read once, at start).
FIXED = (
    "host",
    "port",
    "model",
    "admission",
    "ha",
    "cpu_affinity",
    "native_relay",
    "api_keys",
    "api_keys_env",
    "tenant_keys",
    "admin_token_env",
)


class Reloader:
    def __init__(
        self,
        path: str | None,
        config: RouterConfig,
        membership: Membership,
        apply: Callable[[RouterConfig], None],
    ) -> None:
        self.path = path  # None: no file (`narwhal up`), nothing to reload
        self.config = config
        self.membership = membership
        self.apply = apply  # the settings, to whoever reads them per request
        self.error: str | None = None

    def reload(self) -> str | None:
        """Read the file again and apply it; the error that refused it, or None."""
        if self.path is None:
            return self._refuse("this router was not started from a config file")
        try:
            new = load(self.path)
        except RouterConfigError as e:
            return self._refuse(str(e))
        fixed = [k for k in FIXED if getattr(new, k) != getattr(self.config, k)]
        if fixed:
            return self._refuse(f"{', '.join(fixed)}: a change here needs a restart")
        old_managed = [e for e in self.config.engines if e.launch is not None]
        if [e for e in new.engines if e.launch is not None] != old_managed:
            return self._refuse("managed engines (`launch`) change only with a restart")
        self._engines(new)
        self.config = new
        self.apply(new)
        self.error = None
        log.info("config reloaded from %s", self.path)
        return None

    def _engines(self, new: RouterConfig) -> None:
        before = {e.name: e for e in self.config.engines if e.launch is None}
        after = {e.name: e for e in new.engines if e.launch is None}
        for name in before.keys() - after.keys():
            if self.membership.pool.named(name) is not None:
                self.membership.drain(name, "gone from the config file")
        for spec in after.values():
            try:
                self.membership.replace(spec, "config")
            except Conflict as e:
                log.warning("reload: %s", e)

    def _refuse(self, why: str) -> str:
        self.error = why
        log.error("config reload refused, the running config stays: %s", why)
        return why


def settle(
    new: RouterConfig,
    admission: Admission,
    pool: Pool,
    membership: Membership,
    relayer: Relayer,
    policy: Policy,
    reserve: CriticalReserve,
) -> None:
    """A reloaded config's admission and serving settings, to each that reads them per
    request."""
    admission.retention_limit = new.http_retention_limit
    admission.queue_size, admission.wait_s = new.queue_size, new.queue_wait_s
    pool.prefill_limit, pool.decode_limit = new.prefill_concurrency, new.decode_concurrency
    pool.eject_after = new.eject_after
    membership.drain_timeout_s = new.drain_timeout_s
    relayer.idle_s = new.stream_idle_timeout_s
    reserve.configure(new.critical_reserve)
    if isinstance(policy, PredictivePolicy):
        policy.tpot_target_s = new.tpot_target_s
        policy.budget_s = new.ttft_budget_s
    pool.notify()  # a larger queue or more seats may take waiting requests
