"""LexiEngine's launch options: parsed, range-checked and frozen before anything listens."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

REASONING_FORMATS = ("auto", "none")

# llama-server's defaults, used when a switch is omitted.
DEFAULT_SAMPLING = {"temp": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "n_predict": -1}

RANGES: dict[str, tuple[float, float]] = {
    "temp": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 100000),
    "min_p": (0.0, 1.0),
    "n_predict": (1, 131072),
}


class EngineConfigError(ValueError):
    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag


@dataclass(frozen=True)
class EngineConfig:
    model: str
    aliases: tuple[str, ...] = ()
    # LoRA adapters served as models of their own: (name, path of its GGUF).
    loras: tuple[tuple[str, str], ...] = ()
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: str = "auto"
    sampling: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    queue_wait: float = 0.0
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int = 4096
    n_gpu_layers: int = 0
    threads: int | None = None
    api_keys: tuple[str, ...] = ()
    parallel: int = 1
    prefill_chunk: int = 256
    repack: bool | None = None  # None: chosen from the build's CPU features (engine.kernels)
    shutdown_grace_s: float = 25.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 8192
    fence: bool = False  # refuse requests without the current router's fencing token
    fence_etcd: str | None = None  # read the leader key's token from this etcd as well
    fence_key: str = "/narwhal/main/leader"
    fence_state: str | None = None  # keep the floor in this file across restarts
    fence_secret: str | None = field(default=None, repr=False)  # who may raise the floor
    register_etcd: str | None = None  # hold a key in this etcd while serving
    register_key: str | None = None
    advertise: str | None = None  # the URL routers reach it at (default http://host:port)
    register_ttl_s: int = 10
    otlp_endpoint: str | None = None  # traces to this collector (narwhal.telemetry); None: off
    otel_service_name: str = "lexi-engine"
    otel_sample_ratio: float = 1.0

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> EngineConfig:
        d = orjson.loads(raw)
        d["aliases"] = tuple(d["aliases"])
        d["loras"] = tuple((n, p) for n, p in d["loras"])
        d["api_keys"] = tuple(d["api_keys"])
        return cls(**d)


def default(name: str) -> Any:
    """An EngineConfig field's default: the flags' defaults are written once, there."""
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def _fence_secret(value: str | None) -> str | None:
    if value is None:
        return None
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text().strip()
        except OSError as e:
            raise EngineConfigError(
                "--fence-secret", f"cannot read {value[1:]}: {e.strerror}"
            ) from None
    if not value:
        raise EngineConfigError("--fence-secret", "empty secret")
    return value


def _read_keys(values: list[str]) -> tuple[str, ...]:
    keys: list[str] = []
    for v in values:
        if v.startswith("@"):
            try:
                text = Path(v[1:]).read_text()
            except OSError as e:
                raise EngineConfigError("--api-key", f"cannot read {v[1:]}: {e.strerror}") from e
            keys.extend(line.strip() for line in text.splitlines() if line.strip())
        elif v:
            keys.append(v)
        else:
            raise EngineConfigError("--api-key", "empty key")
    return tuple(keys)


def from_args(ns: argparse.Namespace) -> EngineConfig:
    """The checked configuration, or an EngineConfigError naming the flag."""
    model = _model(ns)
    sampling = _sampling(ns)
    if ns.reasoning_format not in REASONING_FORMATS:
        raise EngineConfigError("--reasoning-format", "must be auto or none")
    kwargs = _template_kwargs(ns)
    template = _template(ns)
    _check_limits(ns)
    _check_fencing(ns)
    _check_registration(ns)
    _check_telemetry(ns)
    aliases = tuple(ns.alias)
    for a in aliases:
        if not a.strip():
            raise EngineConfigError("--alias", "empty name")
    loras = _loras(ns.lora, aliases)

    return EngineConfig(
        model=str(model.resolve()),
        aliases=aliases,
        loras=loras,
        chat_template=template,
        chat_template_kwargs=kwargs,
        reasoning_format=ns.reasoning_format,
        sampling=sampling,
        queue_wait=ns.queue_wait,
        host=ns.host,
        port=ns.port,
        ctx_size=ns.ctx_size,
        n_gpu_layers=ns.n_gpu_layers,
        threads=ns.threads,
        api_keys=_read_keys([*ns.api_key, *("@" + f for f in ns.api_key_file)]),
        parallel=ns.parallel,
        prefill_chunk=ns.prefill_chunk,
        repack=ns.repack,
        shutdown_grace_s=ns.shutdown_grace,
        header_timeout_s=ns.header_timeout,
        body_timeout_s=ns.body_timeout,
        max_connections=ns.max_connections,
        fence=ns.fence,
        fence_etcd=ns.fence_etcd,
        fence_key=ns.fence_key,
        fence_state=ns.fence_state,
        fence_secret=_fence_secret(ns.fence_secret),
        register_etcd=ns.register_etcd,
        register_key=ns.register_key,
        advertise=ns.advertise,
        register_ttl_s=ns.register_ttl,
        otlp_endpoint=ns.otlp_endpoint,
        otel_service_name=ns.otel_service_name,
        otel_sample_ratio=ns.otel_sample_ratio,
    )


def _model(ns: argparse.Namespace) -> Path:
    model = Path(ns.model)
    if not model.is_file() or not os.access(model, os.R_OK):
        raise EngineConfigError("--model", f"{model} is not a readable file")
    with model.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise EngineConfigError("--model", f"{model} is not a GGUF file")
    return model


def _sampling(ns: argparse.Namespace) -> dict[str, float]:
    sampling = dict(DEFAULT_SAMPLING)
    for name, (lo, hi) in RANGES.items():
        value = getattr(ns, name)
        if value is None:
            continue
        if not (lo <= value <= hi) or value != value:
            flag = "--" + name.replace("_", "-")
            raise EngineConfigError(flag, f"must be between {lo:g} and {hi:g} (got {value:g})")
        sampling[name] = value
    return sampling


def _template_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.chat_template_kwargs is None:
        return {}
    try:
        kwargs = orjson.loads(ns.chat_template_kwargs)
    except orjson.JSONDecodeError as e:
        raise EngineConfigError("--chat-template-kwargs", f"malformed JSON: {e}") from e
    if not isinstance(kwargs, dict):
        raise EngineConfigError("--chat-template-kwargs", "must be a JSON object")
    from narwhal.engine.template import RESERVED

    for k in kwargs:
        if k in RESERVED:
            raise EngineConfigError("--chat-template-kwargs", f"'{k}' is reserved")
    return kwargs


def _template(ns: argparse.Namespace) -> str | None:
    if ns.chat_template_file is None:
        return None
    try:
        raw = Path(ns.chat_template_file).read_bytes()
    except OSError as e:
        raise EngineConfigError("--chat-template-file", f"cannot read: {e.strerror}") from e
    # Imported here: the flags (and --help) must work before the engine extra's jinja2
    # is known to be there (engine/deps.py says how to get it).
    from narwhal.engine.template import TemplateError, validate_source

    try:
        return validate_source(raw, ns.chat_template_file)
    except TemplateError as e:
        raise EngineConfigError("--chat-template-file", str(e)) from e


def _check_limits(ns: argparse.Namespace) -> None:
    if ns.queue_wait < 0 or ns.queue_wait != ns.queue_wait:
        raise EngineConfigError("--queue-wait", "must be >= 0")
    if not (0 <= ns.port <= 65535):
        raise EngineConfigError("--port", "must be between 0 and 65535")
    if ns.ctx_size < 16:
        raise EngineConfigError("--ctx-size", "must be at least 16")
    if not (1 <= ns.parallel <= 256):
        raise EngineConfigError("--parallel", "must be between 1 and 256")
    if ns.ctx_size // ns.parallel < 16:
        raise EngineConfigError(
            "--ctx-size",
            f"gives each of the {ns.parallel} slots fewer than 16 "
            "tokens (the context is split evenly over --parallel)",
        )
    if not (1 <= ns.prefill_chunk <= 8192):
        raise EngineConfigError("--prefill-chunk", "must be between 1 and 8192")
    for flag, v in (("--header-timeout", ns.header_timeout), ("--body-timeout", ns.body_timeout)):
        if not (0 < v <= 3600):
            raise EngineConfigError(flag, "must be between 0 and 3600 seconds")
    if ns.max_connections < 1:
        raise EngineConfigError("--max-connections", "must be at least 1")
    if not (0 < ns.shutdown_grace <= 3600):
        raise EngineConfigError("--shutdown-grace", "must be between 0 and 3600 seconds")
    if ns.threads is not None and ns.threads < 1:
        raise EngineConfigError("--threads", "must be at least 1")


def _check_fencing(ns: argparse.Namespace) -> None:
    for flag, v in (
        ("--fence-etcd", ns.fence_etcd),
        ("--fence-state", ns.fence_state),
        ("--fence-secret", ns.fence_secret),
    ):
        if v is not None and not ns.fence:
            raise EngineConfigError(flag, "needs --fence")
    if ns.fence and ns.fence_etcd is None and ns.fence_secret is None:
        raise EngineConfigError(
            "--fence",
            "needs --fence-etcd (tokens checked against etcd) or --fence-secret (only a "
            "router that knows it may raise the floor): with neither, any client that "
            "reaches this engine could send a huge token and fence every real leader out",
        )
    if ns.fence_state is not None:
        _check_fence_state(ns.fence_state)
    if ns.fence_etcd is not None and not all(
        u.startswith(("http://", "https://")) for u in ns.fence_etcd.split(",")
    ):
        raise EngineConfigError(
            "--fence-etcd", "must be http(s):// URLs of etcd endpoints, comma-separated"
        )


def _check_registration(ns: argparse.Namespace) -> None:
    if ns.register_etcd is None:
        for flag, v in (("--register-key", ns.register_key), ("--advertise", ns.advertise)):
            if v is not None:
                raise EngineConfigError(flag, "needs --register-etcd")
        return
    if not all(u.startswith(("http://", "https://")) for u in ns.register_etcd.split(",")):
        raise EngineConfigError(
            "--register-etcd", "must be http(s):// URLs of etcd endpoints, comma-separated"
        )
    name = (ns.register_key or "").rstrip("/").rsplit("/", 1)[-1]
    if not ns.register_key or not ns.register_key.startswith("/") or not _NAME.fullmatch(name):
        raise EngineConfigError(
            "--register-key",
            "must be /PREFIX/NAME, NAME letters, digits or `_.-` (the engine's name)",
        )
    if ns.advertise is not None and not ns.advertise.startswith(("http://", "https://")):
        raise EngineConfigError("--advertise", "must be an http(s):// URL")
    if not 2 <= ns.register_ttl <= 300:
        raise EngineConfigError("--register-ttl", "must be between 2 and 300 seconds")


def _check_telemetry(ns: argparse.Namespace) -> None:
    if ns.otlp_endpoint is not None and not re.match(r"https?://[^/]", ns.otlp_endpoint):
        raise EngineConfigError("--otlp-endpoint", "must be an http(s):// URL")
    if not 0 <= ns.otel_sample_ratio <= 1:
        raise EngineConfigError("--otel-sample-ratio", "must be between 0 and 1")
    if not ns.otel_service_name.strip():
        raise EngineConfigError("--otel-service-name", "empty name")
    if ns.otlp_endpoint is not None:
        from narwhal import telemetry

        if not telemetry.installed():
            raise EngineConfigError(
                "--otlp-endpoint",
                "traces need the OpenTelemetry SDK, which is not installed: "
                "pip install 'narwhal-serve[telemetry]'",
            )


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def _check_fence_state(path: str) -> None:
    """The floor file must be readable as a token if it is there, and writable where it is
    to be: an engine that cannot keep its floor must not start as if it could."""
    from narwhal.engine.fence import parse

    p = Path(path)
    if p.exists():
        try:
            raw = p.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise EngineConfigError("--fence-state", f"cannot be read: {e}") from None
        if parse(raw) is None:
            raise EngineConfigError("--fence-state", f"holds no fencing token: {raw[:40]!r}")
    elif not p.parent.is_dir() or not os.access(p.parent, os.W_OK):
        raise EngineConfigError(
            "--fence-state", f"cannot be written: {p.parent} is not a writable folder"
        )


def _loras(given: list[str], aliases: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--lora NAME=PATH` flags: each a name no alias or other adapter has, and a file."""
    out: list[tuple[str, str]] = []
    for raw in given:
        name, eq, path = raw.partition("=")
        name = name.strip()
        if not eq or not name or not path:
            raise EngineConfigError("--lora", "give NAME=PATH (the adapter's model name, its GGUF)")
        if name in aliases or any(name == n for n, _ in out):
            raise EngineConfigError("--lora", f"the name {name[:64]!r} is taken")
        file = Path(path).expanduser()
        if not file.is_file():
            raise EngineConfigError("--lora", f"{name[:64]}: no such file")
        out.append((name, str(file.resolve())))
    return tuple(out)
