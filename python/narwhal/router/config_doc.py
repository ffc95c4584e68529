"""docs/CONFIG.md, generated from the config's JSON Schema and the dataclasses' defaults, so
the reference cannot drift from what `narwhal serve` accepts (a test compares the two).

    .venv/bin/python -m narwhal.router.config_doc > docs/CONFIG.md
"""

from __future__ import annotations

import dataclasses
from typing import Any

from narwhal.router.config import (
    _FIELDS,
    HA,
    DnsSourceSpec,
    EngineSpec,
    Launch,
    RouterConfig,
)
from narwhal.router.config_schema import SCHEMA

# What each key means, by its dotted path (`[]` for a list's items). Every key of the schema
# must be here: render() refuses to leave one out.
MEANINGS = {
    "model": "the model clients ask for (`model` in requests, `/v1/models`), and the one a "
    "request that names none gets; every engine without `models` serves it",
    "aliases": "public model names and the served model each stands for, `{chat: "
    "llama-3.1-8b}`: a request for `chat` goes to the engines serving `llama-3.1-8b`, and the "
    "engine is asked for that name; both are listed on `/v1/models`",
    "listen": "where the router listens",
    "listen.host": "address or host name (a name resolves, IPv4 first)",
    "listen.port": "TCP port; a port another process listens on is refused at start",
    "admission": "`predictive` (refuse what cannot start within the TTFT budget) or `open`",
    "serving": "limits on client requests and connections",
    "serving.max_request_bytes": "larger request bodies are 413",
    "serving.http_retention_limit": "requests the router holds at once; 429 beyond",
    "serving.request_timeout_s": "a request's whole deadline (`x-narwhal-timeout-ms` may "
    "shorten it): 504 before the first byte, an error event after",
    "serving.shutdown_grace_s": "after the first SIGTERM/SIGINT, in-flight requests may finish "
    "for this long; a second signal stops at once",
    "serving.header_timeout_s": "a request head (or a kept-alive connection's next one) must "
    "arrive within this; a connection that sends nothing is closed after it too",
    "serving.body_timeout_s": "a request body must arrive whole within this (408)",
    "serving.max_connections": "client connections served at once (more wait in the backlog)",
    "serving.stream_idle_timeout_s": "an engine silent this long mid-answer has stalled: the "
    "stream ends with an `engine_stalled` error event",
    "serving.drain_timeout_s": "an engine being removed (`DELETE /admin/engines/NAME`, its "
    "key gone from etcd, its address gone from DNS) gets nothing new; its in-flight requests "
    "have this long to finish, then end with an `engine_removed` error event",
    "serving.native_relay": "relay streams from the upstream socket's read callback in Rust "
    "where the ASGI server allows (Granian); `false`: each chunk sent from Python",
    "serving.cpu_affinity": "`auto` (one CPU, the highest-numbered allowed), `none`, or a list "
    "of CPU numbers for the router's own threads",
    "queue": "the admission queue in front of the engines",
    "queue.size": "requests that may wait for a seat; 429 `queue_full` beyond",
    "queue.wait_s": "how long a request may wait; 504 `admission_timeout` after",
    "phases": "seats per engine",
    "phases.prefill_concurrency": "requests before their first token, per engine",
    "phases.decode_concurrency": "requests streaming tokens, per engine",
    "predictive": "predictive TTFT admission",
    "predictive.ttft_budget_s": "the TTFT budget (`x-narwhal-ttft-target-ms` per request)",
    "predictive.drift_bound": "the typical miss (an EWMA of the absolute log of observed over "
    "predicted TTFT) beyond which predictions are not trusted: 503 `monitoring_degraded`",
    "predictive.drift_min_samples": "scored outcomes before drift counts",
    "predictive.stale_after_s": "an engine's profile older than this is stale",
    "predictive.probe_interval_s": "an idle engine is probed when its profile is this old",
    "predictive.warm_refused": "a conversation's prompt refused for its TTFT is prefilled "
    "anyway on an engine with nothing ahead (answer discarded, yielding to any live request "
    "seated there), so that its next turn finds it in cache (off by default)",
    "predictive.sheddable_headroom": "a `sheddable` request's TTFT budget is this share of "
    "its own, so as load rises it is refused before standard and critical work",
    "predictive.critical_reserve": "where a key may send `critical` work, `standard` work is "
    "admitted against this much less of its TTFT budget, and lower classes leave critical "
    "streams this share of the budget in seconds of their TPOT allowance, so under overload "
    "the engines keep that room for critical requests; the least reserved: it grows while "
    "critical requests are refused for room, and decays back (no effect without a critical "
    "key; 0 reserves nothing)",
    "predictive.tpot_target_s": "mean time per output token to keep for every admitted stream: "
    "a prompt is placed only where its prefill pushes no stream decoding there past it; when no "
    "engine within the TTFT budget can take it, it waits for a stream to end while the budget "
    "allows, then 429 tpot_target_exceeded (unset: TTFT alone decides)",
    "prefix_cache": "cache-aware placement: the router's picture of each engine's prefix cache",
    "prefix_cache.tokens_per_engine": "prompt tokens each engine's prefix cache is assumed to "
    "hold (its KV pool); the picture is corrected by the cached tokens engines report; 0 turns "
    "cache-aware placement off",
    "prefix_cache.block_bytes": "prompt text is hashed in blocks of this many bytes (chained, "
    "as engines chain KV blocks)",
    "health": "health probes and the circuit breaker",
    "health.interval_s": "time between `/health` probes of each engine",
    "health.timeout_s": "a probe's timeout",
    "health.eject_after": "request faults in a row that take an engine out until a probe passes",
    "ha": "several routers: leadership on an etcd lease (README: Several routers)",
    "ha.etcd": "etcd endpoints (`http://host:2379`, every member of the cluster), tried in "
    "turn from the one that answered last",
    "ha.key": "the leader key; the maintenance wave and predictor profiles live beside it",
    "ha.lease_ttl_s": "the lease's TTL: a dead leader is replaced within it; a leader stops "
    "placing work 20 % (at least 0.5 s) before it could lapse",
    "ha.resign_unhealthy_s": "a leader that has reached no healthy engine for this long steps "
    "aside when another router reaches one, and stays out of the next election for a while",
    "auth": "client authentication: requests to `/v1/...` need `Authorization: Bearer KEY` "
    "(401 otherwise); `/health`, `/ready` and `/metrics` stay open",
    "auth.api_keys": "accepted client keys: a key as a string, or a tenant's key with its "
    "limits, `{key_env: NAME (or key: ...), tenant: team-a, rpm: 600, tpm: 2000000, "
    "max_concurrent: 32, priority: standard, models: [chat]}` (requests a minute, prompt + "
    "output tokens a minute, requests at once, each optional: past one, 429 "
    "`tenant_rate_limited` with `Retry-After`; `priority`: `critical`, `standard` or "
    "`sheddable`, the highest class its requests may ask for with `x-narwhal-priority`; "
    "`models`: the model names (aliases included) its requests may ask for, 403 "
    "`model_not_allowed` for another; none listed: any)",
    "auth.api_keys_env": "an environment variable holding more keys, comma-separated (keeps "
    "them out of the file)",
    "telemetry": "OpenTelemetry traces over OTLP/HTTP (protobuf); off without it. A request's "
    "span has a child per stage (intake, placement with its decision record, queue, the "
    "upstream call, relay); the call to the engine carries `traceparent`, so LexiEngine's "
    "spans (`--otlp-endpoint`; given to the engines it launches) join the trace",
    "telemetry.otlp_endpoint": "the collector's OTLP/HTTP base URL (`http://collector:4318`; "
    "spans go to its `/v1/traces`)",
    "telemetry.service_name": "the `service.name` the spans carry (default `narwhal`)",
    "telemetry.sample_ratio": "the share of requests traced, 0 to 1 (default 1); a request "
    "whose `traceparent` says sampled is traced whatever the ratio",
    "admin": "the admin API (`/admin/maintenance`, `/admin/engines`); without it there are "
    "no admin routes",
    "admin.token_env": "the environment variable that holds the admin Bearer token",
    "admin.decision_records": "how many of the last requests' decision records are kept "
    "(`GET /admin/requests/ID`: the engines weighed, each one's projected TTFT and expected "
    "cache, the choice or refusal and why, what was measured); 0 keeps none",
    "engines_from": "engines that come and go while the router runs (README: Running a "
    "fleet); with `engines` too, both sets serve",
    "ha.mode": "`standby` (the default): one leader places, the others answer 503 "
    "`not_leader` and take over within the TTL; `active`: every router places and relays, "
    "each on its own lease and fencing token, and they exchange what they place (README: "
    "Several routers)",
    "ha.peer_secret_env": "`active`: an environment variable holding the secret the routers "
    "show each other on their picture exchange (`/internal/v1/picture`, refused without "
    "it); it also seeds their prompt block hashes, the same on every router",
    "ha.advertise_url": "`active`: where the other routers reach this one "
    "(`http://10.0.0.5:8000`); default: the listen address (required when that is a "
    "wildcard)",
    "ha.advertise_url_env": "`active`: an environment variable holding `advertise_url` (on "
    "Kubernetes, `http://$(POD_IP):8080` from the downward API)",
    "ha.fence_secret_env": "an environment variable holding the fence secret: sent beside "
    "the fencing token (`x-narwhal-fence-secret`) to engines run with `--fence-secret`, "
    "which let only it raise their floor",
    "engines_from.allow": "CIDRs that engines added at runtime (admin API, etcd, DNS) may be "
    "at, checked on every address their name resolves to (default: anywhere but link-local "
    "addresses such as 169.254.169.254); never the router's own etcd or listener",
    "engines_from.api_key_envs": "the environment variables an engine added at runtime may "
    "name as its `api_key_env` (default: none): a registrant cannot ask for any other secret",
    "engines_from.etcd": "engines registered in etcd (`lexi-engine serve --register-etcd`, or "
    "`narwhal register` beside any engine): a key added is an engine added, a key deleted or "
    "expired an engine drained",
    "engines_from.etcd.endpoints": "etcd endpoints (`http://host:2379`)",
    "engines_from.etcd.prefix": "the keys under it name engines (the last segment is the "
    'engine\'s name); each value is JSON: `{"url": ..., "dialect": ...}`',
    "engines_from.dns": "engines at every address a DNS name resolves to (A and AAAA: a "
    "Kubernetes headless Service), named `LABEL-ADDRESS` (the name's first label)",
    "engines_from.dns.name": "the name to resolve",
    "engines_from.dns.port": "the engines' port",
    "engines_from.dns.dialect": "the engines' dialect",
    "engines_from.dns.every_s": "time between resolutions; an address gone is drained, a new "
    "one added; a failed resolution keeps the last good set (and says so on `/ready`)",
    "engines_from.dns.nameserver": "`host[:port]` of the DNS server to ask (default: the "
    "system's resolver)",
    "engines_from.dns.api_key_env": "an environment variable holding the engines' API key",
    "engines": "the engines requests are placed on (none only with `engines_from` or "
    "`admin`: engines are then added while the router runs)",
    "engines[].name": "a unique name: letters, digits, `_.-`",
    "engines[].url": "an engine to call (`http(s)://host:port`, optional `user:pass@`); "
    "give `url` or `launch`, not both",
    "engines[].api_key_env": "an environment variable holding the engine's own API key, sent "
    "as `Authorization: Bearer` (an engine started with `--api-key`)",
    "engines[].dialect": "`lexi`, `vllm`, `sglang`, `llamacpp` or `openai` (below)",
    "engines_from.dns.models": "what each engine the name resolves to serves, as "
    "`engines[].models` says (a list, or `auto`)",
    "engines[].models": "the models it serves, as the engine names them (a vLLM engine's "
    "served model and its LoRA adapters: `[llama-3.1-8b, sql-lora]`), or `auto`: what the "
    "engine's own `/v1/models` lists, read at every health probe (an adapter loaded or "
    "unloaded is followed within one); a request goes only to engines serving its model; "
    "none listed: the router's `model`",
    "engines[].launch": "a LexiEngine the router runs and supervises",
    "engines[].launch.model": "the GGUF file",
    "engines[].launch.parallel": "slots (`--parallel`)",
    "engines[].launch.port": "its port (default: a free one)",
    "engines[].launch.args": "more `lexi-engine serve` flags",
}

_HEAD = """# Configuration reference

`narwhal serve --config narwhal.yaml` reads this YAML. It is checked against a JSON Schema
before anything listens: an unknown key or a bad value is refused with its path and exit
status 2. Generated from `python/narwhal/router/config.py` by
`python -m narwhal.router.config_doc`; a test keeps the two in step.

| key | type | default | meaning |
|---|---|---|---|
"""

_TAIL = """
## Dialects

| dialect | engines | token accounting | what the router asks of it |
|---|---|---|---|
| `lexi` | LexiEngine | token IDs, exact | as vllm; `cache_prompt` off for probes |
| `vllm` | vLLM | token IDs, exact | `return_token_ids`, `stream_interval: 1`, usage |
| `sglang` | SGLang | unavailable: usage only | usage |
| `llamacpp` | llama-server | unavailable: usage only | usage; `cache_prompt: false` for probes |
| `openai` | anything OpenAI-compatible | unavailable: usage only | usage |

With token IDs the router validates and counts every output token (`narwhal_output_tokens`)
and strips the IDs unless the client asked for them; elsewhere it counts what usage says.

## Examples

One router, two engines, predictive admission:

```yaml
model: main
admission: predictive
predictive: {ttft_budget_s: 2.0}
engines:
  - {name: a, url: "http://127.0.0.1:8001", dialect: lexi}
  - {name: local, launch: {model: path/to/model.gguf, parallel: 4}}
```

Engines that register in etcd and engines a DNS name resolves to, added and drained while
the router runs (README: Running a fleet):

```yaml
model: main
admin: {token_env: NARWHAL_ADMIN_TOKEN}
engines_from:
  allow: ["10.0.0.0/16"]        # where registered engines may be
  api_key_envs: [ENGINE_KEY]    # the key variables they may name
  etcd: {endpoints: ["http://10.0.0.5:2379"], prefix: /narwhal/main/engines/}
  dns: {name: engines.default.svc.cluster.local, port: 8000, dialect: vllm, every_s: 5}
```

Two routers sharing leadership on etcd, with the admin API:

```yaml
model: main
ha: {etcd: ["http://10.0.0.5:2379"], key: /narwhal/main/leader, lease_ttl_s: 5}
admin: {token_env: NARWHAL_ADMIN_TOKEN}
engines:
  - {name: gpu0, url: "http://10.0.0.11:8080", dialect: lexi}
  - {name: vllm0, url: "http://10.0.0.12:8000", dialect: vllm}
```
"""


def _type(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if "anyOf" in node:
        return " or ".join(_type(n) for n in node["anyOf"])
    t = node.get("type", "")
    if t == "array":
        return f"list of {_type(node.get('items', {}))}"
    return {
        "integer": "integer",
        "number": "number",
        "string": "string",
        "boolean": "boolean",
        "object": "mapping",
    }.get(t, str(t))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if isinstance(v, tuple):
        return "`[]`" if not v else f"`{list(v)}`"
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return f"`{v}`"


def _defaults() -> dict[str, str]:
    base = RouterConfig(engines=())
    out = {
        ".".join(p for p in key if p): _fmt(getattr(base, name)) for key, name in _FIELDS.items()
    }
    for prefix, cls in (
        ("engines[].", EngineSpec),
        ("engines[].launch.", Launch),
        ("ha.", HA),
        ("engines_from.dns.", DnsSourceSpec),
    ):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[prefix + f.name] = _fmt(f.default)
    out["engines[].launch.port"] = "a free port"
    out["engines[].url"] = "-"
    out["engines[].launch"] = "-"
    return out


def _rows(
    node: dict[str, Any], path: str, required: set[str], out: list[str], defaults: dict[str, str]
) -> None:
    for key, sub in node.get("properties", {}).items():
        p = f"{path}{key}"
        if p not in MEANINGS:
            raise KeyError(f"config_doc.MEANINGS has nothing for {p}")
        default = "required" if key in required else defaults.get(p, "-")
        out.append(f"| `{p}` | {_type(sub)} | {default} | {MEANINGS[p]} |")
        if sub.get("type") == "object":
            _rows(sub, p + ".", set(sub.get("required", [])), out, defaults)
        elif sub.get("type") == "array" and sub.get("items", {}).get("type") == "object":
            items = sub["items"]
            _rows(items, p + "[].", set(items.get("required", [])), out, defaults)


def render() -> str:
    rows: list[str] = []
    _rows(SCHEMA, "", set(SCHEMA.get("required", [])), rows, _defaults())
    return _HEAD + "\n".join(rows) + "\n" + _TAIL


if __name__ == "__main__":
    print(render(), end="")
