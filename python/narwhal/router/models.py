"""The models this router serves: what a request's `model` names, and which engines serve it.

Every engine serves the models its spec lists (`engines[].models`; `auto`: what its own
`/v1/models` listed at the last probe, `Pool._discover`), or the router's `model`
where it lists none, so a config of one model works as it always has (that model is the
router's even while no engine is in the pool: its requests get the 503 they always got).
`aliases` map public names to served ones. A request that names no model gets the router's
`model`; one that names a model no engine in the pool serves, and no alias, is 404
`model_not_found`.

One owner: the catalog is rebuilt from the pool's engines and the config when either
changes (an engine joins or leaves, a reload), never per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from narwhal.errors import ApiError
from narwhal.router.config import RouterConfig
from narwhal.router.engines import Pool


def not_found(name: str) -> ApiError:
    return ApiError(
        404, f"The model '{name[:200]}' does not exist", param="model", code="model_not_found"
    )


class Catalog:
    def __init__(self, pool: Pool, config: Callable[[], RouterConfig]) -> None:
        self._pool = pool
        self._config = config  # the running config (a reload replaces it)
        self._key: tuple[object, ...] | None = None
        self._serving: dict[str, frozenset[str]] = {}  # served model -> engine names
        self._aliases: dict[str, str] = {}
        self._about: dict[str, dict[str, object]] = {}  # what an engine said of a model
        self._default = ""

    def _fresh(self) -> None:
        config = self._config()
        key = (self._pool.version, config.model, config.aliases)
        if key == self._key:
            return
        serving: dict[str, set[str]] = {}
        if not any(e.spec.models is not None or e.spec.discover for e in self._pool.engines):
            # One model, as configs without `engines[].models` say: it is the router's even
            # while no engine is in the pool (a request then waits for one, or is 503).
            serving[config.model] = set()
        about: dict[str, dict[str, object]] = {}
        for e in self._pool.engines:
            for m in e.serves(config.model):
                serving.setdefault(m, set()).add(e.name)
            for m, said in e.about.items():
                about.setdefault(m, said)
        self._about = about
        self._serving = {m: frozenset(names) for m, names in serving.items()}
        self._aliases = dict(config.aliases)
        self._default = config.model
        self._key = key

    def resolve(self, name: str | None) -> str:
        """The served model a request's `model` stands for (the router's `model` where it
        names none); 404 `model_not_found` where no engine serves it."""
        self._fresh()
        served = self._aliases.get(name, name) if name is not None else self._default
        if served not in self._serving:
            raise not_found(name if name is not None else served)
        return served

    def not_serving(self, model: str) -> frozenset[str]:
        """The engines in the pool that do not serve `model`."""
        self._fresh()
        serving = self._serving.get(model, frozenset())
        if len(serving) == len(self._pool.engines):
            return frozenset()
        return frozenset(e.name for e in self._pool.engines if e.name not in serving)

    def listed(self) -> list[dict[str, Any]]:
        """`/v1/models`: every model some engine serves, then every alias of one."""
        self._fresh()
        names = sorted(self._serving) + sorted(
            a for a, m in self._aliases.items() if m in self._serving and a not in self._serving
        )
        return [self._entry(n) for n in names]

    def entry(self, name: str) -> dict[str, Any]:
        """`/v1/models/{id}`: the model, or 404."""
        self._fresh()
        if name not in self._serving and self._aliases.get(name) not in self._serving:
            raise not_found(name)
        return self._entry(name)

    def _entry(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "narwhal"}
        out.update(self._about.get(name, {}))  # what an engine serving it said of it
        if name in self._aliases and name not in self._serving:
            out["root"] = self._aliases[name]  # what it stands for (vLLM's field for it)
        return out
