"""Predictor: learns per-engine parameters from synthetic TTFTs of known models, resists outliers, calibrates."""
from __future__ import annotations

import random
import statistics

from gateway.routing.predictor import EngineLearner, Features, Predictor, PredictorParams


def true_ttft(f: Features, overhead: float, per_tok: float, per_dec: float) -> float:
    return overhead + per_tok * (f.ahead_tokens + f.uncached_tokens) + per_dec * f.running


def _feed(lr: EngineLearner, rng: random.Random, n: int, params: tuple[float, float, float], noise: float = 0.03,
          outliers: float = 0.0) -> None:
    for _ in range(n):
        f = Features(ahead_tokens=rng.choice([0, 0, rng.uniform(0, 8000)]), uncached_tokens=rng.uniform(10, 4000),
                     running=rng.uniform(0, 40))
        y = true_ttft(f, *params) * (1 + rng.gauss(0, noise))
        if rng.random() < outliers:
            y *= 20  # a GC pause or network hiccup
        lr.observe(f, y)


def test_cold_start_default_is_sensible():
    lr = EngineLearner()
    f = Features(0, 1000, 0)
    assert 0.05 < lr.predict(f) < 0.5  # tens to hundreds of ms for 1k tokens
    assert lr.upper(f) > lr.predict(f)  # cold: a margin, never a promise tighter than the mean


def test_learns_two_engines_separately():
    rng = random.Random(1)
    h200 = (0.010, 1 / 16000, 0.0002)
    l40s = (0.025, 1 / 6000, 0.0005)
    p = Predictor()
    _feed(p.learner("h200"), rng, 400, h200)
    _feed(p.learner("l40s"), rng, 400, l40s)
    for name, par in (("h200", h200), ("l40s", l40s)):
        errs = []
        for _ in range(200):
            f = Features(rng.uniform(0, 4000), rng.uniform(10, 4000), rng.uniform(0, 40))
            y = true_ttft(f, *par)
            errs.append(abs(p.predict(name, f)[0] - y) / y)
        assert sum(errs) / len(errs) < 0.05, name
    snap = p.snapshot()
    assert 13000 < snap["h200"]["prefill_tokens_per_s"] < 19000
    assert 5000 < snap["l40s"]["prefill_tokens_per_s"] < 7200


def test_outliers_have_bounded_influence():
    rng = random.Random(2)
    par = (0.010, 1 / 16000, 0.0002)
    robust = EngineLearner()
    _feed(robust, rng, 500, par, outliers=0.05)
    f = Features(0, 2000, 10)
    y = true_ttft(f, *par)
    assert abs(robust.predict(f) - y) / y < 0.15
    assert robust.clipped > 0


def test_upper_quantile_is_calibrated():
    rng = random.Random(3)
    par = (0.015, 1 / 8000, 0.0003)
    lr = EngineLearner(PredictorParams(quantile=0.9))
    _feed(lr, rng, 600, par, noise=0.1)
    inside = 0
    n = 1000
    for _ in range(n):
        f = Features(rng.uniform(0, 4000), rng.uniform(10, 4000), rng.uniform(0, 40))
        y = true_ttft(f, *par) * (1 + rng.gauss(0, 0.1))
        inside += y <= lr.upper(f)
    assert 0.84 < inside / n < 0.96


def test_adapts_when_an_engine_slows_down():
    rng = random.Random(4)
    lr = EngineLearner()
    _feed(lr, rng, 300, (0.010, 1 / 16000, 0.0002))
    _feed(lr, rng, 600, (0.010, 1 / 4000, 0.0002))  # 4x slower (thermal throttling, a noisy neighbour)
    f = Features(0, 2000, 0)
    y = 0.010 + 2000 / 4000
    assert abs(lr.predict(f) - y) / y < 0.1


def test_ignores_non_positive_observations():
    lr = EngineLearner()
    before = list(lr.theta)
    lr.observe(Features(0, 100, 0), 0.0)
    lr.observe(Features(0, 100, 0), float("nan"))
    assert lr.theta == before and lr.samples == 0


def test_batch_refit_takes_over_once_the_window_holds_refit_min():
    rng = random.Random(5)
    par = (0.010, 1 / 16000, 0.0002)
    lr = EngineLearner()
    _feed(lr, rng, lr.params.refit_min - 1, par)
    assert lr.batch_theta is None  # too few observations: the recursive fit predicts
    _feed(lr, rng, 40, par)
    assert lr.batch_theta is not None
    f = Features(1000, 2000, 10)
    y = true_ttft(f, *par)
    assert abs(lr.predict(f) - y) / y < 0.05


def test_batch_refit_cost_follows_time_not_traffic():
    """Samples arriving faster than refit_min_interval_s (N replicas' samples through the peer bus) refit at
    most once per interval, or every 16 x refit_every samples; spread out, every refit_every samples as before."""
    par = (0.010, 1 / 16000, 0.0002)
    now = [0.0]
    fast = EngineLearner(clock=lambda: now[0])
    refits = [0]
    real = fast._refit

    def counting():
        refits[0] += 1
        return real()

    fast._refit = counting  # type: ignore[method-assign]
    rng = random.Random(3)
    for _ in range(1000):  # 1000 samples within 10 ms: the backstop every 64 only
        now[0] += 1e-5
        _feed(fast, rng, 1, par)
    first = (1000 - fast.params.refit_min) // fast.params.refit_every
    assert 1000 // 64 - 1 <= refits[0] <= 1000 // 64 + 2 < first
    slow = EngineLearner(clock=lambda: now[0])
    refits[0], real = 0, slow._refit
    slow._refit = counting  # type: ignore[method-assign]
    for _ in range(1000):  # one every 25 ms: the interval never binds
        now[0] += 0.025
        _feed(slow, rng, 1, par)
    assert refits[0] == (1000 - slow.params.refit_min) // slow.params.refit_every + 1
    f = Features(1000, 2000, 10)
    assert abs(fast.predict(f) - true_ttft(f, *par)) / true_ttft(f, *par) < 0.05  # still a good fit


def test_batch_refit_forgets_the_old_regime_once_it_left_the_window():
    rng = random.Random(6)
    lr = EngineLearner()
    _feed(lr, rng, 400, (0.010, 1 / 16000, 0.0002), noise=0.0)
    new = (0.020, 1 / 4000, 0.0005)
    _feed(lr, rng, lr.params.refit_window + lr.params.refit_every, new, noise=0.0)
    for _ in range(50):  # no path dependence left: exact on noise-free data of the new regime
        f = Features(rng.uniform(0, 4000), rng.uniform(10, 4000), rng.uniform(0, 40))
        y = true_ttft(f, *new)
        assert abs(lr.predict(f) - y) / y < 0.01


def test_batch_refit_keeps_coefficients_within_physical_bounds():
    rng = random.Random(7)
    lr = EngineLearner()
    for _ in range(200):  # decodes appear to *speed up* the engine: unphysical, the bound must hold
        f = Features(0, rng.uniform(100, 4000), rng.uniform(0, 40))
        lr.observe(f, max(0.002, 0.02 + f.uncached_tokens / 8000 - 0.002 * f.running))
    assert lr.batch_theta is not None
    assert all(t >= lo for t, lo in zip(lr.batch_theta, lr.params.lower))
    assert lr.batch_theta[2] == lr.params.lower[2]  # pinned at the bound, the rest refit around it


def test_batch_refit_can_be_switched_off():
    rng = random.Random(8)
    lr = EngineLearner(PredictorParams(refit_window=0))
    _feed(lr, rng, 100, (0.010, 1 / 16000, 0.0002))
    assert lr.batch_theta is None and lr.win_len == 0


# ---------------------------------------------------------------- degenerate-fit guard (issue 17a)

def _normal(rng: random.Random) -> Features:
    return Features(rng.choice([0, rng.uniform(0, 4000)]), rng.uniform(50, 3000), rng.uniform(0, 30))


def test_parameters_stay_in_physical_bounds_when_a_burst_is_flat_in_the_features():
    """A burst queued where the features cannot see it (TTFT ~3 s whatever the work) once fit an overhead of
    seconds and a prefill rate at 1e8 tokens/s; the box keeps both physical."""
    rng = random.Random(7)
    lr = EngineLearner()
    for _ in range(120):
        lr.observe(_normal(rng), 3.0 * (1 + rng.gauss(0, 0.05)))
    snap = lr.snapshot()
    p = lr.params
    assert snap["overhead_ms"] <= p.upper[0] * 1000
    assert snap["prefill_tokens_per_s"] <= 1000 / p.lower[1] <= 500_000
    th = lr.batch_theta if lr.batch_theta is not None else lr.theta
    assert all(lo <= t <= hi for t, lo, hi in zip(th, p.lower, p.upper))


def test_bounded_lstsq_pins_at_the_upper_bound_too():
    import numpy as np

    from gateway.routing.predictor import _bounded_lstsq

    A = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([5.0, 1.0, 6.0])  # free solution (5, 1)
    th = _bounded_lstsq(A, b, np.array([0.0, 0.0]), np.array([2.0, 10.0]))
    assert th[0] == 2.0 and 1.0 < th[1] < 10.0  # the second refit with the first pinned at its upper bound


def test_guard_resets_the_fit_when_out_of_sample_error_explodes_and_recovers_fast():
    rng = random.Random(5)
    par = (0.012, 1 / 16000, 0.0003)
    lr = EngineLearner()
    for _ in range(40):
        f = _normal(rng)
        lr.observe(f, true_ttft(f, *par) * (1 + rng.gauss(0, 0.03)))
    assert lr.resets == 0
    for _ in range(150):  # hidden queueing: ~3 s flat
        lr.observe(_normal(rng), 3.0 * (1 + rng.gauss(0, 0.05)))
    assert lr.resets >= 1 and lr.snapshot()["guard"]["resets"] == lr.resets
    th = lr.batch_theta if lr.batch_theta is not None else lr.theta  # the burst's fit: boxed, never 1e8 tok/s
    assert all(lo <= t <= hi for t, lo, hi in zip(th, lr.params.lower, lr.params.upper))
    errs = []
    for _ in range(20):  # the burst is over
        f = _normal(rng)
        errs.append(abs(lr.observe(f, true_ttft(f, *par))))
    assert sorted(errs[-10:])[5] < 0.1  # back to the engine's real speed within a few observations
    f = Features(0, 1500, 5)
    assert abs(lr.predict(f) / true_ttft(f, *par) - 1) < 0.1


def test_guard_does_not_fire_on_ordinary_noise_and_outliers():
    rng = random.Random(3)
    lr = EngineLearner()
    _feed(lr, rng, 600, (0.010, 1 / 16000, 0.0002), noise=0.1, outliers=0.05)
    assert lr.resets == 0


def test_mdare_and_calibration_are_reported_out_of_sample():
    rng = random.Random(4)
    par = (0.010, 1 / 16000, 0.0002)
    lr = EngineLearner()
    for _ in range(300):
        f = _normal(rng)
        up = lr.upper(f)
        lr.observe(f, true_ttft(f, *par) * (1 + rng.gauss(0, 0.05)), upper_s=up)
    snap = lr.snapshot()
    assert snap["mdare"] is not None and snap["mdare"] < 0.1
    assert snap["calibration_target"] == 0.9 and snap["calibration_n"] == 256
    assert 0.8 <= snap["calibration"] <= 1.0
    lr.observe(Features(0, 1000, 0), 10.0, upper_s=0.001)  # a miss lowers it
    assert lr.snapshot()["calibration"] < snap["calibration"] or snap["calibration"] == 0


def test_a_cold_engine_is_predicted_like_the_fleet_not_the_prior_and_learns_its_own():
    """Engines learned first must not look faster than a cold one just because the prior is conservative."""
    rng = random.Random(9)
    par = (0.008, 1 / 16000, 0.0002)
    p = Predictor()
    for name in ("a", "b"):
        for _ in range(60):
            f = _normal(rng)
            p.observe(name, f, true_ttft(f, *par))
    f = Features(0, 2000, 5)
    warm, cold = p.predict("a", f)[0], p.predict("new", f)[0]
    assert abs(cold / warm - 1) < 0.05  # the prior alone says ~0.28 s vs ~0.14 s
    own = p.learner("new").predict(f)  # the prior: admission promises nothing on borrowed parameters
    assert p.predict("new", f)[1] == max(cold, own) * (1 + p.params.cold_margin) > own
    fast = (0.004, 1 / 32000, 0.0001)  # the new engine is twice as fast: it learns that
    for _ in range(60):
        g = _normal(rng)
        p.observe("new", g, true_ttft(g, *fast))
    assert abs(p.predict("new", f)[0] / true_ttft(f, *fast) - 1) < 0.1
    assert p.fleet_theta() is not None and not p.learner("new").cold()


def test_the_upper_quantile_is_taken_over_the_most_recent_residuals_only():
    """The error's spread moves with the load: once the last quantile_window predictions were 50% short, the
    margin is 50%, however many accurate ones came before them."""
    lr = EngineLearner(PredictorParams(quantile=0.9, quantile_window=32, window=256))
    f = Features(ahead_tokens=0.0, uncached_tokens=1000.0, running=0.0)
    for _ in range(200):
        lr.observe(f, lr.predict(f))  # exact: residual 0
    assert lr.margin() == 0.0
    for _ in range(32):
        lr.observe(f, lr.predict(f) * 1.5)
    assert abs(lr.margin() - 0.5) < 1e-9
    assert len(lr.apes) == 232  # reporting keeps its own, longer window


def test_conformal_quantile_rank():
    from gateway.routing.predictor import conformal_quantile

    xs = [i / 100 for i in range(1, 20)]  # 19 residuals: rank ceil(0.9 * 20) = 18
    assert conformal_quantile(xs, 0.9) == 0.18
    assert conformal_quantile([-0.5, -0.2], 0.9) == 0.0  # never a bound under the mean
    assert conformal_quantile([0.1, 0.3], 0.99) == 0.3  # at most the largest


def test_the_upper_bound_of_a_queued_request_comes_from_queued_requests_residuals():
    """Requests with prefill queued ahead erred by 40%, those on an idle engine by 0: each gets its group's margin;
    a group with fewer than min_samples residuals falls back to all of them."""
    lr = EngineLearner(PredictorParams(quantile=0.9, quantile_window=64, min_samples=16))
    idle = Features(ahead_tokens=0.0, uncached_tokens=1000.0, running=0.0)
    busy = Features(ahead_tokens=2000.0, uncached_tokens=1000.0, running=0.0)
    for _ in range(40):
        lr.observe(idle, lr.predict(idle))
    assert lr.margin(busy) == 0.0  # no queued residuals yet: all of them
    for _ in range(20):
        lr.observe(busy, lr.predict(busy) * 1.4)
    assert abs(lr.margin(busy) - 0.4) < 1e-9
    assert lr.margin(idle) == 0.0
    assert lr.upper(busy) > lr.predict(busy) * 1.39


def test_a_multi_step_prefill_gets_the_margin_of_multi_step_prefills_not_of_one_step_ones():
    """One-step TTFTs err by where in the running step they arrive (here 60%), multi-step prefills by little (5%):
    pooled, the short ones' spread would set the long ones' margin (the live bench's bursts after its ladder:
    every admitted request under its bound). Each size gets its own; with too few, its queued group, then all."""
    lr = EngineLearner(PredictorParams(quantile=0.9, quantile_window=64, min_samples=16))
    lr.budget = 2048
    short = Features(ahead_tokens=0.0, uncached_tokens=100.0, running=0.0)
    long = Features(ahead_tokens=0.0, uncached_tokens=3000.0, running=0.0)
    long_queued = Features(ahead_tokens=500.0, uncached_tokens=3000.0, running=0.0)
    for _ in range(40):
        lr.observe(short, lr.predict(short) * 1.6)
    assert abs(lr.margin(long) - 0.6) < 1e-9  # no long residuals yet: the idle group's (all short)
    for _ in range(20):
        lr.observe(long, lr.predict(long) * 1.05)
    assert abs(lr.margin(long) - 0.05) < 1e-9
    assert abs(lr.margin(short) - 0.6) < 1e-9
    assert abs(lr.margin(long_queued) - 0.6) < 1e-9  # its own groups are empty: all residuals' quantile
    lr.budget = 4096  # a larger learned chunk budget: 3000 tokens are one step, judged with the short ones
    assert abs(lr.margin(long) - 0.6) < 1e-9
    lr.reset()
    assert all(len(d) == 0 for d in lr.residuals_by_size.values())


def test_the_fleet_median_is_taken_again_only_when_a_fit_moved():
    """fleet_theta is memoised on the engines' batch fits: the same answer while they hold, a new one once an
    engine refits, gets reset, or a new engine has a fit of its own."""
    rng = random.Random(5)
    p = Predictor(PredictorParams(refit_min_interval_s=0.0))  # a refit every refit_every observations
    assert p.fleet_theta() is None
    for name, par in (("a", (0.008, 1 / 16000, 0.0002)), ("b", (0.02, 1 / 8000, 0.0004))):
        for _ in range(40):
            f = _normal(rng)
            p.observe(name, f, true_ttft(f, *par))
    ft = p.fleet_theta()
    fresh = [statistics.median(col) for col in zip(*(lr.batch_theta for lr in p.engines.values()))]
    assert ft == fresh and p.fleet_theta() is ft  # not taken again while no fit moved
    p.learner("cold")  # a cold engine has no fit: the median stays (taken again: the engines changed)
    assert p.fleet_theta() == ft
    for _ in range(8):
        f = _normal(rng)
        p.observe("a", f, true_ttft(f, 0.05, 1 / 2000, 0.001))
    moved = [statistics.median(col) for col in zip(*(lr.batch_theta for lr in p.engines.values()
                                                      if lr.batch_theta is not None))]
    assert p.fleet_theta() == moved != ft
    for lr in p.engines.values():
        lr.reset()
    assert p.fleet_theta() == ([statistics.median(col) for col in zip(*(lr.batch_theta for lr in p.engines.values()
                                                                         if lr.batch_theta is not None))] or None)
