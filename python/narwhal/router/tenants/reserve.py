"""How much room lower classes leave critical work: `predictive.critical_reserve` of the
TTFT budget (and of critical streams' TPOT allowance, in the same seconds) at least, more
while critical requests are being refused.

A fixed reserve fits one critical load. When critical prompts are refused anyway (the
lower-class prefill queued ahead of them, or the allowance their own streams had left,
left no room), each such refusal raises the reserve by `STEP`, up to `CEILING`; it decays
back to the configured share while none is, e-folding in `TAU_BUDGETS` TTFT budgets (a
router whose budget is 1 s learns and forgets ten times faster than one at 10 s: its
requests come and go ten times as fast). Lower classes give way to
critical work while it needs the room, and take it back when it does not.
"""

from __future__ import annotations

import math
import time

STEP = 0.1
CEILING = 0.8
TAU_BUDGETS = 4.0
GONE = 0.001  # an extra share below this is none (and reading the share costs nothing again)


class CriticalReserve:
    def __init__(self, base: float, critical: bool = True, budget_s: float = 5.0) -> None:
        self.critical = critical  # a key may send critical work (else nothing is reserved)
        self.base = 0.0  # the configured share; 0: nothing is reserved, ever
        self.tau_s = TAU_BUDGETS * budget_s
        self.configure(base, budget_s)
        self._extra = 0.0
        self._at = 0.0

    def configure(self, base: float, budget_s: float) -> None:
        """The configured share and TTFT budget (at start, and on a reload)."""
        self.base = base if self.critical else 0.0
        self.tau_s = TAU_BUDGETS * budget_s

    def _decay(self, now: float) -> None:
        if self._extra and now > self._at:
            self._extra *= math.exp(-(now - self._at) / self.tau_s)
            if self._extra < GONE:
                self._extra = 0.0
        self._at = now

    def refused(self, now: float | None = None) -> None:
        """A critical request was refused for lack of room."""
        if self.base <= 0:
            return
        self._decay(time.monotonic() if now is None else now)
        self._extra = min(max(0.0, CEILING - self.base), self._extra + STEP)

    def share(self, now: float | None = None) -> float:
        """The share of the TTFT budget lower classes leave critical work now."""
        if not self._extra:
            return self.base
        self._decay(time.monotonic() if now is None else now)
        return self.base + self._extra
