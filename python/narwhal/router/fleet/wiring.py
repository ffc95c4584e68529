"""The fleet's parts, built once for a router: the pool of the config file's engines,
membership and who hears of its changes, the sources that feed it (etcd, DNS, the admin
edits of `ha`), the admin routes and the reloader."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from narwhal.background import Background
from narwhal.etcd import Etcd
from narwhal.router.config import RouterConfig
from narwhal.router.engines import Engine, Pool
from narwhal.router.fleet.admin import EnginesAdmin
from narwhal.router.fleet.dns_source import DnsSource
from narwhal.router.fleet.etcd_source import EtcdSource
from narwhal.router.fleet.membership import Hooks, Membership
from narwhal.router.fleet.reload import Reloader
from narwhal.router.fleet.rules import Rules, networks, own_endpoints
from narwhal.router.ha.leadership import Leadership
from narwhal.router.metrics import RouterMetrics
from narwhal.router.policies import Policy
from narwhal.router.relay.relayer import Relayer
from narwhal.router.supervisor import ManagedEngine, fatal

CONFIG_PATH_ENV = "NARWHAL_ROUTER_CONFIG_PATH"  # the YAML itself, for reloads


def pool_of(config: RouterConfig, metrics: RouterMetrics) -> Pool:
    """The config file's engines: called, or launched and supervised (`supervisor`)."""
    engines = []
    for spec in config.engines:
        if spec.launch is not None:
            traces = (
                (config.otlp_endpoint, config.otel_sample_ratio) if config.otlp_endpoint else None
            )
            me = ManagedEngine(spec, config.model, on_fatal=fatal, traces=traces)
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


def rules_of(config: RouterConfig) -> Rules:
    """What engines from runtime sources may name, from the config file."""
    etcd = list(config.ha.etcd if config.ha else ())
    if config.etcd_source is not None:
        etcd += config.etcd_source.endpoints
    return Rules(
        frozenset(config.runtime_key_envs),
        networks(config.runtime_allow),
        own_endpoints(etcd, (config.host, config.port)),
    )


class Fleet:
    def __init__(
        self,
        config: RouterConfig,
        pool: Pool,
        policy: Policy,
        relayer: Relayer,
        metrics: RouterMetrics,
        leadership: Leadership,
        settings: Callable[[RouterConfig], None],
    ) -> None:
        hooks = Hooks()
        changes = metrics.membership
        hooks.added += [
            policy.added,
            lambda e: pool.probe_soon(),
            lambda e: changes.labels("added", e.source).inc(),
        ]
        hooks.cut.append(relayer.cut)
        hooks.removed += [
            policy.removed,
            relayer.forget,
            lambda e: metrics.forget(e.name),
            lambda e: changes.labels("removed", e.source).inc(),
        ]
        self.membership = Membership(pool, config.drain_timeout_s, hooks, rules_of(config))
        ha = config.ha
        edits = ha.sibling("engines") + "/" if ha is not None else None
        self.admin = EnginesAdmin(self.membership, leadership, leadership.etcd, edits)
        self.reloader = Reloader(os.environ.get(CONFIG_PATH_ENV), config, self.membership, settings)
        self.sources: dict[str, EtcdSource | DnsSource] = {}
        if config.etcd_source is not None:
            src = config.etcd_source
            etcd = Etcd(list(src.endpoints))
            self.sources["etcd"] = EtcdSource(etcd, src.prefix, self.membership)
        if config.dns_source is not None:
            self.sources["dns"] = DnsSource(config.dns_source, self.membership)
        if edits is not None and leadership.etcd is not None:
            self.sources["admin"] = EtcdSource(leadership.etcd, edits, self.membership, "admin")

    def start(self, bg: Background) -> None:
        bg.start("engine_drains", self.membership.drain_forever)
        for name, source in self.sources.items():
            bg.start(f"engines_from_{name}", source.follow_forever)

    def stale(self) -> dict[str, str]:
        """Sources whose last read failed (the last good set serves meanwhile)."""
        return {name: src.error for name, src in self.sources.items() if src.error}

    async def close(self) -> None:
        source = self.sources.get("etcd")
        if isinstance(source, EtcdSource):
            await source.etcd.close()
