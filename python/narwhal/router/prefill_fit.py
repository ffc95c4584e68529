"""A prefill's time fitted to the prefills measured: a fixed overhead, the fresh tokens at a
rate, and attention's part, which grows with the square of the context (the predictor's
profiles keep one an engine; the fleet's fit pools them, `fleet_fit.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The prefill fit's memory: about the last 1 / FIT_ALPHA prompts whose own prefill was measured.
FIT_ALPHA = 0.1
# The fit's slope is read only where the prompts it saw differ in size (their coefficient of
# variation at least this); else tokens / time through the mean, with no overhead.
FIT_MIN_SPREAD = 0.2
# The overhead is kept once this many prompts were measured and it stands out of their noise
# (FIT_SIGNIFICANCE standard errors: missing one only makes long prompts look slower); the
# curve once FIT_CURVE_SAMPLES were. With four noisy samples, three parameters fitted the
# noise and the rate swung 4x from one prompt to the next (bench: a 15k-token prompt
# projected at 15 s, then 3 s, then 1 s).
FIT_LINE_SAMPLES = 4
FIT_CURVE_SAMPLES = 6
FIT_SIGNIFICANCE = 2.0


@dataclass
class PrefillFit:
    """An exponentially weighted least-squares fit of a prefill's time over the prefills
    measured (`Lease.prefill_s`): `overhead + fresh / rate + quad x (prompt^2 - cached^2)`.
    The quadratic term is attention's: each token attends to the context before it, so a
    long prompt's tokens cost more than a short one's (the H200 calibration: 38k tokens/s
    at no context, 23k at 8k). Fitted in thousands of tokens (the moments stay well within
    a float's range)."""

    # Weighted means of x1 = fresh, x2 = prompt^2 - cached^2, t, and the products the
    # normal equations (and the residuals' variance) read.
    m: list[float] = field(default_factory=lambda: [0.0] * 9)
    count: int = 0
    alpha: float = FIT_ALPHA  # a later sample's weight: it remembers about 1 / alpha
    last: tuple[float, float, float] | None = None  # the fit as of its last sample

    def add(self, fresh: int, prompt: int, seconds: float) -> tuple[float, float, float]:
        """Take a sample; the fit: (rate in tokens/s, overhead in s, quad in s a token^2).
        The first samples are averaged evenly, the later ones weighted `alpha`."""
        self.count += 1
        a = max(self.alpha, 1.0 / self.count)
        x1 = fresh / 1000
        x2 = (prompt * prompt - (prompt - fresh) ** 2) / 1e6
        t = seconds
        for i, v in enumerate((x1, x2, t, x1 * x1, x1 * x2, x2 * x2, x1 * t, x2 * t, t * t)):
            self.m[i] += a * (v - self.m[i])
        self.last = self.fit()
        return self.last

    def tells_sizes(self) -> bool:
        """Whether its samples are enough, and of sizes spread enough, to tell a prompt's
        tokens from the fixed overhead (the router's probes alone are all one size)."""
        m1, m11 = self.m[0], self.m[3]
        return self.count >= FIT_CURVE_SAMPLES and m11 - m1 * m1 > (FIT_MIN_SPREAD * m1) ** 2

    def slopes(self) -> tuple[float, float] | None:
        """Both slopes (b: seconds a thousand fresh tokens, c: seconds a million of x2)
        where these samples tell x1 and x2 apart (prompts of several sizes), else None."""
        m1, m2, mt, m11, m12, m22, m1t, m2t, _ = self.m
        v11, v12, v22 = m11 - m1 * m1, m12 - m1 * m2, m22 - m2 * m2
        det = v11 * v22 - v12 * v12
        if (
            self.count < FIT_CURVE_SAMPLES
            or v11 <= (FIT_MIN_SPREAD * m1) ** 2
            or det <= 1e-6 * v11 * v22
        ):
            return None
        c1t, c2t = m1t - m1 * mt, m2t - m2 * mt
        return (c1t * v22 - c2t * v12) / det, (c2t * v11 - c1t * v12) / det

    def curve(self) -> float | None:
        """The curve's shape as these samples tell it (c / b: attention's seconds against
        the tokens'), as it falls, negative or not: an estimate for the fleet's median
        (`Predictor.shape`), where keeping only the cost-like ones would keep the noise
        that leans one way (64 simulated engines of a dozen noisy prompts each: a median
        of 1.8x the truth that way, 0.9x as they fall). None where they cannot tell it."""
        s = self.slopes()
        return s[1] / s[0] if s is not None and s[0] > 0 else None

    def along(self, shape: float) -> tuple[float, float]:
        """These samples fitted along a curve of the given shape (`curve`'s c / b): one
        slope on `fresh + shape x context^2`, the overhead kept where it passes the line's
        significance test, else the secant through the mean: (seconds a thousand tokens
        along it, overhead in s). One slope is told far better than two by a dozen noisy
        prompts (`Profile.alone_s`)."""
        m1, m2, mt, m11, m12, m22, m1t, m2t, mtt = self.m
        mz = m1 + shape * m2
        vz = (m11 - m1 * m1) + 2 * shape * (m12 - m1 * m2) + shape * shape * (m22 - m2 * m2)
        czt = (m1t - m1 * mt) + shape * (m2t - m2 * mt)
        if self.count >= FIT_LINE_SAMPLES and vz > (FIT_MIN_SPREAD * mz) ** 2:
            n = min(float(self.count), (2 - self.alpha) / self.alpha)
            slope = czt / vz
            kept = mt - slope * mz
            noise = max(0.0, (mtt - mt * mt) - slope * czt) * n / (n - 2)
            if slope > 0 and kept > FIT_SIGNIFICANCE * math.sqrt(noise * (1 + mz * mz / vz) / n):
                return slope, kept
        return mt / mz, 0.0

    def fit(self) -> tuple[float, float, float]:
        m1, m2, mt, m11, _, _, m1t, _, mtt = self.m
        v11 = m11 - m1 * m1
        c1t, vtt = m1t - m1 * mt, mtt - mt * mt
        # The samples the weights amount to: all of them at first, about 2 / FIT_ALPHA later.
        n = min(float(self.count), (2 - self.alpha) / self.alpha)
        if v11 > (FIT_MIN_SPREAD * m1) ** 2:
            s = self.slopes()
            if s is not None:
                # The curve where it is a cost's: never negative, never falling.
                b, c = s
                overhead = mt - b * m1 - c * m2
                # Not held to significance: attention makes every engine's curve convex,
                # and a line through a convex curve's samples projects long prompts short
                # (a 4x-load bench run: first tokens 2.5x past their projection).
                if b > 0 and c >= 0 and overhead >= 0:
                    return 1000 / b, overhead, c / 1e6
                if b > 0 and c >= 0:
                    # An overhead under nothing is noise's: the curve with none, fitted
                    # through the origin (least squares held to a cost's overhead). Read
                    # instead as the secant, a pool of 192 noisy prompts of 0.3-16k tokens
                    # with the true curve's slopes projected 20k tokens at 0.77x.
                    m12, m22, m2t = self.m[4], self.m[5], self.m[7]
                    det = m11 * m22 - m12 * m12
                    if det > 0:
                        b0 = (m1t * m22 - m2t * m12) / det
                        c0 = (m2t * m11 - m1t * m12) / det
                        if b0 > 0 and c0 >= 0:
                            return 1000 / b0, 0.0, c0 / 1e6
            if self.count >= FIT_LINE_SAMPLES:
                b = c1t / v11
                overhead = mt - b * m1
                noise = max(0.0, vtt - b * c1t) * n / (n - 2)
                se_overhead = math.sqrt(noise * (1 + m1 * m1 / v11) / n)
                if b > 0 and overhead > FIT_SIGNIFICANCE * se_overhead:
                    return 1000 / b, overhead, 0.0
        # A convex curve fitted by a line has a negative overhead; sizes that do not spread
        # say nothing of a slope, and a few noisy ones not enough: the secant through the
        # mean then (an overhead it misses makes long prompts look slower, not faster).
        return 1000 * m1 / mt, 0.0, 0.0
