"""Router configuration: YAML checked against a JSON Schema before anything listens."""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson
import yaml

from narwhal import telemetry
from narwhal.router.config_schema import SCHEMA, TOKEN_ID_DIALECTS
from narwhal.router.urls import credentials

_VALIDATOR = jsonschema_rs.validator_for(SCHEMA)


class RouterConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Launch:
    model: str
    parallel: int = 4
    port: int | None = None
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineSpec:
    name: str
    dialect: str = "lexi"
    url: str | None = None
    launch: Launch | None = None
    api_key_env: str | None = None  # the variable holding the engine's own API key
    # The models it serves, as the engine names them; None: the router's `model` alone.
    models: tuple[str, ...] | None = None
    discover: bool = False  # `models: auto`: what its own /v1/models lists, probe by probe

    @property
    def several_models(self) -> bool:
        """It serves (or may serve, `auto`) more than one model."""
        return self.discover or (self.models is not None and len(self.models) > 1)

    def serves(self, default: str) -> tuple[str, ...]:
        """The models it serves, `default` (the router's `model`) where none were listed."""
        return self.models if self.models is not None else (default,)

    @property
    def token_ids(self) -> bool:
        return self.dialect in TOKEN_ID_DIALECTS


@dataclass(frozen=True)
class TenantKey:
    """A client key that names a tenant, with the tenant's limits (None: no limit)."""

    tenant: str
    key: str | None = None
    key_env: str | None = None  # the variable holding the key
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    priority: str = "standard"  # its requests' class, the highest x-narwhal-priority may ask
    models: tuple[str, ...] | None = None  # the public model names it may use (None: any)


@dataclass(frozen=True)
class EtcdSourceSpec:
    """Engines registered under a prefix in etcd (each key's last segment is a name)."""

    endpoints: tuple[str, ...]
    prefix: str


@dataclass(frozen=True)
class DnsSourceSpec:
    """Engines at the addresses a DNS name resolves to (a Kubernetes headless Service)."""

    name: str
    port: int
    dialect: str = "lexi"
    every_s: float = 5.0
    nameserver: str | None = None  # host[:port]; None: the system's resolver
    api_key_env: str | None = None
    models: tuple[str, ...] | None = None  # what each serves, as `engines[].models`
    discover: bool = False  # `models: auto`


@dataclass(frozen=True)
class HA:
    """Several routers on etcd: one leader on a lease and the rest standing by (`standby`,
    router/ha/leadership.py), or every router placing and relaying with one picture of
    the fleet exchanged between them (`active`, router/peering/)."""

    etcd: tuple[str, ...]
    key: str = "/narwhal/main/leader"
    lease_ttl_s: int = 5
    # A leader that has reached no engine for this long steps aside for a router that does.
    resign_unhealthy_s: float = 10.0
    # The variable holding the secret engines with `--fence-secret` want beside a fencing
    # token before it may raise their floor (x-narwhal-fence-secret).
    fence_secret_env: str | None = None
    mode: str = "standby"  # standby | active
    # Active: the variable holding the secret routers show each other (their picture
    # exchange) and seed their prompt block hashes with (the same on every router).
    peer_secret_env: str | None = None
    # Active: where the other routers reach this one (http://host:port); default: the
    # listen address, which must then not be a wildcard.
    advertise_url: str | None = None
    advertise_url_env: str | None = None  # ...or the variable that holds it (a pod's address)

    @property
    def active(self) -> bool:
        return self.mode == "active"

    @property
    def margin_s(self) -> float:
        """Taken off the TTL: a renewal's time on the wire and the clocks' rate difference."""
        return max(0.5, 0.2 * self.lease_ttl_s)

    def sibling(self, name: str) -> str:
        """A key next to the leader key (`/narwhal/main/leader` -> `/narwhal/main/NAME`)."""
        return self.key.rsplit("/", 1)[0] + "/" + name


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[EngineSpec, ...]
    model: str = "main"
    host: str = "127.0.0.1"
    port: int = 8000
    admission: str = "predictive"
    max_request_bytes: int = 1048576
    http_retention_limit: int = 1024
    request_timeout_s: float = 600.0
    # In-flight requests' time to finish after SIGTERM: inside Kubernetes' 30 s.
    shutdown_grace_s: float = 25.0
    header_timeout_s: float = 10.0  # a request head (or the next one, keep-alive) must come
    body_timeout_s: float = 30.0  # a request body must arrive whole within this
    max_connections: int = 8192  # client connections served at once
    stream_idle_timeout_s: float = 120.0  # an engine silent this long mid-answer has stalled
    # Streams relayed from the upstream socket's read callback, in Rust, where the server's
    # send allows (Granian's does): bench/README.md measures what it saves per token.
    native_relay: bool = True
    # "auto" (one CPU), "none" (the OS decides) or the CPU numbers: router/affinity.py.
    cpu_affinity: str | tuple[int, ...] = "auto"
    queue_size: int = 256
    queue_wait_s: float = 30.0
    prefill_concurrency: int = 4
    decode_concurrency: int = 64
    ttft_budget_s: float = 2.0
    drift_bound: float = 1.1  # |ln(observed/predicted)| EWMA: beyond ~3x off is degraded
    drift_min_samples: int = 5
    stale_after_s: float = 120.0
    probe_interval_s: float = 10.0
    # A conversation's prompt refused for its TTFT is prefilled anyway on an engine with room,
    # so that its next turn finds it in cache (router/warming.py).
    warm_refused: bool = False  # off: its measured effect is not yet a gain (DECISIONS)
    # Mean time per output token to keep: placement avoids engines where a new prompt's
    # prefill would push their streams past it; None: TTFT alone decides.
    tpot_target_s: float | None = None
    # A sheddable request's TTFT budget is this share of its own: as load rises it is
    # refused before standard and critical work is.
    sheddable_headroom: float = 0.5
    # Where a key may send critical work, standard work is judged against this much less
    # of its budget: under overload the engines keep that room for critical requests.
    critical_reserve: float = 0.2
    # What placement assumes each engine's prefix cache holds (0: no cache-aware placement),
    # and the text block its picture is kept in (router/policies/prefix_cache.py).
    prefix_cache_tokens: int = 400_000
    prefix_block_bytes: int = 512
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    eject_after: int = 3  # request faults in a row that take an engine out until a probe
    ha: HA | None = None  # several routers; None: this router is its own leader
    etcd_source: EtcdSourceSpec | None = None  # engines_from.etcd
    dns_source: DnsSourceSpec | None = None  # engines_from.dns
    # What engines added at runtime (admin API, etcd, DNS) may name: the addresses they may
    # be at (CIDRs; none: anywhere but link-local) and the key variables they may use.
    runtime_allow: tuple[str, ...] = ()
    runtime_key_envs: tuple[str, ...] = ()
    # A removed engine's in-flight requests have this long to finish; then they end with
    # an error event.
    drain_timeout_s: float = 60.0
    admin_token_env: str | None = None  # the admin API's token, by environment variable
    decision_records: int = 1024  # the last requests' decision records kept (admin API)
    # OpenTelemetry traces (narwhal.telemetry): the collector's OTLP/HTTP URL (None: off),
    # the service name spans carry, and the share of requests traced (a sampled parent's
    # request always is).
    otlp_endpoint: str | None = None
    otel_service_name: str = "narwhal"
    otel_sample_ratio: float = 1.0
    api_keys: tuple[str, ...] = ()  # client keys (auth.api_keys); none: no client auth
    api_keys_env: str | None = None  # a variable holding more, comma-separated
    tenant_keys: tuple[TenantKey, ...] = ()  # auth.api_keys entries that name a tenant
    # Public model names and the served model each stands for (`aliases`), sorted.
    aliases: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> bytes:
        """The validated config as JSON: its fields, by name (the worker hand-off)."""
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> RouterConfig:
        d = orjson.loads(raw)
        engines = []
        for e in d.pop("engines"):
            la = e.pop("launch")
            launch = None if la is None else Launch(**{**la, "args": tuple(la["args"])})
            models = e.pop("models")
            engines.append(
                EngineSpec(**e, launch=launch, models=None if models is None else tuple(models))
            )
        if isinstance(d["cpu_affinity"], list):
            d["cpu_affinity"] = tuple(d["cpu_affinity"])
        d["api_keys"] = tuple(d["api_keys"])
        d["tenant_keys"] = tuple(_tenant_key(t) for t in d["tenant_keys"])
        d["aliases"] = tuple((a, m) for a, m in d["aliases"])
        if d["ha"] is not None:
            d["ha"] = HA(**{**d["ha"], "etcd": tuple(d["ha"]["etcd"])})
        if d["etcd_source"] is not None:
            src = d["etcd_source"]
            d["etcd_source"] = EtcdSourceSpec(tuple(src["endpoints"]), src["prefix"])
        if d["dns_source"] is not None:
            src = d["dns_source"]
            models = src.pop("models")
            d["dns_source"] = DnsSourceSpec(**src, models=None if models is None else tuple(models))
        d["runtime_allow"] = tuple(d["runtime_allow"])
        d["runtime_key_envs"] = tuple(d["runtime_key_envs"])
        return cls(engines=tuple(engines), **d)


def _plain(err: Any, data: Any, schema: dict[str, Any] = SCHEMA) -> str:
    """The rule a value breaks, in words drawn from the schema, never from the value: a
    config holds keys, and this message reaches the log, `/admin/reload` and `/ready`."""
    node: Any = data
    for part in err.instance_path:
        node = node[part]
    *where, keyword = [str(p) for p in err.schema_path] or ["?"]
    rule: Any = schema
    for part in where:
        rule = rule[int(part)] if isinstance(rule, list) else rule[part]
    want = rule.get(keyword) if isinstance(rule, dict) else None
    if keyword == "oneOf":  # the one oneOf: an engine's url or launch
        given = [k for k in ("url", "launch") if isinstance(node, dict) and k in node]
        if len(given) == 2:
            return "give `url` (an engine to call) or `launch` (a LexiEngine to run), not both"
        return "give `url` (an engine to call) or `launch` (a LexiEngine to run)"
    if keyword == "additionalProperties" and isinstance(node, dict):
        allowed = set(rule.get("properties", {}))
        unknown = sorted(str(k)[:64] for k in node if k not in allowed)
        return f"unknown field {unknown[0]!r}" if unknown else "unknown field"
    if keyword == "required" and isinstance(node, dict):
        lacking = [k for k in want or () if k not in node]
        return f"lacks the field {lacking[0]!r}" if lacking else "lacks a required field"
    if keyword == "anyOf" and isinstance(want, list):
        # The form of the value's own type says what is wrong with it.
        for form in want:
            kind = form.get("type")
            if kind is not None and _is(node, kind):
                check = jsonschema_rs.validator_for(form)
                sub = next(iter(check.iter_errors(node)), None)
                if sub is not None:
                    inner = ".".join(str(p) for p in sub.instance_path)
                    said = _plain(sub, node, form)
                    return f"{inner}: {said}" if inner else said
        return "matches none of the forms allowed here"
    return _words(keyword, want)


def _words(keyword: str, want: Any) -> str:
    """A schema keyword's rule in words (the schema's own numbers and names)."""
    if keyword == "type":
        return f"must be of type {want}"
    if keyword == "enum":
        return f"must be one of {', '.join(map(str, want or ()))}"
    if keyword == "pattern":
        return f"must match the pattern {want}"
    bounds = {
        "minLength": "must be at least {} characters long",
        "maxLength": "must be at most {} characters long",
        "minimum": "must be at least {}",
        "maximum": "must be at most {}",
        "exclusiveMinimum": "must be more than {}",
        "exclusiveMaximum": "must be less than {}",
        "minItems": "must list at least {}",
        "minProperties": "must give at least {} field",
    }
    if keyword in bounds:
        return bounds[keyword].format(want)
    if keyword == "uniqueItems":
        return "must not list an item twice"
    return f"breaks the schema's rule {keyword!r}"


def _is(value: Any, kind: str) -> bool:
    types = {"string": str, "object": dict, "array": list, "boolean": bool}
    return isinstance(value, types[kind]) if kind in types else False


def _path(err: Any) -> str:
    parts = [str(p) for p in getattr(err, "instance_path", [])]
    return ".".join(parts) or "<root>"


def parse(data: Any) -> RouterConfig:
    if not isinstance(data, dict):
        raise RouterConfigError("<root>: the config must be a mapping")
    errors = sorted(_VALIDATOR.iter_errors(data), key=lambda e: list(map(str, e.instance_path)))
    if errors:
        raise RouterConfigError("; ".join(f"{_path(e)}: {_plain(e, data)}" for e in errors))
    if "engines" not in data:
        data = {**data, "engines": []}
    sources = data.get("engines_from", {})
    if not data["engines"] and not {"etcd", "dns"} & set(sources) and "admin" not in data:
        raise RouterConfigError(
            "engines: no engines: list them, or give `engines_from` (etcd or DNS) or an "
            "admin token (`admin`) to add them while the router runs"
        )
    engines = _engines(data["engines"])
    given: dict[str, Any] = {}
    for (section, key), name in _FIELDS.items():
        value = (data.get(section, {}) if section else data).get(key)
        if value is not None:
            given[name] = float(value) if isinstance(getattr(_DEFAULTS, name), float) else value
    if "cpu_affinity" in given:
        given["cpu_affinity"] = _affinity(given["cpu_affinity"])
    if "ha" in data:
        h = data["ha"]
        given["ha"] = HA(
            tuple(h["etcd"]),
            h.get("key", HA.key),
            h.get("lease_ttl_s", HA.lease_ttl_s),
            float(h.get("resign_unhealthy_s", HA.resign_unhealthy_s)),
            h.get("fence_secret_env"),
            h.get("mode", HA.mode),
            h.get("peer_secret_env"),
            h.get("advertise_url"),
            h.get("advertise_url_env"),
        )
    if "admin" in data:
        given["admin_token_env"] = data["admin"]["token_env"]
        if "decision_records" in data["admin"]:
            given["decision_records"] = data["admin"]["decision_records"]
    given.update(_sources(sources))
    auth = data.get("auth", {})
    keys = auth.get("api_keys") or []
    if any(isinstance(k, str) for k in keys):
        given["api_keys"] = tuple(k for k in keys if isinstance(k, str))
    if any(isinstance(k, dict) for k in keys):
        given["tenant_keys"] = _tenant_keys(keys)
    if "api_keys_env" in auth:
        given["api_keys_env"] = auth["api_keys_env"]
    if "aliases" in data:
        given["aliases"] = tuple(sorted(data["aliases"].items()))
    if given.get("otlp_endpoint") and not telemetry.installed():
        raise RouterConfigError(
            "telemetry: traces need the OpenTelemetry SDK, which is not installed: "
            "pip install 'narwhal-serve[telemetry]'"
        )
    config = replace(_DEFAULTS, engines=engines, **given)
    if config.ha is not None and config.ha.active:
        _check_active(config.ha, config.host)
    return config


def _check_active(ha: HA, host: str) -> None:
    """Active routers show each other a secret, and are reached at an address each can
    tell the others."""
    if not ha.peer_secret_env:
        raise RouterConfigError(
            "ha.peer_secret_env: `mode: active` needs a secret the routers share (their "
            "picture exchange is refused without it): name the variable that holds it"
        )
    if ha.advertise_url is not None and ha.advertise_url_env is not None:
        raise RouterConfigError("ha: advertise_url or advertise_url_env, not both")
    if ha.advertise_url is None and ha.advertise_url_env is None and host in ("0.0.0.0", "::", ""):
        raise RouterConfigError(
            f"ha.advertise_url: the router listens on every address ({host}): say where "
            "the other routers reach this one (http://host:port)"
        )


def _tenant_key(k: dict[str, Any]) -> TenantKey:
    models = k.get("models")
    return TenantKey(**{**k, "models": None if models is None else tuple(models)})


def _tenant_keys(listed: list[Any]) -> tuple[TenantKey, ...]:
    """The keys that name a tenant. A tenant's limits and class are the tenant's, shared by
    its keys: two keys of one tenant that say different things are refused here, rather
    than one of them being silently ignored (docs/DECISIONS.md)."""
    first: dict[str, tuple[int, TenantKey]] = {}
    out = []
    for i, k in enumerate(listed):
        if not isinstance(k, dict):
            continue
        t = _tenant_key(k)
        seen = first.setdefault(t.tenant, (i, t))
        j, other = seen
        if (t.rpm, t.tpm, t.max_concurrent, t.priority, t.models) != (
            other.rpm,
            other.tpm,
            other.max_concurrent,
            other.priority,
            other.models,
        ):
            raise RouterConfigError(
                f"auth.api_keys.{i}: tenant {t.tenant!r} is also given by auth.api_keys.{j} "
                "with another priority or other limits: a tenant's keys share one class and "
                "one set of limits (give them the same, or make them two tenants)"
            )
        out.append(t)
    return tuple(out)


def _engines(listed: list[dict[str, Any]]) -> tuple[EngineSpec, ...]:
    names = [e["name"] for e in listed]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise RouterConfigError(f"engines: duplicate engine name {sorted(dupes)[0]!r}")
    engines = []
    for i, e in enumerate(listed):
        if "api_key_env" in e and "url" in e and credentials(e["url"]) is not None:
            raise RouterConfigError(
                f"engines.{i}: give the engine's key in `api_key_env` or in the URL, not both"
            )
        launch = None
        if "launch" in e:
            la = e["launch"]
            launch = Launch(
                la["model"], la.get("parallel", 4), la.get("port"), tuple(la.get("args", ()))
            )
        said = e.get("models")
        models = tuple(said) if isinstance(said, list) else None
        engines.append(
            EngineSpec(
                e["name"],
                e.get("dialect", "lexi"),
                e.get("url"),
                launch,
                e.get("api_key_env"),
                models,
                said == "auto",
            )
        )
    return tuple(engines)


def _sources(sources: dict[str, Any]) -> dict[str, Any]:
    """`engines_from`'s etcd and DNS sources, as RouterConfig fields."""
    given: dict[str, Any] = {}
    if "etcd" in sources:
        src = sources["etcd"]
        given["etcd_source"] = EtcdSourceSpec(tuple(src["endpoints"]), src["prefix"])
    if "allow" in sources:
        for cidr in sources["allow"]:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise RouterConfigError(
                    f"engines_from.allow: {cidr[:64]!r} is not a CIDR (10.0.0.0/8, fd00::/8)"
                ) from None
        given["runtime_allow"] = tuple(sources["allow"])
    if "api_key_envs" in sources:
        given["runtime_key_envs"] = tuple(sources["api_key_envs"])
    if "dns" in sources:
        src = sources["dns"]
        given["dns_source"] = DnsSourceSpec(
            src["name"],
            src["port"],
            src.get("dialect", DnsSourceSpec.dialect),
            float(src.get("every_s", DnsSourceSpec.every_s)),
            src.get("nameserver"),
            src.get("api_key_env"),
            tuple(src["models"]) if isinstance(src.get("models"), list) else None,
            src.get("models") == "auto",
        )
    return given


# Where each RouterConfig field sits in the YAML ("" for the top level). The defaults are
# the dataclass's own, written once.
_FIELDS = {
    ("", "model"): "model",
    ("listen", "host"): "host",
    ("listen", "port"): "port",
    ("", "admission"): "admission",
    ("serving", "max_request_bytes"): "max_request_bytes",
    ("serving", "http_retention_limit"): "http_retention_limit",
    ("serving", "request_timeout_s"): "request_timeout_s",
    ("serving", "shutdown_grace_s"): "shutdown_grace_s",
    ("serving", "header_timeout_s"): "header_timeout_s",
    ("serving", "body_timeout_s"): "body_timeout_s",
    ("serving", "max_connections"): "max_connections",
    ("serving", "stream_idle_timeout_s"): "stream_idle_timeout_s",
    ("serving", "drain_timeout_s"): "drain_timeout_s",
    ("serving", "native_relay"): "native_relay",
    ("serving", "cpu_affinity"): "cpu_affinity",
    ("queue", "size"): "queue_size",
    ("queue", "wait_s"): "queue_wait_s",
    ("phases", "prefill_concurrency"): "prefill_concurrency",
    ("phases", "decode_concurrency"): "decode_concurrency",
    ("predictive", "ttft_budget_s"): "ttft_budget_s",
    ("predictive", "drift_bound"): "drift_bound",
    ("predictive", "drift_min_samples"): "drift_min_samples",
    ("predictive", "stale_after_s"): "stale_after_s",
    ("predictive", "probe_interval_s"): "probe_interval_s",
    ("predictive", "warm_refused"): "warm_refused",
    ("predictive", "tpot_target_s"): "tpot_target_s",
    ("predictive", "sheddable_headroom"): "sheddable_headroom",
    ("predictive", "critical_reserve"): "critical_reserve",
    ("prefix_cache", "tokens_per_engine"): "prefix_cache_tokens",
    ("prefix_cache", "block_bytes"): "prefix_block_bytes",
    ("health", "interval_s"): "health_interval_s",
    ("health", "timeout_s"): "health_timeout_s",
    ("health", "eject_after"): "eject_after",
    ("telemetry", "otlp_endpoint"): "otlp_endpoint",
    ("telemetry", "service_name"): "otel_service_name",
    ("telemetry", "sample_ratio"): "otel_sample_ratio",
}
_DEFAULTS = RouterConfig(engines=())
_NAMES = {name: f"{s}.{k}" if s else k for (s, k), name in _FIELDS.items()} | {
    "engines": "engines",
    "ha": "ha",
    "etcd_source": "engines_from.etcd",
    "dns_source": "engines_from.dns",
    "runtime_allow": "engines_from.allow",
    "runtime_key_envs": "engines_from.api_key_envs",
    "api_keys": "auth.api_keys",
    "tenant_keys": "auth.api_keys",
    "api_keys_env": "auth.api_keys_env",
    "admin_token_env": "admin.token_env",
    "decision_records": "admin.decision_records",
}


def yaml_name(field: str) -> str:
    """Where a RouterConfig field is set in the YAML (`health.interval_s`)."""
    return _NAMES.get(field, field)


def _affinity(value: str | list[int]) -> str | tuple[int, ...]:
    return value if isinstance(value, str) else tuple(value)


def load(path: str | Path) -> RouterConfig:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise RouterConfigError(f"cannot read {path}: {e.strerror}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RouterConfigError(f"{where}: not valid YAML: {problem}") from e
    return parse(data)
