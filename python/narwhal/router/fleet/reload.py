"""Reload: the config file read again while the router runs (SIGHUP, or `POST
/admin/reload`).

A file that does not load, or that changes anything a reload does not apply (`APPLIED`:
where the router listens, its model, admission, `ha`, the engine sources, the managed
engines, the client and admin keys, the server's own limits all need a restart), is
refused, naming what changed: the running config stays, the error is logged and shown on
`/ready` (`reload_error`) until a good reload. A reload never answers that it applied
what it did not.
Otherwise the config-file engines are made to match (new ones added, gone ones drained,
changed ones drained and added again) and the admission and serving settings apply to
requests from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields

from narwhal.router.admission import Admission
from narwhal.router.config import RouterConfig, RouterConfigError, load, yaml_name
from narwhal.router.engines import Pool
from narwhal.router.fleet.membership import Conflict, Membership
from narwhal.router.policies import Policy
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.predict import Predictor
from narwhal.router.profiling import Profiler
from narwhal.router.relay.relayer import Relayer
from narwhal.router.tenants.registry import Tenants, auth_problem

log = logging.getLogger("narwhal.fleet")

# What a reload applies: the config-file engines (`_engines`) and the settings `settle`
# hands to whoever reads them per request or per round. Every other field is read once,
# at start (the listener and Granian's limits, the model, admission, HA, the sources and
# their rules, the prefix-cache picture's size, the keys), and a change to it is refused.
APPLIED = frozenset(
    {
        "engines",
        "max_request_bytes",
        "http_retention_limit",
        "request_timeout_s",
        "body_timeout_s",
        "stream_idle_timeout_s",
        "drain_timeout_s",
        "queue_size",
        "queue_wait_s",
        "prefill_concurrency",
        "decode_concurrency",
        "ttft_budget_s",
        "tpot_target_s",
        "sheddable_headroom",
        "critical_reserve",
        "drift_bound",
        "drift_min_samples",
        "stale_after_s",
        "probe_interval_s",
        "health_interval_s",
        "health_timeout_s",
        "eject_after",
    }
)
FIXED = tuple(f.name for f in fields(RouterConfig) if f.name not in APPLIED)


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
        auth = auth_problem(new)
        if auth is not None:
            return self._refuse(auth)
        fixed = [yaml_name(k) for k in FIXED if getattr(new, k) != getattr(self.config, k)]
        if fixed:
            named = ", ".join(dict.fromkeys(fixed))
            return self._refuse(f"{named}: a change here needs a restart")
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
    tenants: Tenants,
    predictor: Predictor | None = None,
    profiler: Profiler | None = None,
) -> None:
    """A reloaded config's admission and serving settings (`APPLIED`), to each that reads
    them per request or per round."""
    admission.retention_limit = new.http_retention_limit
    admission.queue_size, admission.wait_s = new.queue_size, new.queue_wait_s
    pool.prefill_limit, pool.decode_limit = new.prefill_concurrency, new.decode_concurrency
    pool.eject_after = new.eject_after
    membership.drain_timeout_s = new.drain_timeout_s
    relayer.idle_s = new.stream_idle_timeout_s
    tenants.reserve.configure(new.critical_reserve, new.ttft_budget_s)
    tenants.shares.budget_s = new.ttft_budget_s
    pool.probe_interval_s, pool.probe_timeout_s = new.health_interval_s, new.health_timeout_s
    if isinstance(policy, PredictivePolicy):
        policy.tpot_target_s = new.tpot_target_s
        policy.budget_s = new.ttft_budget_s
    if predictor is not None:
        predictor.drift_bound = new.drift_bound
        predictor.drift_min_samples = new.drift_min_samples
        predictor.stale_after_s = new.stale_after_s
    if profiler is not None:
        profiler.interval_s = new.probe_interval_s
    pool.notify()  # a larger queue or more seats may take waiting requests
