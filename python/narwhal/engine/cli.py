"""`lexi-engine`: the command line."""

from __future__ import annotations

import argparse
import sys

from narwhal import __version__, logs, service
from narwhal.engine.config import EngineConfigError, from_args
from narwhal.engine.flags import add_arguments, defaults_from_env

CONFIG_ENV = "LEXI_ENGINE_CONFIG_FILE"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lexi-engine",
        description="LexiEngine: one GGUF model over an OpenAI-compatible HTTP API.",
    )
    p.add_argument("--version", action="version", version=f"lexi-engine {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a GGUF model",
        description="llama-server's short flags and names work where they mean the same "
        "(-m, -c, -np, -t, -ngl, -a, -n, --api-key-file, --metrics); every flag can also "
        "come from the environment variable shown with it (LEXI_ARG_*, as llama-server's "
        "LLAMA_ARG_*); the command line wins.",
    )
    add_arguments(serve)
    logs.add_arguments(serve)
    defaults_from_env(serve)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()
    except EngineConfigError as e:
        print(f"lexi-engine: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    from narwhal.engine.deps import missing

    lacking = missing()
    if lacking is not None:
        print(f"lexi-engine: error: {lacking}", file=sys.stderr)
        return 2
    try:
        config = from_args(args)
        addr = service.resolve(config.host, config.port)
        service.check_free(addr)
    except EngineConfigError as e:
        print(f"lexi-engine: error: {e}", file=sys.stderr)
        return 2
    except service.StartError as e:
        print(f"lexi-engine: error: {e}", file=sys.stderr)
        return 2
    from granian.constants import Interfaces

    service.hand_off(CONFIG_ENV, config.to_json())
    logs.choose(args.log_format, args.log_level)
    limits = service.ServerLimits(
        config.shutdown_grace_s, config.header_timeout_s, config.max_connections
    )
    return service.serve(
        "lexi-engine",
        "narwhal.engine.app:create_app",
        addr,
        limits,
        interface=Interfaces.ASGI,
        notify_stop=True,  # a registered engine withdraws its key before it drains
    )


if __name__ == "__main__":
    sys.exit(main())
