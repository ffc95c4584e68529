"""The TTFT judgement: where a prompt goes among the engines that can serve it, ranked by
their projections (`predict.Predictor.project`: queued prefill, the prompt's uncached
tokens, the margin and the edge), kept at a conversation's engine and at the engine whose
cache holds it where the budget lets it wait, and paced by the TPOT ledger's answers; or
the spec's 429 refusals (the prompt alone over the budget, no engine within it). The
predictive policy (`policies/predictive.py`) asks it; the predictor only projects."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from narwhal.errors import ApiError
from narwhal.router import decisions as why
from narwhal.router.endings import End
from narwhal.router.engines import Engine
from narwhal.router.predict import Predictor, Profile, Projection

if TYPE_CHECKING:
    from narwhal.router.decisions import Decision

# All three are shares of the TTFT budget: a wait worth taking at a 10 s budget is not at a
# 1 s one. (First set in seconds at a 5 s budget, 0.05 s, 0.1 s (1,024 tokens at 10k
# tokens/s) and 1 s: the same at that budget.)
# A conversation whose engine would be left less than this of its TTFT budget moves on.
HOLD_HOME_MIN = 0.01
# A prompt waits for the engine that holds enough more of it in cache than the engine it
# would take instead that prefilling the difference there takes this share of the budget (a
# shared system prompt or a history, not a few words), while the engine it would take still
# leaves HOLD_CACHE_MARGIN of the budget after the wait. On the production trace at 1x
# (bench/README.md, "Fleet"): hit rate 42.8 % -> 44.2 %, goodput unchanged.
HOLD_CACHE_PREFILL = 0.02
HOLD_CACHE_MARGIN = 0.2


class NoEngineKeepsPace(Exception):
    """Every engine within the TTFT budget would break the time per output token of a
    stream decoding there. Streams end within seconds: the request may wait for one to,
    `slack_s` at most (what the budget leaves beyond the best projection), and is refused
    with `refusal` when none has."""

    def __init__(self, slack_s: float) -> None:
        super().__init__("no engine keeps pace")
        self.slack_s = slack_s
        self.refusal = ApiError(
            429,
            "every engine within the TTFT budget would break the time per output token of "
            "streams decoding there",
            type="rate_limit_error",
            code="tpot_target_exceeded",
            headers={"retry-after": "1"},
        ).ended(End.TPOT_TARGET_EXCEEDED)


def judge(
    predictor: Predictor,
    prompt_bytes: int,
    engines: list[Engine],
    budget_s: float,
    cached: dict[str, int] | None = None,
    home: Engine | None = None,
    keeps_pace: Callable[[Projection], bool] | None = None,
    stall: Callable[[Projection], float] | None = None,
    klass: int = 2,
    share: float = 1.0,
    record: Decision | None = None,
    pace_sure: bool = True,
    model: str = "",
    lender: Profile | None = None,
) -> Projection:
    """The best projection within budget, or the spec's 429 refusals. `cached` says
    per engine name how many of the prompt's tokens its cache is expected to serve;
    `home` is the engine a conversation was last placed on: kept while it fits, and
    waited for (while the budget allows) when only the TPOT target keeps it out, as is
    an engine that holds much more of the prompt in cache than the one taken instead;
    `keeps_pace` says whether placing there keeps the engine's streams within the TPOT
    target (engines that would not are avoided while another fits); `stall` is what
    placing there costs the streams decoding beside it, in stream-seconds: with it, the
    engines within budget are ranked by that cost plus their projection (a TTFT within
    budget meets the SLO however small; a stall may break others' TPOT). `klass` is the
    request's class (what waits in the router's queue in a lower class goes after it);
    `share` the part of its own budget it is judged against (`budget_s`): a prompt that
    fits its own budget but not the share is refused for load, not for its length.
    `record`, where given, is told what was weighed and chosen, and why. Without
    `pace_sure` (what holds the engines' streams is not measured yet) pace only ranks:
    no request waits or is refused for it. `model`: the served model the prompt is for
    (its own prefill projected at that model's rate on an engine that serves several);
    `lender`: what an engine that cannot vouch for the prompt's size is judged by
    (`Predictor.lender`; None: its own measurements only)."""
    cached = cached or {}
    ps = [
        predictor.project(prompt_bytes, e, cached.get(e.name, 0), klass, model, lender)
        for e in engines
    ]
    if record is not None:
        record.judged(budget_s, ps)
        if keeps_pace is not None:
            keeps_pace = _noted(keeps_pace, record)
    unknown = [p for p in ps if p.total_s is None]
    if unknown:
        return _chose(record, min(unknown, key=lambda p: p.engine.prefill), why.UNPROFILED)
    fit = _within_budget(ps, budget_s, share)
    at_home = next((p for p in fit if p.engine is home), None)
    if at_home is not None:
        if keeps_pace is None or not pace_sure or keeps_pace(at_home):
            return _chose(record, at_home, why.HOME)
        # Its engine holds the conversation's history: moving it prefills the whole
        # history again elsewhere (an engine's worth of capacity, and a longer stall
        # there). While the budget lets it, it waits for a stream at home to end.
        slack = budget_s - (at_home.guarded_s or 0.0)
        if slack > HOLD_HOME_MIN * budget_s:
            _waits(record, why.WAIT_HOME)
            raise NoEngineKeepsPace(slack)
    rank = _rank
    if stall is not None:
        cost = stall

        def rank(p: Projection) -> tuple[float, int]:
            return (cost(p) + (p.guarded_s or 0.0), p.engine.inflight)

    if keeps_pace is None:
        return _chose(record, min(fit, key=rank), why.LOWEST)
    # The best-ranked engine that keeps pace: asked in rank order, so that a fleet
    # where the best keeps pace (the common case) reads one engine's ledger, not all.
    ranked = sorted(fit, key=rank)
    i = next((i for i, p in enumerate(ranked) if keeps_pace(p)), None)
    if i is None:
        if not pace_sure:
            return _chose(record, ranked[0], why.PACE_UNSURE)
        _waits(record, why.WAIT_PACE)
        raise NoEngineKeepsPace(budget_s - min((p.guarded_s or 0.0) for p in fit))
    p = ranked[i]
    if i and pace_sure:
        # Better-ranked engines were kept out by the TPOT target alone. Where one holds
        # much more of the prompt in its cache, taking this one prefills that again (a
        # family's prefix spread to one more engine, its cache's room taken twice); a
        # stream there ends within seconds, so the prompt waits for one while this
        # engine would still be within budget after the wait.
        holder = min(ranked[:i], key=lambda q: q.tokens)
        wait = budget_s - (p.guarded_s or 0.0) - HOLD_CACHE_MARGIN * budget_s
        again_s = (p.own_s or 0.0) - (holder.own_s or 0.0)  # prefilling it here again
        if again_s >= HOLD_CACHE_PREFILL * budget_s and wait > HOLD_HOME_MIN * budget_s:
            _waits(record, why.WAIT_CACHE)
            raise NoEngineKeepsPace(wait)
    return _chose(record, p, why.PACED if i else why.LOWEST_PACED)


def _chose(record: Decision | None, p: Projection, reason: str) -> Projection:
    """`p`, told to the record where there is one."""
    if record is not None:
        record.chose(p, reason)
    return p


def _waits(record: Decision | None, reason: str) -> None:
    """No engine yet: the request waits (told to the record where there is one)."""
    if record is not None:
        record.chose(None, reason)


def _noted(
    keeps_pace: Callable[[Projection], bool], record: Decision
) -> Callable[[Projection], bool]:
    """`keeps_pace`, its answer for each engine it was asked about noted in the record."""

    def asked(p: Projection) -> bool:
        ok = keeps_pace(p)
        record.paced[p.engine.name] = ok
        return ok

    return asked


def _within_budget(ps: list[Projection], budget_s: float, share: float = 1.0) -> list[Projection]:
    """The projections within the TTFT budget, or the spec's 429 when there are none. An
    engine whose profile does not vouch for the prompt's size fits while what is ahead of
    the prompt there does: it is admitted to, and learns, rather than refusing on a guess."""
    unsure = [p for p in ps if not p.sure]
    fit = [p for p in ps if (p.guarded_s or 0.0) <= budget_s]
    if not fit and unsure:
        fit = [p for p in unsure if _ahead_s(p) <= budget_s]
    if not fit:
        # Refused: for the prompt's own length where, on every engine, what its prefill
        # alone is told to take is over the budget (`Profile.alone_s`: never less than the
        # projection that refused it), and no Retry-After would come true.
        alone = [_alone_s(p) for p in ps]
        if not unsure and min(alone) > budget_s / share:
            err = ApiError(
                429,
                f"the prompt alone is projected to take {min(alone):.2f}s to "
                f"prefill, over the {budget_s:.2f}s TTFT budget; shorten the prompt "
                "or raise the target (x-narwhal-ttft-target-ms)",
                type="rate_limit_error",
                code="prompt_exceeds_ttft_budget",
            ).ended(End.PROMPT_EXCEEDS_TTFT_BUDGET)
            err.fields["alone_ms"] = round(min(alone) * 1000, 1)
            raise err
        best = min(ps, key=_rank)
        assert best.guarded_s is not None
        overrun = max(1, round(best.guarded_s - budget_s))
        # Refused for the router's own queue where an engine would fit without it.
        queue = any(
            p.total_s is not None
            and (p.guarded_s or 0.0) * (1 - p.waiting_s / p.total_s) <= budget_s
            for p in ps
            if p.waiting_s
        )
        err = ApiError(
            429,
            f"projected time to first token {best.guarded_s:.2f}s exceeds "
            f"the {budget_s:.2f}s budget"
            + (" (counting the requests waiting in the router for a seat)" if queue else ""),
            type="rate_limit_error",
            code="ttft_budget_exceeded",
            headers={"retry-after": str(overrun)},
        ).ended(End.QUEUE_WAIT if queue else End.TTFT_BUDGET_EXCEEDED)
        # The access line says how near it came: the least projection's engine and the tokens
        # it would prefill there, widened and not, and its own prefill there (a refusal for
        # the margin reads guarded over, projected under).
        err.fields.update(_ms(best))
        raise err
    return fit


def _ms(p: Projection) -> dict[str, object]:
    return {
        "nearest_engine": p.engine.name,
        "tokens_sized": p.tokens,
        "guarded_ms": round((p.guarded_s or 0.0) * 1000, 1),
        "projected_ms": round((p.total_s or 0.0) * 1000, 1),
        "own_ms": round((p.own_s or 0.0) * 1000, 1),
    }


def _alone_s(p: Projection) -> float:
    return max(p.own_s or 0.0, p.alone() if p.alone is not None else 0.0)


def _ahead_s(p: Projection) -> float:
    """What a projection has ahead of the prompt's own prefill, widened as the projection."""
    if p.total_s is None or p.guarded_s is None or not p.total_s:
        return 0.0
    return (p.total_s - (p.own_s or 0.0)) * p.guarded_s / p.total_s


def _rank(p: Projection) -> tuple[float, int]:
    # Ties (idle engines, no cache anywhere) go to the engine with the least in flight, not
    # to the first one listed.
    return (p.guarded_s or 0.0, p.engine.inflight)
