"""`narwhal`: the router's command line (`serve`, `up`, `register`)."""

from __future__ import annotations

import argparse
import os
import sys

from narwhal import __version__, logs, service
from narwhal.registrar import DEFAULT_TTL_S
from narwhal.router.config import (
    EngineSpec,
    Launch,
    RouterConfig,
    RouterConfigError,
    load,
)
from narwhal.router.config_schema import DIALECTS
from narwhal.router.urls import redact


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="narwhal", description="Narwhal: an LLM-serving front door.")
    p.add_argument("--version", action="version", version=f"narwhal {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the router from a YAML config")
    s.add_argument("--config", required=True, metavar="PATH", help="narwhal.yaml")
    logs.add_arguments(s)
    u = sub.add_parser("up", help="one machine: the router plus one managed LexiEngine")
    u.add_argument("--model", metavar="PATH", help="GGUF model (default: the SmolLM2 test model)")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--parallel", type=int, default=4, help="engine slots")
    u.add_argument(
        "--ctx-size",
        type=int,
        default=8192,
        help="engine context in tokens, split evenly over the slots",
    )
    logs.add_arguments(u)
    u.add_argument(
        "--n-gpu-layers",
        "-ngl",
        type=int,
        metavar="N",
        help="engine layers offloaded to the GPU (default: all of them on a CUDA, ROCm or "
        "Metal build of llama-cpp-python, none on a CPU build)",
    )
    u.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more lexi-engine serve argument, as is (repeatable: --engine-arg=--temp "
        "--engine-arg=0.7)",
    )
    u.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="engine decode threads (default: one fewer than the CPUs, so the "
        "router keeps one; see docs/DECISIONS.md)",
    )
    r = sub.add_parser(
        "register",
        help="beside an engine: hold its key in etcd while its /health answers "
        "(for routers with engines_from.etcd)",
    )
    r.add_argument("--etcd", required=True, action="append", metavar="URL", help="repeatable")
    r.add_argument("--key", required=True, help="PREFIX/NAME: the engine's name is the last part")
    r.add_argument("--url", required=True, help="the engine's URL, as routers reach it")
    r.add_argument("--dialect", default="vllm", choices=DIALECTS)
    r.add_argument("--ttl", type=int, default=DEFAULT_TTL_S, help="the lease's TTL in seconds")
    logs.add_arguments(r)
    return p


def register(args: argparse.Namespace) -> int:
    """`narwhal register`: the sidecar (narwhal/registrar.py), until SIGTERM or SIGINT."""
    import asyncio
    import signal

    from narwhal import registrar
    from narwhal.router.fleet import spec as specs

    name = args.key.rstrip("/").rsplit("/", 1)[-1]
    try:
        spec = specs.of({"name": name, "url": args.url, "dialect": args.dialect})
    except specs.BadSpec as e:
        print(f"narwhal: error: {e}", file=sys.stderr)
        return 2
    if args.ttl < 2:
        print("narwhal: error: --ttl: at least 2 seconds", file=sys.stderr)
        return 2
    logs.choose(args.log_format, args.log_level)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reg = registrar.Registrar(
            args.etcd,
            args.key,
            registrar.value(spec.url or "", spec.dialect, spec.name),
            registrar.http_health(args.url),
            args.ttl,
        )
        await registrar.sidecar(reg, stop)

    print(
        f"narwhal register: {args.key} -> {redact(args.url)} while its /health answers",
        file=sys.stderr,
    )
    asyncio.run(run())
    return 0


def up_threads(cpus: int) -> int:
    """`narwhal up`'s engine threads: every CPU but the one the router is pinned to.
    llama.cpp's threads spin at each step's barrier, so one sharing a CPU with the busy
    router stalls every step (bench/up_threads.py measures the two choices side by side)."""
    return max(1, cpus - 1)


def gpu_build() -> bool:
    """Whether the installed llama-cpp-python can offload layers (a CUDA, ROCm or Metal
    build): `narwhal up` then puts the whole model on the GPU unless -ngl says otherwise."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def _up_config(args: argparse.Namespace) -> RouterConfig:
    model = args.model
    if model is None:
        from narwhal.bundled_model import ModelNotInstalled, smollm2_path

        try:
            model = str(smollm2_path())
        except ModelNotInstalled as e:
            raise service.StartError(f"{e} (make serve does this), or pass --model PATH") from None
    threads = args.threads
    if threads is None:
        threads = up_threads(
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    elif threads < 1:
        raise RouterConfigError("--threads: must be at least 1")
    # The context is split over the slots: 8192 (SmolLM2's trained length) gives each of
    # the default 4 slots 2048 tokens instead of lexi-engine's default 4096 / 4.
    extra = ["--ctx-size", str(args.ctx_size), "--threads", str(threads)]
    ngl = args.n_gpu_layers
    if ngl is None and gpu_build():
        ngl = 999  # every layer: on a GPU build the one machine's GPU does the work
    if ngl is not None:
        extra += ["--n-gpu-layers", str(ngl)]
    launch = Launch(model=model, parallel=args.parallel, args=(*extra, *args.engine_arg))
    return RouterConfig(
        engines=(EngineSpec("local", "lexi", None, launch),),
        host=args.host,
        port=args.port,
        admission="open",
    )


def _unfit(config: RouterConfig) -> str | None:
    """Why this config cannot run on this machine (a module or a variable it needs is
    missing), or None."""
    if any(e.launch is not None for e in config.engines):
        from narwhal.engine.deps import missing

        lacking = missing()
        if lacking is not None:  # a managed engine could never start
            return f"error: {lacking}"
    for where, name in [
        ("auth.api_keys_env", config.api_keys_env),
        *((f"engines.{e.name}.api_key_env", e.api_key_env) for e in config.engines),
        *((f"auth.api_keys[{t.tenant}].key_env", t.key_env) for t in config.tenant_keys),
        ("ha.fence_secret_env", config.ha.fence_secret_env if config.ha else None),
        ("ha.peer_secret_env", config.ha.peer_secret_env if config.ha else None),
        ("ha.advertise_url_env", config.ha.advertise_url_env if config.ha else None),
    ]:
        if name and not os.environ.get(name):
            return f"config error: {where}: the environment variable {name} is not set"
    if config.admin_token_env and not os.environ.get(config.admin_token_env):
        return (
            f"config error: admin.token_env: the environment variable "
            f"{config.admin_token_env} is not set (it holds the admin API's token)"
        )
    from narwhal.router.tenants.registry import auth_problem

    auth = auth_problem(config)
    return f"config error: {auth}" if auth else None


def _engines(config: RouterConfig) -> str:
    """The engines the start-up line names."""
    named = [e.name + (f" ({redact(e.url)})" if e.url else " (managed)") for e in config.engines]
    if config.etcd_source is not None:
        named.append(f"those registered under {config.etcd_source.prefix} in etcd")
    if config.dns_source is not None:
        named.append(f"those at {config.dns_source.name}")
    return ", ".join(named) or "none yet (add them: POST /admin/engines)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "register":
        return register(args)
    try:
        config = load(args.config) if args.command == "serve" else _up_config(args)
    except RouterConfigError as e:
        print(f"narwhal: config error: {e}", file=sys.stderr)
        return 2
    except service.StartError as e:
        print(f"narwhal: error: {e}", file=sys.stderr)
        return 2
    refused = _unfit(config)
    if refused is not None:
        print(f"narwhal: {refused}", file=sys.stderr)
        return 2
    from granian.constants import Interfaces, Loops

    from narwhal.router import affinity
    from narwhal.router.app import CONFIG_ENV
    from narwhal.router.fleet.wiring import CONFIG_PATH_ENV

    try:
        addr = service.resolve(config.host, config.port)
        service.check_free(addr)
    except service.StartError as e:
        print(f"narwhal: error: {e}", file=sys.stderr)
        return 2
    try:
        cpus = affinity.pin(config.cpu_affinity)
    except RouterConfigError as e:
        print(f"narwhal: config error: {e}", file=sys.stderr)
        return 2
    service.hand_off(CONFIG_ENV, config.to_json())
    if args.command == "serve":  # what a reload (SIGHUP, POST /admin/reload) reads again
        os.environ[CONFIG_PATH_ENV] = os.path.abspath(args.config)
    logs.choose(args.log_format, args.log_level)
    print(
        f"narwhal {__version__}: model '{config.model}' on http://{config.host}:{config.port} "
        f"-> engines: {_engines(config)}; router on {affinity.describe(cpus)}",
        file=sys.stderr,
    )
    # uvloop: the upstream reads run through the loop's transports once per token; its C
    # transports take ~10% off the router's CPU per relayed token (bench/README.md).
    limits = service.ServerLimits(
        config.shutdown_grace_s, config.header_timeout_s, config.max_connections
    )
    return service.serve(
        "narwhal",
        "narwhal.router.app:create_app",
        addr,
        limits,
        interface=Interfaces.ASGI,
        loop=Loops.uvloop,
        notify_stop=True,
        notify_reload=True,
    )


if __name__ == "__main__":
    sys.exit(main())
