"""`admission: open`: every request is admitted and placed on the least-loaded engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from narwhal.router.decisions import Decision
from narwhal.router.engines import Engine
from narwhal.router.lease import Events, Lease
from narwhal.router.peering.wire import Evicted, Picture, Placed
from narwhal.router.policies import OPEN_PLAN, PeerHold, Plan, Unheard, least_loaded
from narwhal.router.request import Request

if TYPE_CHECKING:
    from narwhal._native import PromptBlocks


class OpenPolicy:
    def judge(
        self, req: Request, engines: list[Engine], budget_s: float, record: Decision | None = None
    ) -> Plan:
        return OPEN_PLAN

    async def room(self, timeout_s: float, order: int = 2) -> None:
        await asyncio.sleep(timeout_s)  # never asked for: it never defers a request

    def placed(self, lease: Lease, plan: Plan) -> None:
        pass

    def added(self, engine: Engine) -> None:
        pass

    def removed(self, engine: Engine) -> None:
        pass

    def watch(self, events: Events) -> None:
        pass

    def degraded(self, engines: list[Engine]) -> str | None:
        return None  # it predicts nothing

    def describe(self) -> dict[str, Any] | None:
        return None  # it holds nothing

    def overrun(self, lease: Lease, engine: Engine, now: float) -> float | None:
        return None  # it holds no budget

    def instead(self, room: list[Engine]) -> Engine:
        return least_loaded(room)

    # It places by seats alone: another router's work is in the seats (Admission).
    def footprint(self, lease: Lease) -> tuple[float | None, int | None]:
        return None, None

    def placed_elsewhere(self, p: Placed, e: Engine) -> PeerHold | None:
        return None

    def elsewhere_decoding(self, w: PeerHold) -> None:
        pass

    def elsewhere_ended(
        self, w: PeerHold, output_tokens: int, decode_s: float, finished: bool
    ) -> None:
        pass

    def evicted_elsewhere(self, d: Evicted) -> None:
        pass

    def share_headroom(self, unheard: Unheard) -> None:
        pass  # it keeps no TPOT ledger

    def tell_evictions(self, told: Callable[[str, PromptBlocks, int], None]) -> None:
        pass  # it keeps no picture of the engines' caches

    def picture(self) -> Picture | None:
        return None

    def take_picture(self, p: Picture) -> None:
        pass

    def warming(self, req: Request, engines: list[Engine]) -> Plan | None:
        return None  # it refuses nothing for its TTFT
