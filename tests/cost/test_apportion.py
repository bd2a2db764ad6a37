"""The pure apportioning arithmetic (gateway/cost/apportion.py) and the unit-cost model (gateway/cost/model.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cost.apportion import EngineClock, Span, apportion, union_length
from gateway.cost.config import BackendCost, CostConfig
from gateway.cost.model import (
    Outcome,
    backend_cost,
    category,
    gpu_cost,
    savings_and_waste,
    token_cost,
)

spans_st = st.lists(
    st.tuples(st.floats(0, 100, allow_nan=False), st.floats(0, 20, allow_nan=False),
              st.floats(0, 5, allow_nan=False)),
    min_size=1, max_size=40,
).map(lambda xs: [Span(f"r{i}", s, s + d, p) for i, (s, d, p) in enumerate(xs)])


@settings(max_examples=300, deadline=None)
@given(spans_st)
def test_charges_sum_to_the_busy_time_and_the_busy_time_is_the_union_of_spans(spans):
    out = apportion(spans)
    assert out.busy_s == pytest.approx(union_length((s.start, s.end) for s in spans), abs=1e-6)
    assert out.total_s == pytest.approx(out.busy_s, rel=1e-9, abs=1e-6)
    for s in spans:
        c = out.charges[s.rid]
        assert c.seconds >= -1e-12 and c.prefill_s >= 0 and c.shared_s >= -1e-12
        assert c.prefill_s <= s.prefill_s + 1e-9  # never charged more prefill than it owed
        assert c.seconds <= (s.end - s.start) + 1e-9  # never more than the time it was on the engine


@settings(max_examples=200, deadline=None)
@given(spans_st)
def test_without_prefill_every_instant_is_shared_equally(spans):
    spans = [Span(s.rid, s.start, s.end, 0.0) for s in spans]
    out = apportion(spans)
    # brute force: integrate 1/n(t) over each span on a fine grid of the event times
    ts = sorted({s.start for s in spans} | {s.end for s in spans})
    want = {s.rid: 0.0 for s in spans}
    for a, b in zip(ts, ts[1:]):
        on = [s for s in spans if s.start <= a and s.end >= b]
        for s in on:
            want[s.rid] += (b - a) / len(on)
    for s in spans:
        assert out.charges[s.rid].seconds == pytest.approx(want[s.rid], abs=1e-6)


def test_prefill_goes_to_whoever_sent_the_tokens_then_the_rest_is_shared():
    # two requests on the engine for 10 s; A owes 4 s of prefill, B none: A 4 + 3, B 3
    out = apportion([Span("a", 0, 10, 4.0), Span("b", 0, 10, 0.0)])
    assert out.charges["a"].seconds == pytest.approx(7.0)
    assert out.charges["a"].prefill_s == pytest.approx(4.0)
    assert out.charges["b"].seconds == pytest.approx(3.0)
    # prefill owed beyond the time it was there is forgiven (an estimate too high, a cut request)
    out = apportion([Span("a", 0, 1, 4.0)])
    assert out.charges["a"].seconds == pytest.approx(1.0) and out.charges["a"].prefill_s == pytest.approx(1.0)


def test_a_charge_is_final_when_the_request_ends_even_with_others_in_flight():
    c = EngineClock()
    a = c.begin(0.0)
    b = c.begin(0.0)
    ca = c.end(4.0, a)  # b still running
    assert ca.seconds == pytest.approx(2.0)
    cb = c.end(10.0, b)
    assert cb.seconds == pytest.approx(8.0)
    assert c.charged_s == pytest.approx(c.busy_s) == pytest.approx(10.0)
    # idle time is nobody's
    d = c.begin(20.0)
    assert c.end(21.0, d).seconds == pytest.approx(1.0)
    assert c.busy_s == pytest.approx(11.0)


class _PerDebtClock:
    """The apportioning rule written out per debt (every open request's owed prefill paid in proportion to what
    it owes, O(requests in flight) per event): the reference EngineClock's O(1) factor form must match."""

    def __init__(self) -> None:
        self.n, self.v, self.t = 0, 0.0, None
        self.owed: dict[int, float] = {}
        self.paid: dict[int, float] = {}
        self.marks: dict[int, float] = {}

    def advance(self, now: float) -> None:
        if self.t is not None and now > self.t and self.n > 0:
            dt = now - self.t
            owed = sum(self.owed.values())
            dp = min(dt, owed)
            if dp > 0:
                for k, o in self.owed.items():
                    self.paid[k] += o * dp / owed
                    self.owed[k] = o - o * dp / owed
            self.v += (dt - dp) / self.n
        if self.t is None or now > self.t:
            self.t = now

    def begin(self, now: float, k: int, prefill: float) -> None:
        self.advance(now)
        self.n += 1
        self.owed[k], self.paid[k], self.marks[k] = prefill, 0.0, self.v

    def end(self, now: float, k: int) -> tuple[float, float]:
        self.advance(now)
        self.n -= 1
        self.owed.pop(k)
        return self.paid.pop(k), self.v - self.marks.pop(k)


# a schedule: at each step either a new request begins (with its prefill) or the i-th open one ends
events_st = st.lists(st.tuples(st.floats(0, 0.5, allow_nan=False), st.booleans(), st.integers(0, 50),
                               st.floats(0, 3, allow_nan=False)), min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(events_st)
def test_the_o1_clock_charges_what_the_per_debt_rule_charges(events):
    clock, ref = EngineClock(), _PerDebtClock()
    t = 0.0
    open_: list[tuple[int, int]] = []  # (reference key, clock token)
    for i, (gap, begin, pick, prefill) in enumerate(events):
        t += gap
        if begin or not open_:
            open_.append((i, clock.begin(t, prefill)))
            ref.begin(t, i, prefill)
        else:
            k, tok = open_.pop(pick % len(open_))
            c = clock.end(t, tok)
            paid, shared = ref.end(t, k)
            assert c.prefill_s == pytest.approx(paid, rel=1e-6, abs=1e-9)
            assert c.shared_s == pytest.approx(shared, rel=1e-6, abs=1e-9)
    assert clock.owed_s == pytest.approx(sum(ref.owed.values()), rel=1e-6, abs=1e-9)


def test_the_clock_renormalises_before_its_factor_underflows():
    """Each step pays 90% of what is owed (the common factor shrinks 10x) and a new debt begins: after 60
    steps the factor would be 1e-60; the clock renormalises and debts and charges stay those of the rule."""
    clock, ref = EngineClock(), _PerDebtClock()
    t = 0.0
    toks = {0: clock.begin(t, 1.0)}
    ref.begin(t, 0, 1.0)
    for i in range(1, 60):
        t += 0.9 * sum(ref.owed.values())
        toks[i] = clock.begin(t, 1.0)
        ref.begin(t, i, 1.0)
        if i % 7 == 0:  # some end along the way
            k = min(toks)
            c = clock.end(t, toks.pop(k))
            paid, shared = ref.end(t, k)
            assert c.prefill_s == pytest.approx(paid, rel=1e-6, abs=1e-9)
            assert c.shared_s == pytest.approx(shared, rel=1e-6, abs=1e-9)
    assert clock._s > 1e-30  # renormalised (0.1 ** 59 otherwise)
    assert clock.owed_s == pytest.approx(sum(ref.owed.values()), rel=1e-6)
    t += 5.0
    for k in sorted(toks):
        c = clock.end(t, toks[k])
        paid, shared = ref.end(t, k)
        assert c.prefill_s == pytest.approx(paid, rel=1e-6, abs=1e-9)
        assert c.shared_s == pytest.approx(shared, rel=1e-6, abs=1e-9)
    assert clock.charged_s == pytest.approx(clock.busy_s, rel=1e-9)


def test_category_and_savings():
    base = dict(dispatched=True, status=200, cache_hit=False, batch=False, cut=False, retries=0)
    assert category(Outcome(**base)) == "served"
    assert category(Outcome(**{**base, "batch": True})) == "batch"
    assert category(Outcome(**{**base, "status": 499})) == "aborted"
    assert category(Outcome(**{**base, "cut": True})) == "cut"
    assert category(Outcome(**{**base, "status": 502})) == "error"
    assert category(Outcome(**{**base, "dispatched": False, "status": 429})) == "rejected"
    assert category(Outcome(**{**base, "dispatched": False, "cache_hit": True})) == "cache_hit"
    saved, wasted = savings_and_waste("aborted", 2.0, 0.5, None)
    assert saved == {"prefix_cache": 0.5} and wasted == {"aborted": 2.0}
    saved, wasted = savings_and_waste("cache_hit", 0.0, 0.0, 1.5)
    assert saved == {"response_cache": 1.5} and wasted == {}


def test_prices():
    cfg = CostConfig(default=BackendCost(gpu_hour=3.6), backends={"opper": BackendCost(input=1.0, output=4.0),
                                                                   "usd": BackendCost(gpu_hour=3.6, currency="USD")})
    assert gpu_cost(10.0, backend_cost(cfg, "gpu-1"), "EUR", {}) == pytest.approx(0.01)
    assert gpu_cost(10.0, backend_cost(cfg, "usd"), "EUR", {"USD": 0.5}) == pytest.approx(0.005)
    assert gpu_cost(10.0, backend_cost(cfg, "opper"), "EUR", {}) is None
    assert token_cost(1000, 400, 100, backend_cost(cfg, "opper"), "EUR", {}) == pytest.approx((1000 + 400) / 1e6)
    assert token_cost(1000, 0, 0, backend_cost(cfg, "gpu-1"), "EUR", {}) is None
