"""Predictive TTFT admission: per-engine profiles learned from live traffic, and the
projection that admits, places or refuses a request against its TTFT budget.

A profile learns three numbers per engine from requests it served: bytes per prompt token
(request bytes vs the engine's own prompt count), prefill rate (prompt tokens over the time
to the first output token, from requests that had the engine's prefill to themselves) and
time per output token. Until an engine has a prefill measurement, its projection is unknown
and requests are admitted (cold start); until its measurements vouch for a prompt's size
(`Profile.vouches`), the projection places the request but refuses it for nothing its own
prefill would take.

A prefill's time is a fixed overhead (scheduling, the first step's weights, the HTTP round
trip), plus the fresh tokens at the engine's rate, plus attention's part, which grows with
the square of the context (`PrefillFit`), all fitted to the requests that had the engine to
themselves. A rate read as tokens / TTFT from short prompts
is the overhead's, not the model's: extrapolated to a long prompt it projected several
times the real prefill and refused prompts a fleet served in a fraction of the budget.

Every engine's samples also go into the fleet's fit (`Predictor.pool`), and an engine
measured against it is projected as the pool at its own speed (`Predictor._pooled`): one
engine's dozen noisy prompts say how fast it is, not what shape its curve has.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from narwhal.router.engines import Engine
from narwhal.router.lease import Events, Lease
from narwhal.router.speeds import Speeds

ALPHA = 0.3  # EWMA weight of a new measurement
# A small gain: outcomes arrive a TTFT after the projection, and a large gain on a lagged
# signal oscillates (the simulation in bench/admission_sim.py shows it).
CORRECTION_GAIN = 0.05
# Admission keeps a margin of this many typical misses (`spread`, below): the one-sided
# 99th percentile of misses when they are roughly normal (a normal miss's mean size is
# sqrt(2 / pi) of its deviation). Two typical misses, as it was, are the 94th: under load
# the requests placed are those at the budget's edge (woken after a wait for pace, with
# what it left), and one in fifteen of them came late (a 4x bench run: 9 of 140, each
# 1.1-1.4x its projection).
MARGIN_SPREAD = statistics.NormalDist().inv_cdf(0.99) / math.sqrt(2 / math.pi)
# Beyond doubling, the projection is too unreliable to gate on; drift past its bound makes
# the router monitoring-degraded instead.
MAX_MARGIN = 2.0
# The margin's typical miss (`spread`): the mean |ln(observed / projected)| weighted by the
# projection's length, over about the last 1 / SPREAD_ALPHA misses. Weighted, because a
# margin only decides for projections near the budget, and short ones miss wider (a fixed
# overhead's noise is a larger share of them): on 64 engines at 0.5x (a 20 s budget),
# projections under 5 s missed by 0.15-0.16 typically, those over it by 0.08-0.12, and the
# margin read from all of them refused prompts of 0.7-0.95 of the budget alone on idle
# engines. Ten, not the drift's three (`ALPHA`, for noticing the predictor go wrong): read
# from about three, the margin swung from 1.3x to 2x between one request and the next.
SPREAD_ALPHA = 0.1
# Models one engine keeps a profile of its own for (adapters come and go: a bound).
MODEL_PROFILES = 64
# The edge: every projection is widened by a factor learned from outcomes, so that of the
# requests placed within their budget about EDGE_TARGET start late. A late first token
# widens it by about EDGE_GAIN, an on-time one narrows it by EDGE_TARGET of that (a
# stochastic-approximation quantile: it settles where lateness is EDGE_TARGET). The drift
# margin follows typical misses; this one follows the misses that count, those at the edge
# of the budget, where a fleet under load places what it admits. Half the 1 % of late work
# the SLO tolerates; at most MAX_EDGE.
EDGE_TARGET = 0.005
EDGE_GAIN = 0.05
MAX_EDGE = 1.5


# The prefill fit's memory: about the last 1 / FIT_ALPHA prompts whose own prefill was measured.
FIT_ALPHA = 0.1
# The fleet's fit (`Predictor.pool`) remembers about the last 1 / POOL_ALPHA samples of every
# engine's; an engine's speed against it, about its own last 1 / SPEED_ALPHA.
POOL_ALPHA = 0.01
# The samples the fleet's fit is refitted from at the engines' current speeds: what its
# weights amount to.
POOL_SAMPLES = round(2 / POOL_ALPHA)
# Refitted at most once every this many samples (and once a round): a refit reads all
# POOL_SAMPLES, and on a fleet of two a round is two samples; the speeds it corrects for
# move by a twentieth of a sample each sample (SPEED_ALPHA).
REFIT_EVERY = POOL_SAMPLES // 10
SPEED_ALPHA = 0.05
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
# How far one sample of a prompt that waited behind another may pull the fit from what it
# projected toward slower (Profile.observe); one that measured less than its projection
# over this much measured a shared step, not the prompt, and is not taken.
QUEUED_CLIP = 2.0
# A profile vouches for prompts up to this many times the largest it measured, once it
# has this many such measurements: refusing a prompt for its own length needs both.
VOUCH_SAMPLES = 3
VOUCH_EXTRAPOLATION = 4.0


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


def _weighed(
    old: float | None, old_weight: float, new: float, weight: float
) -> tuple[float, float]:
    """An EWMA (SPREAD_ALPHA) of values each of its own weight: (the mean, its weight)."""
    if old is None or old_weight <= 0:
        return new, weight
    keep = (1 - SPREAD_ALPHA) * old_weight
    total = keep + SPREAD_ALPHA * weight
    return (keep * old + SPREAD_ALPHA * weight * new) / total, total


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
        self.take(fresh, prompt, seconds)
        self.last = self.fit()
        return self.last

    def take(self, fresh: int, prompt: int, seconds: float) -> None:
        """A sample into the moments, the fit left as it was (`add` fits)."""
        self.count += 1
        a = max(self.alpha, 1.0 / self.count)
        x1 = fresh / 1000
        x2 = (prompt * prompt - (prompt - fresh) ** 2) / 1e6
        t = seconds
        for i, v in enumerate((x1, x2, t, x1 * x1, x1 * x2, x2 * x2, x1 * t, x2 * t, t * t)):
            self.m[i] += a * (v - self.m[i])

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


@dataclass
class Profile:
    bytes_per_token: float | None = None
    prefill_tps: float | None = None
    overhead_s: float = 0.0  # a prefill's fixed part, beside its tokens / prefill_tps
    quad_s: float = 0.0  # attention's part: seconds a (prompt^2 - cached^2) token^2
    largest_measured: int = 0  # fresh tokens of the largest prompt whose prefill was measured
    sized_live: bool = False  # bytes_per_token learned from clients' prompts, not probes
    tpot_s: float | None = None
    output_tokens: float | None = None  # output-length learning: typical answer length
    prefill_samples: int = 0
    discarded: int = 0
    drift: float | None = None  # EWMA of |ln(observed TTFT / predicted TTFT)|
    drift_samples: int = 0
    spread: float | None = None  # the same misses weighted by the projection (SPREAD_ALPHA)
    spread_weight: float = 0.0
    sizing_error: float | None = None  # EWMA of |estimated - reported| / reported tokens
    # Decode correction: observed/projected TTFT under real load (decoding beside prefill
    # slows it), applied to every projection. Learned from every request with a projection,
    # not only from those that had the engine to themselves.
    correction: float = 1.0
    # Monotonic time of the last good measurement; None: never. (Not 0.0: the monotonic
    # clock counts from the machine's boot, so on a machine up for less than the probe
    # interval "never" read as recent, and the profiler left a new engine unmeasured.)
    measured_at: float | None = None
    fit: PrefillFit = field(default_factory=PrefillFit, repr=False)
    curve: float | None = None  # its samples' curve (`PrefillFit.curve`), once they tell one
    # The fleet's fit its samples go into as well (`Predictor.pool`; None: it fits its own
    # alone), and how much longer a prefill takes here than the pool's (`Predictor._pooled`
    # writes it and, once the pool tells sizes apart, rate, overhead and curve as the
    # pool's at that speed: `pooled`).
    pool: PrefillFit | None = field(default=None, repr=False, compare=False)
    speed: float = 1.0
    pooled: bool = False
    # Its last sample as measured (fresh, prompt, seconds), until the fleet's fit keeps it
    # with its engine (`Predictor._pooled`).
    taken: tuple[int, int, float] | None = None
    # Its samples against the pool, ln(measured / the pool's): decayed weight, sum, squares.
    paces: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0], repr=False)

    def age_s(self, now: float) -> float:
        """Seconds since its last good measurement (infinite: never measured)."""
        return math.inf if self.measured_at is None else now - self.measured_at

    def ahead_s(self, tokens: int, squares: int) -> float:
        """The prefill of prompts of `tokens` in all, their squares summing to `squares`, one
        after another (no overhead: they share steps), as learned and corrected."""
        assert self.prefill_tps is not None
        return (tokens / self.prefill_tps + self.quad_s * squares) * self.correction

    @property
    def vouched_up_to(self) -> float:
        """The largest prompt (fresh tokens) its measurements say enough of to refuse it for
        its own prefill: several, and of prompts not much smaller (0: none yet)."""
        if self.prefill_samples < VOUCH_SAMPLES:
            return 0.0
        return VOUCH_EXTRAPOLATION * self.largest_measured

    def vouches(self, fresh: int) -> bool:
        return 0 < fresh <= self.vouched_up_to

    def prefill_s(self, fresh: int, prompt: int | None = None, shape: float | None = None) -> float:
        """The prefill of `fresh` tokens of a `prompt` (the rest cached; None: all fresh),
        alone on the engine, as learned and corrected (prefill_tps must be known).
        `shape`: the fleet's curve (`Predictor.shape`), which a prompt larger than any this
        engine measured is projected along, from what its own fit says of the largest it
        measured, where that says more than its own fit does: on 64 engines measuring a
        dozen prompts each, mostly short, a line through one engine's short prompts
        projected prompts of 15-24k tokens at two thirds of their time. Within what it
        measured, its own fit alone (where the fleet's curve replaced every engine's own
        on 8 engines that each measured every size, more streams missed their TPOT:
        bench/README.md)."""
        assert self.prefill_tps is not None
        prompt = fresh if prompt is None else prompt
        work = fresh / self.prefill_tps + self.quad_s * (prompt * prompt - (prompt - fresh) ** 2)
        top = self.largest_measured
        if not self.pooled and shape is not None and shape > 0 and 0 < top < fresh:
            at_top = top / self.prefill_tps + self.quad_s * top * top
            along = (fresh + shape * (prompt * prompt - (prompt - fresh) ** 2) / 1000) / (
                top + shape * top * top / 1000
            )
            work = max(work, at_top * along)
        return self.overhead_s + work * self.correction

    def alone_s(self, fresh: int, prompt: int, shape: float | None, speed: float = 1.0) -> float:
        """What the prompt's prefill alone is told to take where it is refused for it: its
        projection (`prefill_s`), or where the fleet's curve is known, its samples' fit
        along that curve if that says more. Each engine's own fit of a dozen noisy prompts
        ranges from half the truth to more for a long prompt (64 simulated engines: the
        least of them 0.5-0.8x the truth, their median 0.97x), and the least of 64 judged
        whether a prompt was too long alone: prompts of 5.5-9 s alone at a 5 s budget were
        refused for load, with a Retry-After that never comes true. Along the fleet's curve
        one slope is fitted, not two: the least of 64 then 0.9x or more. `speed`: how much
        longer the engine it is told for takes (`speed_against`, where this is a lender)."""
        own = self.prefill_s(fresh, prompt, shape)
        if self.pooled or shape is None or not self.fit.count or self.prefill_tps is None:
            return own * speed
        b, overhead = self.fit.along(shape)
        work = b * (fresh + shape * (prompt * prompt - (prompt - fresh) ** 2) / 1000) / 1000
        return max(own, overhead + work * self.correction) * speed

    def observe(
        self,
        prompt_bytes: int,
        prompt_tokens: int | None,
        ttft_s: float | None,
        prefill_s: float | None,
        decode_tokens: int,
        decode_s: float,
        predicted_s: float | None = None,
        cached_tokens: int = 0,
        expected_cached: int = 0,
        probe: bool = False,
        queued: bool = False,
    ) -> float | None:
        """Learn from one answered request; the projection's miss, ln(measured /
        projected TTFT), where it was scored."""
        miss: float | None = None
        # A prompt the engine partly served from its prefix cache prefilled only the rest:
        # its rate counts those tokens. The projection counted the cache it expected; where
        # the engine's cache held much more or much less than that, the miss is the
        # picture's, not the rate's, and is not scored.
        fresh = prompt_tokens - min(cached_tokens, prompt_tokens) if prompt_tokens else None
        cache_hit = bool(
            prompt_tokens and abs(cached_tokens - expected_cached) > 0.1 * prompt_tokens
        )
        if ttft_s and ttft_s > 0:
            self.measured_at = time.monotonic()
            # Sub-50 ms requests are all fixed overhead: they say nothing about the model.
            if (
                predicted_s
                and predicted_s > 0
                and max(ttft_s, predicted_s) >= 0.05
                and not cache_hit
            ):
                miss = math.log(ttft_s / predicted_s)
                self.drift = _ewma(self.drift, abs(miss))
                self.spread, self.spread_weight = _weighed(
                    self.spread, self.spread_weight, abs(miss), predicted_s
                )
                self.drift_samples += 1
                step = math.exp(CORRECTION_GAIN * miss)
                self.correction = min(4.0, max(0.25, self.correction * step))
        # The router's own probe is one kind of text (its bytes a token are prose's): it sizes
        # prompts only until live ones, the text that is sized, have been measured.
        if prompt_tokens and (not probe or self.bytes_per_token is None):
            if self.bytes_per_token is not None:
                estimate = prompt_bytes / self.bytes_per_token
                self.sizing_error = _ewma(
                    self.sizing_error, abs(estimate - prompt_tokens) / prompt_tokens
                )
            ratio = prompt_bytes / prompt_tokens
            fresh_start = not probe and not self.sized_live  # the probe's guess replaced
            self.bytes_per_token = ratio if fresh_start else _ewma(self.bytes_per_token, ratio)
            self.sized_live = self.sized_live or not probe
        seconds = self._sample_s(prefill_s, fresh or 0, prompt_tokens or 0, queued)
        if prompt_tokens and fresh and seconds is not None:
            self._sample(fresh, prompt_tokens, seconds)
        if decode_tokens > 1 and decode_s > 0:
            self.tpot_s = _ewma(self.tpot_s, decode_s / (decode_tokens - 1))
        if decode_tokens:
            self.output_tokens = _ewma(self.output_tokens, decode_tokens)
        return miss

    def cut(self, fresh: int, prompt: int, ran_s: float, queued: bool) -> bool:
        """A prefill cut before its first token (its client left, its deadline passed) after
        it ran `ran_s`: it takes longer. Where the fit projects less than that, it is shown
        the time it ran (at most QUEUED_CLIP times its projection): a profile measures only
        the prompts admitted, and learns what long ones take from those it admitted wrongly
        (at a 1 s budget, prompts of 12-24k tokens were admitted on projections under the
        budget and given up on by their clients at twice it, one after another, the fit's
        curve never shown one). Whether it taught the fit."""
        if self.prefill_tps is None or fresh <= 0 or ran_s <= 0:
            return False
        expected = self._fitted_s(fresh, prompt)
        ran = ran_s + self.overhead_s if queued else ran_s
        if ran <= expected:
            return False  # no news: it was cut before the fit said it would end
        self._sample(fresh, prompt, min(ran, expected * QUEUED_CLIP))
        return True

    def _fitted_s(self, fresh: int, prompt: int) -> float:
        """The fit's prefill of `fresh` tokens of a `prompt`, uncorrected (what a sample is
        held against; prefill_tps must be known)."""
        assert self.prefill_tps is not None
        quad = prompt * prompt - (prompt - fresh) ** 2
        return self.overhead_s + fresh / self.prefill_tps + self.quad_s * quad

    def _sample(self, fresh: int, prompt: int, seconds: float) -> None:
        """One prefill sample taken into the fit, and into the pool's (divided by this
        engine's speed): where the pool's projection of it is mostly the prompt's tokens,
        not the overhead, it also says how fast this engine is against the pool (`paces`)."""
        own = self.fit.add(fresh, prompt, seconds)
        if not self.pooled:
            self.prefill_tps, self.overhead_s, self.quad_s = own
        self.curve = self.fit.curve()
        self.prefill_samples += 1
        self.largest_measured = max(self.largest_measured, fresh)
        pool = self.pool
        if pool is None:
            return
        if pool.last is not None and pool.tells_sizes():
            tps, overhead, quad = pool.last
            work = fresh / tps + quad * (prompt * prompt - (prompt - fresh) ** 2)
            if work >= overhead and seconds > 0:
                r = math.log(seconds / (overhead + work))
                w, total, squares = self.paces
                keep = 1 - SPEED_ALPHA
                self.paces = [keep * w + 1, keep * total + r, keep * squares + r * r]
        pool.add(fresh, prompt, seconds / self.speed)
        self.taken = (fresh, prompt, seconds)

    def _sample_s(
        self, prefill_s: float | None, fresh: int, prompt: int, queued: bool
    ) -> float | None:
        """What a measured prefill teaches the fit, in seconds (None: nothing). A prompt
        that waited behind another began when that one's first token came: the fixed
        overhead (the request's way in, its first step) ran while it waited, and the fit,
        whose samples carry it, is given it back. Where two prompts shared a step, the later
        one's sample is short by what the earlier one's was long: one prompt whose whole
        prefill ran in the step that ended another's measured nothing, and alone it swung a
        fit twenty times fast (the bench: the burst placed there came 12x late). So a
        sample that waited is taken only once a fit exists to bound it, moves it toward
        slower by at most QUEUED_CLIP, and where it measured less than the fit's projection
        over QUEUED_CLIP it is not taken: such a sample measured the step it shared. Taken
        as that bound, each one still halved the time a profile of the router's probes
        (169 tokens in 0.1 s) projected, and as the largest prompt measured it vouched for
        prompts four times its size: on 64 engines (the fleet bench at 0.5x, 2026-12-07)
        47 of 1,342 samples measured under 50 ms after a wait, and an engine one of them
        made look fast won the next burst of seven prompts and served it at twice its
        projection, three of them late."""
        if prefill_s is None or prefill_s < 0:
            return None
        if not queued:
            return prefill_s
        if self.prefill_tps is None:
            return None
        expected = self._fitted_s(fresh, prompt)
        seconds = prefill_s + self.overhead_s
        if seconds < expected / QUEUED_CLIP:
            return None
        return min(seconds, expected * QUEUED_CLIP)

    def rebase(self) -> None:
        """A fresh profiling measurement: judge drift (and correct) anew from here on."""
        self.drift = None
        self.drift_samples = 0
        self.spread, self.spread_weight = None, 0.0
        self.correction = 1.0

    def describe(self) -> dict[str, float | int | None]:
        return {
            "bytes_per_token": self.bytes_per_token,
            "prefill_tokens_per_s": self.prefill_tps,
            "prefill_overhead_s": self.overhead_s,
            "prefill_quadratic_s": self.quad_s,
            "time_per_output_token_s": self.tpot_s,
            "output_tokens": self.output_tokens,
            "prefill_samples": self.prefill_samples,
            # Prompts (fresh tokens) up to this size may be refused for their own prefill.
            "vouched_up_to_tokens": self.vouched_up_to,
            "drift": self.drift,
            "spread": self.spread,
            "sized_live": self.sized_live,
            "sizing_error": self.sizing_error,
            "correction": self.correction,
            # How much longer its prefill takes than the fleet's fit, and whether its rate,
            # overhead and curve are that fit's at this speed.
            "speed_against_fleet": self.speed,
            "fleet_fit": self.pooled,
            "discarded_measurements": self.discarded,
        }


@dataclass
class Projection:
    engine: Engine
    tokens: int  # the prompt tokens it is expected to prefill (what its cache lacks)
    own_s: float | None  # None: no profile yet
    total_s: float | None  # the projection itself (what outcomes are scored against)
    # The projection widened by the engine's typical miss (drift): a request projected just
    # under the budget is exactly the one a slightly slow prefill pushes over it.
    guarded_s: float | None = None
    waiting_s: float = 0.0  # of total_s, the prefill still waiting in the router's queue
    # The engine's profile vouches for this prompt's size (`Profile.vouches`): the projection
    # may refuse it. Else it only places it.
    sure: bool = True
    # What its prefill alone is told to take, asked only where it is refused (`Profile.alone_s`:
    # admission's decision reads own_s and guarded_s, never this).
    alone: Callable[[], float] | None = None


class Predictor:
    def __init__(
        self,
        engines: list[Engine],
        drift_bound: float = 1.1,
        drift_min_samples: int = 5,
        stale_after_s: float = 120.0,
    ) -> None:
        # The fleet's prefill fit: every engine's samples, each at its engine's speed.
        self.pool = PrefillFit(alpha=POOL_ALPHA)
        self.profiles = {e.name: Profile(pool=self.pool) for e in engines}
        # Each engine's speed against the pool (`_pooled`): samples since every measured
        # engine's was last read, and whether the pool told sizes apart then.
        self.speeds = Speeds()
        self._unread = 0
        self._telling = False
        # The fleet's fit's samples as measured, each with its engine (`_refit`).
        # An engine that left leaves its samples' places (named None): what the fit
        # remembers is still the last POOL_SAMPLES, less those.
        self._samples: deque[tuple[str | None, int, int, float]] = deque(maxlen=POOL_SAMPLES)
        self._unfitted = 0  # samples since the last refit
        # Per engine that serves several models, a profile per model it has served (its
        # prompts' own prefill: an adapter, or a second model on one engine, runs at a rate
        # of its own), begun as a copy of the engine's and learned as it is.
        self.models: dict[str, dict[str, Profile]] = {}
        self.edge = 1.0  # the learned widening of every projection (EDGE_TARGET)
        self.shape: float | None = None  # the fleet's prefill curve (`_reshape`)
        # The fleet's typical miss (every engine's scored projections): an engine's margin
        # until it has enough of its own.
        self.drift: float | None = None
        self.drift_samples = 0
        self.spread: float | None = None  # the fleet's, as an engine's `spread`
        self.spread_weight = 0.0
        self.drift_bound = drift_bound
        self.drift_min_samples = drift_min_samples
        self.stale_after_s = stale_after_s

    def add(self, e: Engine) -> None:
        """A new engine's profile starts from the median of the fleet's measured ones (the
        same model): it takes its share of work at once, and its own measurements take
        over within a few requests. Its last measurement is 'never', so the profiler
        probes it first."""
        if e.name in self.profiles:
            return
        prof = Profile(pool=self.pool)
        measured = [p for p in self.profiles.values() if p.prefill_tps is not None]
        if measured:
            for k in (
                "bytes_per_token",
                "prefill_tps",
                "overhead_s",
                "quad_s",
                "tpot_s",
                "output_tokens",
                "correction",
            ):
                values = [getattr(p, k) for p in measured if getattr(p, k) is not None]
                if values:
                    setattr(prof, k, statistics.median(values))
        self.profiles[e.name] = prof

    def remove(self, e: Engine) -> None:
        self.profiles.pop(e.name, None)
        if any(n == e.name for n, *_ in self._samples):
            # Its samples were divided by a speed no longer learned (and one that comes
            # back under its name starts again): out of the fit.
            self._samples = deque(
                ((None if n == e.name else n, f, t, s) for n, f, t, s in self._samples),
                maxlen=POOL_SAMPLES,
            )
        self.speeds.drop(e.name)
        self.models.pop(e.name, None)

    def of_model(self, e: Engine, model: str) -> Profile:
        """The profile a prompt for `model` is projected with on `e`: the model's own where
        the engine serves several and has served this one, else the engine's."""
        own = self.models.get(e.name)
        prof = own.get(model) if own is not None else None
        return prof if prof is not None else self.profiles[e.name]

    # What a new leader takes over (router HA): the learned rates, not the drift state.
    _SHARED = (
        "bytes_per_token",
        "prefill_tps",
        "overhead_s",
        "quad_s",
        "largest_measured",
        "tpot_s",
        "output_tokens",
        "prefill_samples",
        "correction",
        "drift",
        "drift_samples",
        "spread",
        "spread_weight",
        "speed",
    )
    # What the whole fleet learned: its typical miss (an engine's margin until it has its
    # own) and the edge. Kept under the name "", which no engine can have.
    _FLEET = ("drift", "drift_samples", "spread", "spread_weight", "edge")

    _COUNTS = ("prefill_samples", "largest_measured", "drift_samples")

    def export(self) -> bytes:
        """The learned profiles, for the next leader (bounded: a few numbers an engine)."""
        out = {name: {k: getattr(p, k) for k in self._SHARED} for name, p in self.profiles.items()}
        out[""] = {k: getattr(self, k) for k in self._FLEET}
        return orjson.dumps(out)

    def load(self, raw: bytes) -> int:
        """Take over profiles another leader learned; how many engines it knew. They count
        as measured now: the leader published them seconds ago."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return 0
        if not isinstance(data, dict):
            return 0
        taken = 0
        now = time.monotonic()
        fleet = data.pop("", None)
        if isinstance(fleet, dict):
            _take(self, fleet, self._FLEET, self._COUNTS)
            self.edge = min(MAX_EDGE, max(1.0, self.edge))  # within what it can learn
            if self.drift is not None:
                self.drift = max(0.0, self.drift)
            if self.spread is not None:
                self.spread, self.spread_weight = (
                    max(0.0, self.spread),
                    max(0.0, self.spread_weight),
                )
        for name, shared in data.items():
            prof = self.profiles.get(name)
            if prof is None or not isinstance(shared, dict):
                continue
            _take(prof, shared, self._SHARED, self._COUNTS)
            if prof.prefill_tps is not None:
                prof.measured_at = now
            taken += 1
        return taken

    def watch(self, events: Events) -> None:
        """Learn from every answered lease; a faulted one's timing is not trusted. The edge
        learns at the first token, when lateness is known (an answer may stream for
        minutes after), and from a prompt that left its seat with none past its due."""
        events.subscribe(
            first_output=self._first,
            finished=self._learn,
            fault=self._discard,
            released=self._released,
        )

    def _score(self, late: bool) -> None:
        step = EDGE_GAIN * ((1.0 if late else 0.0) - EDGE_TARGET)
        self.edge = min(MAX_EDGE, max(1.0, self.edge * math.exp(step)))

    def _first(self, lease: Lease) -> None:
        if lease.ttft_by is not None:
            self._score(lease.measured.first_at > lease.ttft_by)

    def _released(self, lease: Lease) -> None:
        # No first token, and past due: late, whether its client gave up or the engine
        # failed it. (One that left before its due says nothing of the projection.)
        due = lease.ttft_by
        if due is not None and not lease.measured.first_at and time.monotonic() > due:
            self._score(True)
        # A warm cut short yielded to a live request: it says nothing of how long it takes.
        if lease.prefill_cut and lease.faulted in (None, "deadline_exceeded") and not lease.warm:
            prof = self.profiles.get(lease.on.name)
            if prof is not None and lease.prefill_s is not None:
                # Sized as placed: the tokens it was to prefill, and the cache before them.
                fresh = lease.tokens or lease.request.estimated_prompt_tokens()
                if prof.cut(
                    fresh, fresh + (lease.cached_expected or 0), lease.prefill_s, lease.queued
                ):
                    self._reshape()
                    self._pooled(lease.on.name)

    def _learn(self, lease: Lease) -> None:
        e = lease.on
        prof = self.profiles.get(e.name)
        if prof is None:
            return  # its engine left the fleet while it ran
        mprof = None
        if e.spec.several_models:
            own = self.models.setdefault(e.name, {})
            mprof = own.get(lease.request.served)
            if mprof is None and len(own) < MODEL_PROFILES:
                # Begun from what the engine has learned so far: the model's own
                # measurements take over as they come.
                mprof = own[lease.request.served] = copy.deepcopy(prof)
                # A model's own rate: the fleet's pool is the engine's model's.
                mprof.pool, mprof.pooled = None, False
        curve, samples = prof.curve, prof.prefill_samples
        miss = self._observe(prof, lease, lease.predicted_s)
        if prof.curve != curve:
            self._reshape()
        if prof.prefill_samples != samples:
            self._pooled(e.name)
        if miss is not None and lease.predicted_s:
            self.drift = _ewma(self.drift, abs(miss))
            self.spread, self.spread_weight = _weighed(
                self.spread, self.spread_weight, abs(miss), lease.predicted_s
            )
            self.drift_samples += 1
        if mprof is not None:
            self._observe(mprof, lease, None)  # the engine's profile scores the miss

    def _pooled(self, name: str) -> None:
        """Engine `name` put a sample into the pool: its speed against it, and once the pool
        tells sizes apart, its rate, overhead and curve as the pool's at that speed; every
        measured engine's once a round (as many samples as engines measured), and when the
        pool first tells sizes. One engine's own fit of the dozen prompts it measured is
        noisy, and placement picks the engine whose projection is least: on 64 engines the
        most hopeful fits won the long prompts and served them at two to five times their
        projections (the fleet bench at 0.5x, 2026-12-07). The pool has every engine's
        samples; what an engine's own say is one number, its speed, and that is read with
        the speeds of the engines whose samples say they are of its kind (`Speeds`): on a
        fleet of one kind of device all read the pool's, on a mixed one each its kind's.
        Between rounds the others keep the pool as they last read it: it moves by a
        hundredth of a sample each sample."""
        prof = self.profiles.get(name)
        if prof is not None and prof.taken is not None:
            self._samples.append((name, *prof.taken))
            self._unfitted += 1
            prof.taken = None
        if prof is not None and prof.paces[0] > 0:
            self.speeds.put(name, *prof.paces)
        pool = self.pool
        telling = pool.last is not None and pool.tells_sizes()
        self._unread += 1
        first_telling = telling != self._telling
        round_over = self._unread >= len(self.speeds) or first_telling
        if round_over:
            self._unread, self._telling = 0, telling
            self.speeds.resum()
            rows = [self.profiles[n] for n in self.speeds.names()]
        else:
            rows = [prof] if prof is not None and prof.paces[0] > 0 else []
        reading = self.speeds.reading()
        if reading is None:
            return
        for p in rows:
            p.speed = self.speeds.speed(reading, p.paces[0], p.paces[1])
        if round_over and (self._unfitted >= REFIT_EVERY or first_telling):
            self._refit()
        if not telling:
            return
        assert pool.last is not None
        tps, overhead, quad = pool.last
        for p in rows:  # those measured against it: the rest fit their own until they are
            p.prefill_tps, p.overhead_s, p.quad_s = (
                tps / p.speed,
                overhead * p.speed,
                quad * p.speed,
            )
            p.pooled = True

    def _refit(self) -> None:
        """The fleet's fit from its samples again, each divided by its engine's speed as it
        is now, not as it was when the sample came: the slow engines' first samples, taken
        while they were read at the fleet's speed, entered at twice their time and bent the
        fit's curve for the ~100 samples it remembers (the fleet bench on two speeds: a
        20k-token prompt projected at 1.58x its time, where the same samples refitted at
        the speeds learned by then give 0.96x; bench/README.md)."""
        self._unfitted = 0
        fit = PrefillFit(alpha=POOL_ALPHA)
        for name, fresh, prompt, seconds in self._samples:
            p = self.profiles.get(name) if name is not None else None
            if p is not None:
                fit.take(fresh, prompt, seconds / p.speed)
        pool = self.pool
        # Only while it holds a place for every sample the fit remembers (a profile fed
        # outside the events, as the router's tests do, leaves the fit as it is).
        if fit.count and len(self._samples) >= min(pool.count, POOL_SAMPLES):
            pool.m = fit.m
            pool.last = pool.fit()

    def _reshape(self) -> None:
        """An engine's curve changed: the fleet's is the median of those its engines'
        samples tell, once at least half its engines tell one (None where that is no
        cost's). One engine's curve from its first noisy prompts ranges from none to nine
        times the truth (six prompts an engine, the 5th-95th percentiles of simulated
        draws), a median of three from none to five times: read from the first few, it
        projected 2-3 s prompts past a 5 s budget in a 64-engine run's first minute."""
        curves = [p.curve for p in self.profiles.values() if p.curve is not None]
        shape = None
        if curves and 2 * len(curves) >= len(self.profiles):
            shape = statistics.median(curves)
        self.shape = shape if shape is not None and shape > 0 else None

    @staticmethod
    def _observe(prof: Profile, lease: Lease, predicted_s: float | None) -> float | None:
        m = lease.measured
        return prof.observe(
            lease.request.prompt_bytes,
            m.prompt_tokens,
            lease.projected_ttft_s,
            lease.prefill_s,
            0 if lease.warm else m.output_tokens,
            m.decode_s,
            predicted_s,
            cached_tokens=m.cached_tokens or 0,
            expected_cached=lease.cached_expected or 0,
            probe=lease.probe,
            queued=lease.queued,
        )

    def _discard(self, lease: Lease, kind: str, against_engine: str | None) -> None:
        prof = self.profiles.get(lease.on.name)
        if prof is not None and kind != "engine_error":  # its own answer is no bad measurement
            prof.discarded += 1

    def degraded(self, engines: list[Engine]) -> str | None:
        """Why the predictor cannot be trusted now, or None. Only engines with a measured
        profile count: cold start is not degradation."""
        now = time.monotonic()
        reasons = []
        for e in engines:
            p = self.profiles[e.name]
            if p.prefill_tps is None:
                return None
            age = p.age_s(now)
            if age > self.stale_after_s:
                told = "never measured" if p.measured_at is None else f"{age:.0f}s old"
                reasons.append(f"{e.name}: telemetry is {told}")
            elif (
                p.drift is not None
                and p.drift_samples >= self.drift_min_samples
                and p.drift > self.drift_bound
            ):
                reasons.append(
                    f"{e.name}: prediction drift {p.drift:.2f} is beyond {self.drift_bound:.2f}"
                )
            else:
                return None
        return "; ".join(reasons) or None

    def margin(self, prof: Profile) -> float:
        """How much wider than the projection admission plays it on this engine: by its own
        typical miss, or until it has enough of them, the fleet's (a new engine, or every
        engine of a router that just started: under load a fresh router's first requests on
        each engine are placed at the budget's edge, and with no margin until each engine
        had five scored, one in six of those of a 4x bench run came late)."""
        # (A profile a router of before the spread published carries only the drift.)
        typical = prof.spread if prof.spread is not None else prof.drift
        if typical is None or prof.drift_samples < self.drift_min_samples:
            typical = self.spread if self.spread is not None else self.drift
            if typical is None or self.drift_samples < self.drift_min_samples:
                return 1.0  # a few cold-start misses (fixed overheads) say nothing yet
        return min(MAX_MARGIN, math.exp(MARGIN_SPREAD * typical))

    def size(self, prompt_bytes: int, e: Engine, lender: Profile | None = None) -> int:
        """A prompt's tokens at the engine's bytes a token (`bytes_per_token`)."""
        bpt = bytes_per_token(self.profiles[e.name], lender)
        return max(1, math.ceil(prompt_bytes / (bpt or 4.0)))

    def describe(self) -> dict[str, float | int | None]:
        """What widens every projection, for `/ready`: the learned edge, and the fleet's
        typical miss (an engine's margin until it has its own; each engine's own margin is
        beside its profile); and the fleet's prefill fit, what an engine measured against it
        is projected by at its own speed (None until its samples tell sizes apart)."""
        pool = self.pool
        tps, overhead, quad = pool.last if pool.last and pool.tells_sizes() else (None,) * 3
        return {
            "edge": self.edge,
            "drift": self.drift,
            "drift_samples": self.drift_samples,
            "prefill_curve": self.shape,
            "fleet_prefill_tokens_per_s": tps,
            "fleet_prefill_overhead_s": overhead,
            "fleet_prefill_quadratic_s": quad,
            "fleet_prefill_samples": pool.count,
        }

    def lender(self, engines: list[Engine], model: str = "") -> Profile | None:
        """Of `engines`' profiles (for `model`), the one that vouches for the largest prompts
        (`Profile.vouched_up_to`); None where none vouches yet. The engines serve one model
        with one tokenizer, on the same kind of device as a rule: an engine whose own
        measurements cannot vouch for a prompt's size (it was placed on less, or little:
        at a 1 s budget an engine measures only the short prompts it was given) is projected
        with what the fleet measured, and one that has sized no client's text yet sizes it
        as the fleet does. Without it, each engine in turn admitted prompts it projected
        at several times the budget, as guesses, until it had measured one (the fleet
        bench at 1 s: 9 served late, 5 abandoned a run, every one on such an engine, 4 of
        them sized at twice their tokens by the probe's bytes a token)."""
        best: Profile | None = None
        for e in engines:
            p = self.of_model(e, model) if model else self.profiles.get(e.name)
            if p is None or p.prefill_tps is None or not p.vouched_up_to:
                continue
            if best is None or p.vouched_up_to > best.vouched_up_to:
                best = p
        return best

    def project(
        self,
        prompt_bytes: int,
        e: Engine,
        cached: int = 0,
        rank: int = 2,
        model: str = "",
        lender: Profile | None = None,
    ) -> Projection:
        """TTFT on `e` for a prompt of `prompt_bytes` of which `cached` tokens are expected
        to come from its prefix cache: the prefill ahead of it there (placed on the engine,
        and waiting in the router's queue for a seat there in its class `rank` or a higher
        one, which go first), how far the engine is behind its projections now, then what
        is left of this prompt (at least its last token: an engine always computes that),
        at the rate of its `model` there where it has one of its own. `lender`: what the
        prompt is sized and its own prefill projected with where the engine's own
        measurements cannot vouch for its size (`Predictor.lender`)."""
        tokens = self.size(prompt_bytes, e, lender)
        fresh = tokens - min(cached, tokens - 1)
        prof = self.profiles[e.name]
        if prof.prefill_tps is None:
            return Projection(e, fresh, None, None)
        mine = self.of_model(e, model) if model else prof
        if lender is not None and not mine.vouches(fresh) and lender.vouches(fresh):
            speed = speed_against(mine, lender)
            own = lender.prefill_s(fresh, tokens, self.shape) * speed
            alone = functools.partial(lender.alone_s, fresh, tokens, self.shape, speed)
            sure = True
        elif mine.prefill_tps is not None:
            own = mine.prefill_s(fresh, tokens, self.shape)
            alone = functools.partial(mine.alone_s, fresh, tokens, self.shape)
            sure = mine.vouches(fresh)
        else:
            own, alone = 0.0, None
            sure = False
        waiting = prof.ahead_s(sum(e.queued_tokens[: rank + 1]), sum(e.queued_sq[: rank + 1]))
        ahead = e.ahead_s(prof.ahead_s(e.prefill_tokens, e.prefill_sq), time.monotonic())
        total = own + ahead + waiting
        guarded = total * self.margin(prof) * self.edge
        return Projection(e, fresh, own, total, guarded, waiting, sure, alone)


def speed_against(prof: Profile, lender: Profile) -> float:
    """How much longer a prefill takes on the engine of `prof` than on the lender's, read
    where `prof` measured (its largest prompt, the probe's at least): the lender's curve
    says how prefill grows with a prompt's size, this engine's own samples how fast it is.
    A fleet mixes devices (an H100 beside an A10, two generations of one): lent unscaled, a
    slow engine's long prompts were projected at the fast one's time (the fleet bench, half
    the engines at half speed: an 8.2k-token prompt projected at 1.0 s of prefill took
    2.5 s, its first token late). 1 where `prof` has measured nothing."""
    if prof.prefill_tps is None or prof.largest_measured <= 0 or lender.prefill_tps is None:
        return 1.0
    at = prof.largest_measured
    theirs = lender.prefill_s(at)
    return prof.prefill_s(at) / theirs if theirs > 0 else 1.0


def bytes_per_token(prof: Profile, lender: Profile | None) -> float | None:
    """What a prompt is sized by on an engine with profile `prof`: its own bytes a token,
    or the lender's where it has sized no client's text yet (only the probe's prose)."""
    if not prof.sized_live and lender is not None and lender.sized_live:
        return lender.bytes_per_token
    return prof.bytes_per_token


def _take(
    into: object, shared: dict[str, object], names: tuple[str, ...], counts: tuple[str, ...]
) -> None:
    """The finite numbers `shared` has under `names`, set on `into` (counts as ints)."""
    for k in names:
        v = shared.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            setattr(into, k, int(v) if k in counts else float(v))
