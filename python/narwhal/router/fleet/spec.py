"""An engine described at runtime (an admin request's body, an etcd key's value), checked
as the config file's `engines[]` entries are."""

from __future__ import annotations

import re
from typing import Any

import orjson

from narwhal.router.config import EngineSpec
from narwhal.router.config_schema import DIALECTS
from narwhal.router.engines import MODEL, MODELS_MAX
from narwhal.router.fleet.rules import Refused, Rules
from narwhal.router.urls import credentials

NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_URL = re.compile(r"https?://[^\s/?#]+(/[^\s?#]*)?")
FIELDS = frozenset({"name", "url", "dialect", "api_key_env", "models"})


class BadSpec(ValueError):
    """What is wrong with it, and which field (None: the whole of it)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def parse(raw: bytes, name: str | None = None, rules: Rules | None = None) -> EngineSpec:
    """`{"name", "url", "dialect", "api_key_env", "models"}` as JSON; `name` given apart (an etcd
    key's last segment) wins over one in the body, which must then agree."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadSpec("not JSON") from None
    return of(body, name, rules)


def of(body: Any, name: str | None = None, rules: Rules | None = None) -> EngineSpec:
    """The engine `body` describes; with `rules` (a runtime source's), only the key
    variables and destinations they allow."""
    if not isinstance(body, dict):
        raise BadSpec(
            'an engine is a JSON object: {"name", "url", "dialect", "api_key_env", "models"}'
        )
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadSpec(f"unknown field {unknown[0][:64]!r}", unknown[0][:64])
    given = body.get("name", name)
    if name is not None and given != name:
        raise BadSpec(f"the name {given!r} is not the key's {name!r}", "name")
    if not isinstance(given, str) or not NAME.fullmatch(given):
        raise BadSpec("'name' must be 1-128 letters, digits or `_.-`", "name")
    url = body.get("url")
    if not isinstance(url, str) or len(url) > 2048 or not _URL.fullmatch(url):
        raise BadSpec("'url' must be an http(s) URL: http://host:port", "url")
    dialect = body.get("dialect", "lexi")
    if dialect not in DIALECTS:
        raise BadSpec(f"'dialect' must be one of {', '.join(DIALECTS)}", "dialect")
    key_env = body.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not _ENV.fullmatch(key_env)):
        raise BadSpec("'api_key_env' must be an environment variable's name", "api_key_env")
    if key_env is not None and credentials(url) is not None:
        raise BadSpec("give the engine's key in 'api_key_env' or in the URL, not both", "url")
    models = body.get("models")
    discover = models == "auto"
    if discover:
        models = None
    if models is not None and (
        not isinstance(models, list)
        or not 0 < len(models) <= MODELS_MAX
        or len(set(models)) != len(models)
        or not all(isinstance(m, str) and MODEL.fullmatch(m) for m in models)
    ):
        raise BadSpec(
            f"'models' must be \"auto\" or a list of 1-{MODELS_MAX} distinct model names",
            "models",
        )
    if rules is not None:
        try:
            if key_env is not None:
                rules.key_env(key_env)
            rules.literal(url)
        except Refused as e:
            raise BadSpec(str(e), e.field) from None
    return EngineSpec(
        given, dialect, url, None, key_env, None if models is None else tuple(models), discover
    )


def dump(spec: EngineSpec) -> bytes:
    out: dict[str, object] = {"name": spec.name, "url": spec.url or "", "dialect": spec.dialect}
    if spec.api_key_env:
        out["api_key_env"] = spec.api_key_env
    if spec.models is not None:
        out["models"] = list(spec.models)
    elif spec.discover:
        out["models"] = "auto"
    return orjson.dumps(out)
