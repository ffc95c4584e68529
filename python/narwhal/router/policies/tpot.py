"""What placing a prompt does to the streams decoding beside it (time per output token).

Engines that batch continuously with chunked prefill (vLLM, SGLang, LexiEngine) put each
step's prefill tokens beside every decoding stream's next token, so a step lasts about
`tau0 + prefill tokens in it / R`, where `tau0` is the step without prefill (weights and KV
reads) and `R` the prefill rate. With prefill arriving at `P` tokens a second, the time per
output token settles at

    tpot = tau0 / (1 - P / R)

(each step's prefill share is P x step / R). The router knows `R` (the predictor's learned
rate) and `P` (the uncached tokens it placed on the engine, as a rate decaying over
`WINDOW_S`); it learns `tau0` per engine from finished streams (observed TPOT x (1 - P/R)
at the time). Placing a prompt adds its own uncached tokens to `P`: the projection says
what that does to the engine's streams, the new one included.
"""

from __future__ import annotations

import math
import time

WINDOW_S = 10.0  # prefill placed this long ago hardly weighs on today's steps
ALPHA = 0.2
MAX_UTILISATION = 0.95  # beyond this the formula's blow-up is all the answer there is


class PrefillLoad:
    """Per engine: the uncached prompt tokens placed there, as a decaying rate."""

    __slots__ = ("_at", "_tokens", "tau0_s")

    def __init__(self) -> None:
        self._tokens = 0.0
        self._at = time.monotonic()
        self.tau0_s: float | None = None  # the step time without prefill, learned

    def rate(self, now: float) -> float:
        """Uncached tokens a second placed on the engine lately."""
        self._decay(now)
        return self._tokens / WINDOW_S

    def _decay(self, now: float) -> None:
        dt = now - self._at
        if dt > 0:
            self._tokens *= math.exp(-dt / WINDOW_S)
            self._at = now

    def placed(self, tokens: int, now: float) -> None:
        self._decay(now)
        self._tokens += tokens

    def learn(self, tpot_s: float, prefill_tps: float, now: float) -> None:
        """A stream finished with this mean time per output token."""
        rho = min(MAX_UTILISATION, self.rate(now) / prefill_tps)
        sample = tpot_s * (1 - rho)
        self.tau0_s = sample if self.tau0_s is None else (1 - ALPHA) * self.tau0_s + ALPHA * sample

    def projected(self, tokens: int, prefill_tps: float, now: float) -> float | None:
        """The engine's time per output token once `tokens` more are placed; None until
        it has been learned."""
        if self.tau0_s is None:
            return None
        rho = (self.rate(now) + tokens / WINDOW_S) / prefill_tps
        if rho >= MAX_UTILISATION:
            return math.inf
        return self.tau0_s / (1 - rho)
