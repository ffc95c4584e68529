"""The admission and placement policy a config asks for, chosen once at start."""

from __future__ import annotations

from narwhal.router.config import RouterConfig
from narwhal.router.engines import Engine
from narwhal.router.policies import Policy
from narwhal.router.policies.open import OpenPolicy
from narwhal.router.policies.predictive import PredictivePolicy
from narwhal.router.policies.prefix_cache import PrefixCache
from narwhal.router.predict import Predictor


def choose(config: RouterConfig, engines: list[Engine], predictor: Predictor | None) -> Policy:
    if predictor is None:
        return OpenPolicy()
    cache = (
        PrefixCache(engines, config.prefix_cache_tokens, config.prefix_block_bytes)
        if config.prefix_cache_tokens
        else None
    )
    # Where a key may send critical work, lower classes leave critical streams the room a
    # critical prompt of the reserve's share of the budget would take (as they leave it
    # in the TTFT budget).
    critical = any(k.priority == "critical" for k in config.tenant_keys)
    reserve_s = config.critical_reserve * config.ttft_budget_s if critical else 0.0
    return PredictivePolicy(predictor, engines, cache, config.tpot_target_s, reserve_s=reserve_s)
