"""The admission and placement policy a config asks for, chosen once at start."""

from __future__ import annotations

from narwhal.router.config import RouterConfig
from narwhal.router.engines import Engine
from narwhal.router.policies import Policy
from narwhal.router.policies.open import OpenPolicy
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.predict import Predictor
from narwhal.router.tenants.reserve import CriticalReserve


def choose(
    config: RouterConfig,
    engines: list[Engine],
    predictor: Predictor | None,
    reserve: CriticalReserve | None = None,
    seed: int | None = None,
) -> Policy:
    """`seed`: what prompts' blocks are hashed with, where several routers must agree on
    it (`ha.mode: active`); else each process draws its own."""
    if predictor is None:
        return OpenPolicy()
    cache = (
        PrefixCache(engines, config.prefix_cache_tokens, config.prefix_block_bytes)
        if config.prefix_cache_tokens
        else None
    )
    if cache is not None and seed is not None:
        cache.seeded(seed)
    return PredictivePolicy(
        predictor, engines, cache, config.tpot_target_s, reserve, config.ttft_budget_s
    )
