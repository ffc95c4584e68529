"""Decision records: why a request went where it did, or was refused.

For every request placement judged: the engines it weighed (each one's projected TTFT, its
own prefill, what was ahead of it there, the prompt tokens its cache was expected to
serve, whether its streams kept pace), what it chose and why, or the refusal and why; then
what was measured (first token, cached tokens, tokens in and out). A bounded ring in
memory, newest last, read on the admin API (`GET /admin/requests/{id}`, `GET
/admin/requests?outcome=refused&limit=50`).

Cheap on the request path: a record holds the projections placement computed anyway (no
copies, no dicts) and becomes JSON only when it is read. The flow opens one per request
(`Decisions.open`), the judge and the policy fill it, the flow closes it with the outcome.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Projection(Protocol):
    """What a record reads of a projection (`predict.Projection`): declared here, so the
    record sits below the predictor that fills it."""

    @property
    def engine(self) -> _Named: ...
    @property
    def tokens(self) -> int: ...
    @property
    def own_s(self) -> float | None: ...
    @property
    def total_s(self) -> float | None: ...
    @property
    def guarded_s(self) -> float | None: ...
    @property
    def waiting_s(self) -> float: ...
    @property
    def sure(self) -> bool: ...


# What each way the judge can choose says of it (`Decision.why`).
UNPROFILED = "an engine with no profile yet (learned so): the fewest prompts in prefill"
HOME = "the conversation's engine (its history is cached there), within budget"
LOWEST = "the lowest projected TTFT within budget"
LOWEST_PACED = "the lowest projected TTFT within budget, with the decode stall it costs"
PACED = "the best engine whose streams keep their TPOT target (better ones would not)"
PACE_UNSURE = (
    "the lowest projected TTFT with the decode stall it costs: no engine keeps pace by the "
    "ledger, but the answers' lengths or the engines' steps it holds streams to are not "
    "measured yet (admitted, learned so)"
)
WAIT_HOME = "waiting for the conversation's engine to keep its streams' pace"
WAIT_CACHE = "waiting for an engine that holds more of the prompt to keep its streams' pace"
WAIT_PACE = "waiting for an engine to keep its streams' pace"
WAIT_CLASS = "waiting behind a request of a higher class (or a tenant within its share)"


def ms(s: float | None) -> float | None:
    """Seconds as milliseconds to a tenth, as records and spans show them."""
    return None if s is None else round(s * 1000, 1)


class Decision:
    """One request's decision record (see the module)."""

    __slots__ = (
        "_at",
        "budget_s",
        "candidates",
        "choice",
        "expected",
        "id",
        "measured",
        "outcome",
        "paced",
        "priority",
        "prompt_bytes",
        "reason",
        "refusal",
        "session",
        "tenant",
        "waited_s",
        "why",
    )

    def __init__(self, rid: str, tenant: str, priority: str, prompt_bytes: int) -> None:
        self.id = rid
        self._at = time.time()
        self.tenant = tenant
        self.priority = priority
        self.prompt_bytes = prompt_bytes
        self.budget_s = 0.0  # what the last judgement was against (after any wait)
        self.candidates: Sequence[Projection] = ()
        self.expected: dict[str, int] = {}  # engine -> prompt tokens its cache should serve
        self.session: str | None = None  # the conversation's routing key, where it has one
        self.paced: dict[str, bool] = {}  # engine -> its streams keep pace (where asked)
        self.why = ""
        self.choice: str | None = None
        self.waited_s = 0.0  # in the router, waiting for pace
        self.refusal: dict[str, Any] | None = None
        self.outcome = ""
        self.reason: str | None = None
        self.measured: dict[str, Any] = {}

    def judged(self, budget_s: float, candidates: Sequence[Projection]) -> None:
        """A judgement began against `budget_s` over these projections (a later one, after
        a wait, replaces it)."""
        self.budget_s = budget_s
        self.candidates = candidates
        self.paced = {}

    def chose(self, p: Projection | None, why: str) -> None:
        self.choice = p.engine.name if p is not None else None
        self.why = why

    def describe(self) -> dict[str, Any]:
        chosen = self.choice
        candidates = [
            {
                "engine": p.engine.name,
                "projected_ttft_ms": ms(p.total_s),
                "guarded_ttft_ms": ms(p.guarded_s),
                "own_prefill_ms": ms(p.own_s),
                "queued_ms": ms(p.waiting_s),
                "tokens_to_prefill": p.tokens,
                "cached_tokens_expected": self.expected.get(p.engine.name, 0),
                "profile_vouches": p.sure,
                "keeps_pace": self.paced.get(p.engine.name),
                "chosen": p.engine.name == chosen,
            }
            for p in self.candidates
        ]
        return {
            "request_id": self.id,
            "at": round(self._at, 3),
            "tenant": self.tenant or None,
            "session": self.session,
            "priority": self.priority,
            "prompt_bytes": self.prompt_bytes,
            "budget_ms": ms(self.budget_s),
            "waited_ms": ms(self.waited_s),
            "candidates": candidates,
            "choice": chosen,
            "why": self.why or None,
            "refusal": self.refusal,
            "outcome": self.outcome,
            "reason": self.reason,
            "measured": self.measured,
        }


class Decisions:
    """The last `capacity` decision records, by request ID (a repeated ID: the later one)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ring: OrderedDict[str, Decision] = OrderedDict()

    def keep(self, d: Decision) -> None:
        ring = self._ring
        ring.pop(d.id, None)
        ring[d.id] = d
        while len(ring) > self.capacity:
            ring.popitem(last=False)

    def get(self, rid: str) -> Decision | None:
        return self._ring.get(rid)

    def newest(self, outcome: str | None, limit: int) -> list[Decision]:
        out: list[Decision] = []
        for d in reversed(self._ring.values()):
            if outcome is None or d.outcome == outcome:
                out.append(d)
                if len(out) >= limit:
                    break
        return out

    def __len__(self) -> int:
        return len(self._ring)
