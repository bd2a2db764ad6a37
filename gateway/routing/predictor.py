"""Per-engine TTFT prediction, learned online from the TTFTs the gateway observes.

Model (per engine, no shared constants):

    ttft = t0 + t1 * W + t2 * D + t3 * W * D        W = prefill tokens ahead + own uncached tokens (thousands)
                                                    D = running decodes (tens)

t0 is the fixed overhead (gateway + scheduling + one step), t1 the time per 1k prefill tokens (1 / prefill
rate), t2 the slowdown per running decode, t3 the extra per-token cost when decodes share the steps.
Parameters are fit by recursive least squares on *relative* residuals (each equation divided by the
prediction, so a 20 ms and a 5 s TTFT weigh alike and the fit minimises percentage error), with Huber
clipping of residuals (one outlier moves the fit by a bounded step) and a forgetting factor (engines drift).
Once an engine has `refit_min` observations, predictions come from a batch refit of the same model on its last
`refit_window` observations (bounded, Huber-IRLS least squares of relative error, every `refit_every`): the
recursive fit's path dependence under the router's feedback loop multiplied the error under overload
(docs/benchmarks.md, "Predictor settings").
The split-conformal quantile of the last `quantile_window` out-of-sample relative errors (per engine, per group:
prefill queued ahead or not, and one prefill step or more) turns the mean prediction into the calibrated upper
bound admission uses.
Everything is pure and synchronous with an injectable clock.

Guard against degenerate fits (a burst the features cannot explain can pin the prefill rate at its bound and put
seconds into the overhead): every coefficient is boxed in physical bounds (`lower`, `upper`: at most 500k
prefill tokens/s, at most 0.5 s of fixed overhead), and when the out-of-sample error explodes one-sidedly
(median ln(actual / predicted) over the last `guard_window` observations beyond +-`guard_log_error`, judged once
the fit has `refit_min` observations of its own, so never on the cold-start prior) the learner resets: the fit
restarts from the prior plus those of the last observations it got wrong, the residual quantile and the drain's
per-token cost start over, and the reset is counted (`guard` in /admin/routing).
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable

import numpy as np

from gateway.routing.view import Drain

_N = 4


@dataclass(frozen=True, slots=True)
class Features:
    """What is known about one request on one engine at routing time."""

    ahead_tokens: float  # prefill tokens queued ahead of this request on the engine
    uncached_tokens: float  # this request's prompt tokens not in the engine's prefix cache
    running: float  # sequences decoding on the engine

    def vector(self) -> list[float]:
        w = (self.ahead_tokens + self.uncached_tokens) / 1000.0
        d = self.running / 10.0
        return [1.0, w, d, w * d]


@dataclass(frozen=True, slots=True)
class PredictorParams:
    """Cold-start prior and learning knobs (the same for every engine; the learned values are per engine)."""

    prior: tuple[float, ...] = (0.030, 0.125, 0.005, 0.0)  # 30 ms overhead, 8k tok/s, 0.5 ms per decode
    prior_var: tuple[float, ...] = (4.0, 4.0, 4.0, 1.0)  # P0 diagonal, relative-residual units
    forgetting: float = 0.995
    huber_k: float = 2.5  # clip residuals at k * running scale of |relative residual|
    quantile: float = 0.9  # admission's upper bound
    window: int = 256  # recent out-of-sample errors kept for MdARE and calibration (reporting)
    # residuals the upper quantile is taken over: the most recent only, since the error's spread moves with the
    # load (the coverage by window size is in docs/routing.md)
    quantile_window: int = 64
    min_samples: int = 16  # before this many, the upper bound uses cold_margin
    cold_margin: float = 0.5  # upper = mean * (1 + cold_margin) while cold
    floor_s: float = 0.001
    max_trace: float = 1e4  # cap on trace(P) so idle directions cannot blow up under forgetting
    regime_bias: float = 0.3  # |mean signed relative error| that counts as a change of regime
    step_prior_s: float = 0.015  # an engine step (decode batch) until inter-token times were observed
    step_alpha: float = 0.1  # EWMA weight of one observed mean inter-token time
    lower: tuple[float, ...] = (0.0005, 0.002, 0.0, 0.0)  # physical bounds: >= 0.5 ms overhead, <= 500k tok/s
    upper: tuple[float, ...] = (0.5, 2.0, 0.5, 0.5)  # <= 0.5 s overhead, >= 500 tok/s, <= 50 ms per decode
    guard_window: int = 16  # out-of-sample errors the degenerate-fit guard looks at
    guard_log_error: float = math.log(3.0)  # median |ln(actual/predicted)| beyond this (3x off) resets the fit
    refit_window: int = 256  # observations kept for the batch refit (0: recursive fit only)
    refit_every: int = 4  # refit after this many new observations
    # ... but at most once per this interval (unless refit_every x 16 new ones came): the refit's cost then
    # follows time, not traffic, which matters once peers' samples arrive too (N replicas: N x the samples)
    refit_min_interval_s: float = 0.02
    refit_min: int = 24  # the batch fit predicts once the window holds this many observations
    refit_iters: int = 3  # IRLS passes (Huber weights on relative residuals)


def queued(f: Features) -> bool:
    """The group a request's residual is kept in for the upper bound: prefill work queued ahead of it or not."""
    return f.ahead_tokens > 0


def size_group(f: Features, budget: int) -> tuple[bool, bool]:
    """The finer group: queued ahead or not, and whether its prefill work (ahead + its own uncached tokens) takes
    more than one chunked-prefill step. A one-step TTFT's relative error is mostly where in the running step it
    arrived (up to a whole step of a 20-60 ms TTFT); a multi-step prefill's is a few percent. Pooled, the short
    requests' spread set the margin of long ones, so long prompts' bounds over-covered their target
    (docs/benchmarks.md, "Live heterogeneous fleet")."""
    return f.ahead_tokens > 0, f.ahead_tokens + f.uncached_tokens > budget


def conformal_quantile(residuals: "deque[float] | list[float]", q: float) -> float:
    """The split-conformal q quantile of residuals (rank ceil(q (n + 1)) of n, at most the largest), floored at
    0: a bound that covers at least q of exchangeable new errors."""
    xs = sorted(residuals)
    n = len(xs)
    k = min(n - 1, max(0, math.ceil(q * (n + 1)) - 1))
    return max(0.0, xs[k])


@dataclass
class EngineLearner:
    """The online fit for one engine. `predict` is the mean TTFT in seconds; `upper` the calibrated quantile."""

    params: PredictorParams = field(default_factory=PredictorParams)
    clock: Callable[[], float] = time.monotonic
    theta: list[float] = field(default_factory=list)
    P: list[list[float]] = field(default_factory=list)
    scale: float = 0.2  # running mean of |relative residual| (Huber scale)
    bias: float = 0.0  # running mean of the signed relative residual (change detection)
    regime_changes: int = 0
    residuals: deque[float] = field(default_factory=deque)
    samples: int = 0
    clipped: int = 0
    ape_sum: float = 0.0  # sum of |actual - predicted| / actual, out of sample
    last_update: float | None = None
    step_s: float | None = None  # EWMA of observed mean inter-token time: the engine's step under load
    budget: int = 8192  # the engine's chunked-prefill token budget per step (set by `Predictor.drain`)
    pf_time: float = 0.0  # decayed sums for the drain's prefill cost per token (see observe)
    pf_tokens: float = 0.0
    _q_cache: dict[object, tuple[int, float]] = field(default_factory=dict)
    # the same residuals split by whether prefill work was queued ahead (a Mondrian conformal bound: the error's
    # spread differs between an idle engine and one working off a queue)
    residuals_by: dict[bool, deque[float]] = field(default_factory=dict)
    residuals_by_size: dict[tuple[bool, bool], deque[float]] = field(default_factory=dict)  # by size_group
    # the batch refit's window, a ring of the last refit_window observations (order does not matter to a
    # least-squares fit, so rows are overwritten in place: no per-refit copy of a Python deque into numpy)
    win_x: np.ndarray | None = None  # feature vectors, one row per observation
    win_y: np.ndarray | None = None  # ... and their observed TTFTs
    win_len: int = 0  # rows filled
    batch_theta: list[float] | None = None
    refit_at: float = 0.0  # clock and sample count of the last batch refit (refit_min_interval_s)
    refit_samples: int = 0
    recent_log_err: deque[float] = field(default_factory=deque)  # ln(actual/predicted), out of sample (guard)
    resets: int = 0
    since_reset: int = 0  # observations since the last reset (or the start): the guard judges fits, not the prior
    last_reset_at: float | None = None
    apes: deque[float] = field(default_factory=deque)  # |actual - predicted| / actual, out of sample (MdARE)
    calib: deque[bool] = field(default_factory=deque)  # actual <= the upper bound admission used
    calib_n: int = 0
    calib_hit: int = 0
    drain_memo: Drain | None = None  # the last Predictor.drain answer (a frozen value: reused while it holds)

    def __post_init__(self) -> None:
        p = self.params
        if not self.theta:
            self.theta = list(p.prior)
        if not self.P:
            self.P = [[p.prior_var[i] if i == j else 0.0 for j in range(_N)] for i in range(_N)]
        self.residuals = deque(self.residuals, maxlen=max(p.min_samples, p.quantile_window))
        self.residuals_by = {k: deque(self.residuals_by.get(k, ()), maxlen=self.residuals.maxlen)
                             for k in (False, True)}
        self.residuals_by_size = {(q, m): deque(self.residuals_by_size.get((q, m), ()), maxlen=self.residuals.maxlen)
                                  for q in (False, True) for m in (False, True)}
        self.recent_log_err = deque(self.recent_log_err, maxlen=max(1, p.guard_window))
        self.apes = deque(self.apes, maxlen=p.window)
        self.calib = deque(self.calib, maxlen=p.window)
        if self.win_x is None or self.win_y is None:
            self.win_x = np.zeros((max(1, p.refit_window), _N))
            self.win_y = np.ones(max(1, p.refit_window))

    # ---------------------------------------------------------------- prediction
    def cold(self) -> bool:
        """No fit of its own yet: fewer than 2 observations per coefficient since the start (or a reset)."""
        return self.batch_theta is None and self.since_reset < 2 * _N

    def predict(self, f: Features, theta: list[float] | None = None) -> float:
        """Mean TTFT (s); `theta` overrides the engine's own parameters (a cold engine borrows the fleet's)."""
        p = self.params
        lo, hi = p.lower, p.upper
        t0, t1, t2, t3 = theta if theta is not None else self.batch_theta if self.batch_theta is not None else self.theta
        w = (f.ahead_tokens + f.uncached_tokens) / 1000.0  # Features.vector, summed in its order without a list
        d = f.running / 10.0
        return max(p.floor_s, min(max(t0, lo[0]), hi[0]) * 1.0 + min(max(t1, lo[1]), hi[1]) * w
                   + min(max(t2, lo[2]), hi[2]) * d + min(max(t3, lo[3]), hi[3]) * (w * d))

    def margin(self, f: Features | None = None) -> float:
        """Relative margin of the upper quantile over the mean prediction: the quantile of the recent residuals
        of requests like `f` (`size_group`: work queued ahead or not, one prefill step or more), else of those
        queued alike (`queued`), else of all recent ones, the first of these holding min_samples (all without
        `f`)."""
        p = self.params
        if len(self.residuals) < p.min_samples:  # cold: also right after a guard reset
            return p.cold_margin
        key: object = "all"
        res = self.residuals
        if f is not None:
            sg = size_group(f, self.budget)
            grp = self.residuals_by_size.get(sg)
            if grp is not None and len(grp) >= p.min_samples:
                key, res = sg, grp
            else:
                grp = self.residuals_by.get(sg[0])
                if grp is not None and len(grp) >= p.min_samples:
                    key, res = sg[0], grp
        c = self._q_cache.get(key)
        if c is None or c[0] != self.samples:
            c = self._q_cache[key] = (self.samples, conformal_quantile(res, p.quantile))
        return c[1]

    def upper(self, f: Features) -> float:
        return self.predict(f) * (1.0 + self.margin(f))

    # ---------------------------------------------------------------- learning
    def observe(self, f: Features, ttft_s: float, upper_s: float | None = None) -> float:
        """Fold one observed TTFT into the fit; returns the out-of-sample relative error (actual/pred - 1).
        `upper_s`: the upper bound admission used for this request (calibration), when known."""
        p = self.params
        if not (ttft_s > 0 and math.isfinite(ttft_s)):
            return 0.0
        self._observe_prefill(f, ttft_s)
        pred = self.predict(f)
        self.samples += 1
        self.since_reset += 1
        ape = abs(ttft_s - pred) / ttft_s
        self.ape_sum += ape
        self.apes.append(ape)
        if upper_s is not None and upper_s > 0:
            ok = ttft_s <= upper_s
            self.calib.append(ok)
            self.calib_n += 1
            self.calib_hit += ok
        r = ttft_s / pred - 1.0
        self.residuals.append(r)
        self.residuals_by[queued(f)].append(r)
        self.residuals_by_size[size_group(f, self.budget)].append(r)
        self.recent_log_err.append(math.log(ttft_s / pred))
        if self.batch_theta is None:  # the recursive fit predicts until the batch refit takes over
            self._observe_recursive(f, ttft_s)
        self.last_update = self.clock()
        if p.refit_window > 0:
            i = (self.samples - 1) % p.refit_window
            self.win_x[i] = f.vector()  # type: ignore[index]
            self.win_y[i] = ttft_s  # type: ignore[index]
            self.win_len = min(self.win_len + 1, p.refit_window)
            if self.win_len >= p.refit_min and self.samples % p.refit_every == 0:
                now = self.last_update
                if (self.batch_theta is None or now - self.refit_at >= p.refit_min_interval_s
                        or self.samples - self.refit_samples >= 16 * p.refit_every):
                    self.batch_theta = self._refit()
                    self.refit_at, self.refit_samples = now, self.samples
        if self.exploded():
            self.reset()
        return r

    def exploded(self) -> bool:
        """The degenerate-fit guard's test: the last guard_window predictions were off to one side by more than
        guard_log_error in the median (a factor of 3 by default). One-sided: a fit that is merely noisy on data
        it cannot represent (errors both ways) is no regime change, and resetting it would only lose data."""
        p = self.params
        e = self.recent_log_err
        return (self.since_reset >= max(p.refit_min, p.guard_window) and len(e) >= p.guard_window
                and abs(statistics.median(e)) > p.guard_log_error)

    def reset(self) -> None:
        """Start the fit over from the prior and those of the last guard_window observations that the old fit
        got wrong by more than guard_log_error (the current regime):
        older rows leave the refit window, the residual quantile (hence the admission margin) and the drain's
        per-token cost start over. Counted in `resets`."""
        p = self.params
        errs = list(self.recent_log_err)
        n = min(self.win_len, len(errs)) if p.refit_window > 0 else 0
        rows = []
        for k in range(n):  # of the newest n rows of the ring (oldest first), those the old fit got wrong:
            if abs(errs[len(errs) - n + k]) > p.guard_log_error:  # the new regime
                i = (self.samples - n + k) % p.refit_window
                rows.append((self.win_x[i].copy(), float(self.win_y[i])))  # type: ignore[index]
        keep = len(rows)
        self.theta = list(p.prior)
        self.P = [[p.prior_var[i] if i == j else 0.0 for j in range(_N)] for i in range(_N)]
        self.scale, self.bias = 0.2, 0.0
        self.batch_theta = None
        self.residuals.clear()
        self.recent_log_err.clear()
        self._q_cache = {}
        for d in self.residuals_by.values():
            d.clear()
        for d in self.residuals_by_size.values():
            d.clear()
        self.pf_time = self.pf_tokens = 0.0
        self.win_len = 0
        for x, y in rows:  # replay the current regime through the recursive fit, back into the window
            self._observe_recursive_x([float(v) for v in x], y)
            i = self.win_len
            self.win_x[i] = x  # type: ignore[index]
            self.win_y[i] = y  # type: ignore[index]
            self.win_len += 1
        # the ring is indexed by samples: move the kept rows to where the next observations continue it
        if keep and p.refit_window > 0:
            xs, ys = self.win_x[:keep].copy(), self.win_y[:keep].copy()  # type: ignore[index]
            for k in range(keep):
                i = (self.samples - keep + k) % p.refit_window
                self.win_x[i], self.win_y[i] = xs[k], ys[k]  # type: ignore[index]
        if keep >= 2 * _N:  # enough rows to pin 4 coefficients: predict from their bounded refit at once
            self.batch_theta = self._refit()
        self.resets += 1
        self.since_reset = keep
        self.last_reset_at = self.clock()

    def _observe_recursive(self, f: Features, ttft_s: float) -> None:
        """One step of the recursive fit. Once the batch refit predicts, nothing reads this fit (the refit
        starts from scratch on its window), so it is no longer updated: work per observed TTFT that bought nothing."""
        self._observe_recursive_x(f.vector(), ttft_s)

    def _observe_recursive_x(self, vec: list[float], ttft_s: float) -> None:
        p = self.params
        # Weighted least squares with weight 1/y^2 (minimises squared *relative* error): the equation
        # x.theta = y divided by y becomes (x / y).theta = 1, whose residual r = (y - x.theta) / y.
        x = [xi / ttft_s for xi in vec]
        r = 1.0 - sum(t * xi for t, xi in zip(self.theta, x))
        # Huber: a residual beyond k * scale is clipped to it (bounded influence of outliers).
        c = max(p.huber_k * self.scale, 0.1)
        rc = r
        if abs(r) > c:
            rc = math.copysign(c, r)
            self.clipped += 1
        self.scale = 0.97 * self.scale + 0.03 * min(abs(r), c)
        # Change detection: a persistent one-sided error (an engine slowed down or sped up) is no outlier;
        # reopen the covariance so the fit moves to the new regime in tens of samples, not hundreds.
        self.bias = 0.9 * self.bias + 0.1 * max(-1.0, min(1.0, r))
        if abs(self.bias) > p.regime_bias:
            self.P = [[p.prior_var[i] if i == j else 0.0 for j in range(_N)] for i in range(_N)]
            self.bias = 0.0
            self.scale = max(self.scale, abs(r))
            self.regime_changes += 1
            rc = r
        P = self.P
        px = [sum(P[i][j] * x[j] for j in range(_N)) for i in range(_N)]
        lam = p.forgetting
        denom = lam + sum(x[i] * px[i] for i in range(_N))
        k = [v / denom for v in px]
        self.theta = [t + ki * rc for t, ki in zip(self.theta, k)]  # unclamped (predict boxes it)
        trace = sum(P[i][i] for i in range(_N))
        div = lam if trace < p.max_trace else 1.0
        self.P = [[(P[i][j] - k[i] * px[j]) / div for j in range(_N)] for i in range(_N)]

    def _refit(self) -> list[float]:
        """Bounded, Huber-weighted least squares of relative error on the window (IRLS): unlike the
        recursive fit it has no memory of the path it took, so a burst of skewed samples cannot leave the
        parameters stranded after the burst has left the window."""
        p = self.params
        n = self.win_len
        y = self.win_y[:n]  # type: ignore[index]
        X = self.win_x[:n] / y[:, None]  # type: ignore[index]  # equations (x / y).theta = 1
        lo = np.array(p.lower)
        hi = np.array(p.upper)
        w = np.ones_like(y)
        th = np.array(self.theta)
        for _ in range(max(1, p.refit_iters)):
            th = _bounded_lstsq(X * w[:, None], w, lo, hi)
            r = 1.0 - X @ th
            s = max(1.4826 * float(np.median(np.abs(r))), 0.02)
            a = np.abs(r) / (p.huber_k * s)
            w = np.sqrt(np.where(a > 1.0, 1.0 / np.maximum(a, 1e-12), 1.0))
        return [float(v) for v in th]

    def observe_step(self, seconds: float) -> None:
        """Fold in one request's mean inter-token time ((last token - first token) / (tokens - 1))."""
        if seconds > 0 and math.isfinite(seconds):
            a = self.params.step_alpha
            self.step_s = seconds if self.step_s is None else (1 - a) * self.step_s + a * seconds

    def _observe_prefill(self, f: Features, ttft_s: float) -> None:
        """The drain's per-token prefill cost, fit on a fixed structure so no free intercept can absorb it:
        ttft = half a step (the rest of the current one, expected) + one step per chunk + cost x tokens.
        Step times come from inter-token times (an independent signal); only requests with >= 256 tokens of
        prefill work count, weighted by their tokens (decayed sums)."""
        w = f.ahead_tokens + f.uncached_tokens
        if w < 256:
            return
        chunks = math.ceil(w / max(1, self.budget))
        t = ttft_s - (0.5 + chunks) * self.step()
        lo, hi = self.params.lower[1] / 1000.0, self.params.upper[1] / 1000.0
        t = min(max(t, lo * w), hi * w)  # physical range: a 10 ms per token engine is broken, not slow
        self.pf_time = 0.98 * self.pf_time + t
        self.pf_tokens = 0.98 * self.pf_tokens + w

    def step(self) -> float:
        return self.step_s if self.step_s is not None else self.params.step_prior_s

    def s_per_token(self) -> float:
        """The drain's prefill cost per token: the structural fit once 4k tokens were seen, else the prior."""
        if self.pf_tokens >= 4096:
            return self.pf_time / self.pf_tokens
        return self.params.prior[1] / 1000.0

    def mape(self) -> float | None:
        return self.ape_sum / self.samples if self.samples else None

    def mdare(self) -> float | None:
        """Median absolute relative error of the recent out-of-sample predictions (|actual - pred| / actual)."""
        return statistics.median(self.apes) if self.apes else None

    def calibration(self) -> float | None:
        """Share of recent admitted requests whose actual TTFT was under the upper bound admission used
        (compare with the configured quantile)."""
        return sum(self.calib) / len(self.calib) if self.calib else None

    def guard(self) -> dict[str, object]:
        p = self.params
        th = self.batch_theta if self.batch_theta is not None else self.theta
        names = ("overhead", "per_1k_prefill", "per_10_decodes", "interaction")
        return {"resets": self.resets,
                "last_reset_s_ago": round(self.clock() - self.last_reset_at, 3) if self.last_reset_at else None,
                "recent_median_log_error": round(statistics.median(self.recent_log_err), 4)
                if self.recent_log_err else None,
                "reset_above": round(p.guard_log_error, 4),
                "at_bound": [n for n, t, lo, hi in zip(names, th, p.lower, p.upper) if t <= lo or t >= hi]}

    def snapshot(self) -> dict[str, Any]:
        p = self.params
        t = self.batch_theta if self.batch_theta is not None else self.theta  # the parameters predictions use
        t = [min(max(v, lo), hi) for v, lo, hi in zip(t, p.lower, p.upper)]
        md, cal = self.mdare(), self.calibration()
        return {"overhead_ms": round(t[0] * 1000, 3),
                "prefill_tokens_per_s": round(1000.0 / t[1], 1) if t[1] > 0 else None,
                "ms_per_10_decodes": round(t[2] * 1000, 3), "interaction_ms": round(t[3] * 1000, 4),
                "step_ms": round(self.step() * 1000, 3),
                "drain_tokens_per_s": round(1.0 / self.s_per_token(), 1), "samples": self.samples, "clipped": self.clipped, "regime_changes": self.regime_changes, "upper_margin": round(self.margin(), 4),
                "mape": round(mape, 4) if self.samples and (mape := self.mape()) is not None else None,
                "mdare": round(md, 4) if md is not None else None,
                "calibration": round(cal, 4) if cal is not None else None, "calibration_n": len(self.calib),
                "calibration_target": p.quantile, "guard": self.guard()}


def _bounded_lstsq(A: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray | None = None) -> np.ndarray:
    """min |A.theta - b| with lo <= theta <= hi: pin each coefficient that the free solution puts outside its
    box at the bound it crossed and re-solve the rest (an active set; at most one pass per coefficient).

    Solved on the normal equations (a 4x4 system: A's columns are few and the relative-error scaling keeps
    them well conditioned), by SVD so a feature that never varies (a rank-deficient A) still gets the
    minimum-norm answer; each pass costs a 4x4 solve, not a pass over A's rows."""
    if hi is None:
        hi = np.full(len(lo), np.inf)
    G = A.T @ A
    g = A.T @ b
    free = np.ones(len(lo), bool)
    pin = lo.copy()  # the value a fixed coefficient is held at
    th = lo.copy()
    for _ in range(len(lo)):
        fixed = ~free
        Gf = G[free]
        rhs = g[free] - Gf[:, fixed] @ pin[fixed]
        sol, *_ = np.linalg.lstsq(Gf[:, free], rhs, rcond=None)
        th[free] = sol
        th[fixed] = pin[fixed]
        below = free & (th < lo)
        above = free & (th > hi)
        if not (below.any() or above.any()):
            return th
        pin[below] = lo[below]
        pin[above] = hi[above]
        free &= ~(below | above)
        if not free.any():
            return pin.copy()
    return np.minimum(np.maximum(th, lo), hi)


_BATCH_THETA = attrgetter("batch_theta")


class Predictor:
    """One EngineLearner per engine name, created on first use with the cold-start prior.

    A cold engine (no fit of its own yet) is predicted with the median parameters of the engines that have one,
    and its recursive fit starts from them: otherwise the engines learned first look faster than the
    conservative prior, win every pick, and the others never get the traffic to learn (a 2x engine sat idle
    while a 1x one queued). Its upper bound, which admission checks, stays no lower than its own prediction
    with the cold margin: borrowing ranks an unknown engine, it promises nothing for it."""

    def __init__(self, params: PredictorParams | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.params = params or PredictorParams()
        self.clock = clock
        self.engines: dict[str, EngineLearner] = {}
        self._fleet_memo: tuple[tuple[list[float] | None, ...], list[float] | None] | None = None

    def learner(self, engine: str) -> EngineLearner:
        lr = self.engines.get(engine)
        if lr is None:
            lr = self.engines[engine] = EngineLearner(self.params, self.clock)
        return lr

    def fleet_theta(self) -> list[float] | None:
        """Median parameters of the engines with a fit of their own (None when there are none). Taken again
        only when a fit moved (a refit or a reset replaces an engine's `batch_theta`, never edits it in place):
        a cold engine is predicted with it on every request. The list returned is shared: not to be changed."""
        fits = tuple(map(_BATCH_THETA, self.engines.values()))
        memo = self._fleet_memo
        if memo is not None and memo[0] == fits:
            return memo[1]
        warm = [t for t in fits if t is not None]
        ft = [statistics.median(col) for col in zip(*warm)] if warm else None
        self._fleet_memo = (fits, ft)
        return ft

    def predict(self, engine: str, f: Features) -> tuple[float, float]:
        """(mean, upper) predicted TTFT in seconds."""
        lr = self.learner(engine)
        if lr.cold():
            ft = self.fleet_theta()
            if ft is not None:  # rank it like the fleet; admit on no less than its own (prior) prediction
                m = lr.predict(f, ft)
                return m, max(m, lr.predict(f)) * (1.0 + lr.margin(f))
        m = lr.predict(f)
        return m, m * (1.0 + lr.margin(f))

    def observe(self, engine: str, f: Features, ttft_s: float, upper_s: float | None = None) -> float:
        lr = self.learner(engine)
        if lr.cold() and lr.since_reset == 0:
            ft = self.fleet_theta()
            if ft is not None:
                lr.theta = list(ft)  # its own fit starts from the fleet's, not the prior
        return lr.observe(f, ttft_s, upper_s)

    def observe_step(self, engine: str, seconds: float) -> None:
        self.learner(engine).observe_step(seconds)

    def drain(self, engine: str, budget: int) -> Drain:
        """How fast this engine works off queued prefill, from what was learned about it (see view.Drain)."""
        lr = self.learner(engine)
        lr.budget = budget
        step, per_token = lr.step(), lr.s_per_token()
        d = lr.drain_memo
        if d is None or d.budget != budget or d.step_s != step or d.s_per_token != per_token:
            d = lr.drain_memo = Drain(step, per_token, budget)  # built only when a value moved
        return d

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: lr.snapshot() for name, lr in sorted(self.engines.items())}
