"""LexiEngine's flags (llama-server's names where it has them), each also from its
`LEXI_ARG_*` environment variable; `config.from_args` checks what they say."""

from __future__ import annotations

import argparse
import os

from narwhal.engine.config import EngineConfigError, default

ENV_PREFIX = "LEXI_ARG_"
_TRUE, _FALSE = ("1", "true", "yes", "on", "enabled"), ("0", "false", "no", "off", "disabled")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`lexi-engine serve`'s flags, in the order `--help` lists them."""
    _model_arguments(p)
    _serving_arguments(p)
    _batching_arguments(p)
    _limits_arguments(p)
    _fencing_arguments(p)
    _registration_arguments(p)
    _telemetry_arguments(p)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, its names, its template and its sampling defaults."""
    p.add_argument("-m", "--model", required=True, help="path of the GGUF model file")
    p.add_argument(
        "-a",
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="public model name (repeatable; the first is the model's ID)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a LoRA adapter (GGUF) served as model NAME beside the base (repeatable); "
        "one adapter, or the base, a decode step, in turn",
    )
    p.add_argument(
        "--chat-template-file", metavar="PATH", help="Jinja chat template overriding the GGUF's"
    )
    p.add_argument(
        "--chat-template-kwargs", metavar="JSON", help="JSON object of default template variables"
    )
    p.add_argument("--reasoning-format", default="auto", help="auto | none")
    p.add_argument("--temp", type=float, help="default temperature (0-2)")
    p.add_argument("--top-p", type=float, help="default top-p (0-1)")
    p.add_argument("--top-k", type=int, help="default top-k (0-100000)")
    p.add_argument("--min-p", type=float, help="default min-p (0-1)")
    p.add_argument("-n", "--n-predict", type=int, help="default max new tokens (1-131072)")


def _serving_arguments(p: argparse.ArgumentParser) -> None:
    """Where and how it listens, and what it computes on."""
    p.add_argument(
        "--queue-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long a request waits for a free slot (default 0: 429 at once)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens")
    p.add_argument(
        "-ngl",
        "--n-gpu-layers",
        type=int,
        default=0,
        help="layers to offload (GPU builds; CPU builds ignore it)",
    )
    p.add_argument("-t", "--threads", type=int, help="CPU threads for decoding")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accepted Bearer key (repeatable; @PATH reads one key per line, "
        "which keeps keys out of `ps`: prefer it)",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="read accepted keys from a file, one a line (llama-server's flag; "
        "the same as --api-key @PATH)",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        help="accepted for llama-server's sake: /metrics is always on",
    )
    p.add_argument(
        "--no-webui",
        action="store_true",
        help="accepted for llama-server's sake: LexiEngine has no web UI",
    )


def _batching_arguments(p: argparse.ArgumentParser) -> None:
    """Slots, prefill chunks and weight repacking."""
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="slots decoded together in one batch; each gets ctx-size / N tokens",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        metavar="TOKENS",
        help="prompt tokens prefilled per decode step (a long prompt is split so "
        "streaming slots keep decoding)",
    )
    p.add_argument(
        "--repack",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="put weights in llama.cpp's repacked buffer types (default: on, "
        "except where the build has AMX kernels, which crash on some CPUs)",
    )


def _limits_arguments(p: argparse.ArgumentParser) -> None:
    """What it waits for, and for how long."""
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=default("shutdown_grace_s"),
        metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, how long in-flight requests may finish "
        "(default %(default)g; a second signal stops at once)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=default("header_timeout_s"),
        metavar="SECONDS",
        help="a request head, or a kept-alive connection's next one, must arrive "
        "within this (default %(default)g)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=default("body_timeout_s"),
        metavar="SECONDS",
        help="a request body must arrive whole within this: 408 (default %(default)g)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=default("max_connections"),
        metavar="N",
        help="client connections served at once (default %(default)d)",
    )


def _fencing_arguments(p: argparse.ArgumentParser) -> None:
    """The fencing token of the router that leads (several routers on etcd)."""
    p.add_argument(
        "--fence",
        action="store_true",
        help="serve only the leading router: refuse (409 fenced) a request whose "
        "x-narwhal-fence token is missing or lower than the highest accepted",
    )
    p.add_argument(
        "--fence-etcd",
        metavar="URL[,URL...]",
        help="with --fence, also take the current leader's token from this etcd (every "
        "member's URL, comma-separated: a deposed router is refused before the new one has "
        "sent anything)",
    )
    p.add_argument(
        "--fence-key",
        default=default("fence_key"),
        metavar="KEY",
        help="the routers' leader key in etcd (default %(default)s; the routers' ha.key)",
    )
    p.add_argument(
        "--fence-secret",
        metavar="SECRET|@PATH",
        help="with --fence: a token above the floor is taken only from a request that "
        "carries this secret (x-narwhal-fence-secret; the routers' ha.fence_secret_env), so a "
        "client that reaches the engine cannot fence the leader out. Needed unless "
        "--fence-etcd checks tokens against etcd. @PATH reads it from a file",
    )
    p.add_argument(
        "--fence-state",
        metavar="PATH",
        help="with --fence, keep the highest accepted token in this file (written before "
        "it is acted on), so a restarted engine does not take a deposed leader's token again",
    )


def _registration_arguments(p: argparse.ArgumentParser) -> None:
    """A key in etcd, held while the engine serves, for routers with engines_from.etcd."""
    p.add_argument(
        "--register-etcd",
        metavar="URL[,URL...]",
        help="hold this engine's key in this etcd while it serves (deleted at shutdown, "
        "before it drains; expired within --register-ttl if it dies)",
    )
    p.add_argument(
        "--register-key",
        metavar="PREFIX/NAME",
        help="with --register-etcd: the key (routers follow PREFIX; NAME is the engine's)",
    )
    p.add_argument(
        "--advertise",
        metavar="URL",
        help="with --register-etcd: the URL routers reach this engine at "
        "(default http://HOST:PORT)",
    )
    p.add_argument(
        "--register-ttl",
        type=int,
        default=default("register_ttl_s"),
        metavar="S",
        help="the key's lease in seconds (default %(default)d)",
    )


def _telemetry_arguments(p: argparse.ArgumentParser) -> None:
    """OpenTelemetry traces (the router's `telemetry:` section, for the engine)."""
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces to this collector's OTLP/HTTP base URL "
        "(http://collector:4318): a span per request (render, queue, prefill, decode, each "
        "tool call's check), joined to the router's trace by its traceparent (default: off)",
    )
    p.add_argument(
        "--otel-service-name",
        default=default("otel_service_name"),
        metavar="NAME",
        help="with --otlp-endpoint: the spans' service.name (default %(default)s)",
    )
    p.add_argument(
        "--otel-sample-ratio",
        type=float,
        default=default("otel_sample_ratio"),
        metavar="R",
        help="with --otlp-endpoint: the share of requests without a sampled traceparent "
        "that are traced, 0-1 (default %(default)g)",
    )


def env_name(action: argparse.Action) -> str | None:
    """`--ctx-size` -> `LEXI_ARG_CTX_SIZE` (llama-server's LLAMA_ARG_* convention)."""
    long = next((o for o in action.option_strings if o.startswith("--")), None)
    if long is None or long in ("--help", "--version"):
        return None
    return ENV_PREFIX + long[2:].upper().replace("-", "_")


def defaults_from_env(p: argparse.ArgumentParser) -> None:
    """Every flag may come from its environment variable; the command line wins. Values are
    checked as the flag's would be (`from_args`), errors naming the variable."""
    for action in p._actions:
        name = env_name(action)
        if name is None:
            continue
        if action.help and action.help is not argparse.SUPPRESS:
            action.help += f" [env {name}]"
        raw = os.environ.get(name)
        if raw is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            low = raw.strip().lower()
            if low not in _TRUE + _FALSE:
                raise EngineConfigError(name, f"must be one of {', '.join(_TRUE + _FALSE)}")
            action.default = low in _TRUE
        elif isinstance(action, argparse._AppendAction):
            action.default = [v.strip() for v in raw.split(",") if v.strip()]
        else:
            try:
                action.default = action.type(raw) if callable(action.type) else raw
            except ValueError:
                raise EngineConfigError(name, f"{raw[:40]!r} is not a valid value") from None
            action.required = False
