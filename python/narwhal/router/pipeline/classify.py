"""Classify: where a checked request stands among the others, and the budget that gives it.

Its class is what `x-narwhal-priority` asks, never above its key's (400 for a class that is
none); a lower class, and a tenant over its fair share while the fleet is full, is judged
against a share of the TTFT budget (and of the streams' TPOT allowance), so sheddable work
is refused first as load rises and critical work keeps its reserve.
"""

from __future__ import annotations

from narwhal.router.config import RouterConfig
from narwhal.router.request import Request, Standing
from narwhal.router.tenants.fair_queue import RANK
from narwhal.router.tenants.registry import Tenants

CRITICAL, SHEDDABLE, STANDARD = RANK["critical"], RANK["sheddable"], RANK["standard"]


def classify(
    req: Request,
    tenant: str | None,
    asked: str | None,
    budget_s: float,
    config: RouterConfig,
    tenants: Tenants,
) -> tuple[Request, float]:
    """The request with its `Standing`, and the TTFT budget it is judged against; `tenant`:
    the one its key is for, `asked`: the class its header asks for. A tenant whose keys list
    the models they may use gets 403 `model_not_allowed` for another."""
    tenants.may_use(tenant, req.model)
    rank = tenants.rank(tenant, asked)
    fair = tenants.fair_share(tenant)
    share = class_share(rank, config, tenants.reserve.share()) * fair
    if share < 1.0:
        # A lower class (or a tenant over its share) is judged against less than the
        # budget: a target of its own may lower it, never raise it past the configured
        # one, or a sheddable request could ask its way out of being refused first.
        budget_s = min(budget_s, config.ttft_budget_s)
    standing = Standing(tenant or "", rank, share, 2 * rank + (fair < 1.0))
    return req.classified(standing), budget_s * share


def class_share(rank: int, config: RouterConfig, reserve: float) -> float:
    """The share of its TTFT budget a request of this class is admitted against:
    sheddable work is refused first as load rises; lower classes leave critical work
    `reserve` of it (tenants/reserve.py; 0 where no key may send critical work)."""
    if rank == SHEDDABLE:
        return min(config.sheddable_headroom, 1.0 - reserve)
    if rank == STANDARD:
        return 1.0 - reserve
    return 1.0
