"""bench/flow_control's pure helpers: the schedules replayed on every configuration and the per-kind numbers."""
from __future__ import annotations

import random

from bench import flow_control as fc


def test_poisson_rate_and_horizon() -> None:
    xs = fc.poisson(random.Random(3), 50.0, 20.0)
    assert xs == sorted(xs) and all(0 < x < 20.0 for x in xs)
    assert 850 < len(xs) < 1150
    assert fc.poisson(random.Random(3), 0.0, 5.0) == []


def test_longmix_schedule_is_seeded_and_short_only_keeps_the_short_arrivals() -> None:
    a, b = fc.longmix_schedule(20, 0.6, 7), fc.longmix_schedule(20, 0.6, 7)
    assert a == b
    longs = [x for x in a if fc.kind(x.rid) == "long"]
    shorts = [x for x in a if fc.kind(x.rid) == "short"]
    assert len(longs) + len(shorts) == len(a) and 0 < len(longs) < 0.12 * len(a)
    assert all(x.tokens == fc.LONG_TOKENS and x.slo == fc.LONG_SLO_MS for x in longs)
    assert all(fc.SHORT_TOKENS[0] <= x.tokens <= fc.SHORT_TOKENS[1] and x.slo == fc.SHORT_SLO_MS for x in shorts)
    assert len({x.rid for x in a}) == len(a)
    # rate: load x capacity for the mix's mean prompt
    rate = len(a) / 20
    assert 0.75 < rate / (0.6 * fc.cap_rps(int(fc.mix_mean()))) < 1.25
    assert fc.LONG_TOKENS + 64 < 16384  # + template + max_tokens under vllm-default's max_model_len


def test_tenants_schedule_rates_and_solo_is_the_same_a_stream() -> None:
    s = fc.tenants_schedule(10, 5)
    a = [x for x in s if fc.kind(x.rid) == "a"]
    b = [x for x in s if fc.kind(x.rid) == "b"]
    share = fc.fair_share_rps()
    assert 0.7 < len(a) / 10 / (fc.A_LOAD * share) < 1.3
    assert 0.85 < len(b) / 10 / (fc.B_LOAD * share) < 1.15
    assert {x.key for x in a} == {fc.KEY_A} and {x.key for x in b} == {fc.KEY_B}
    assert a == [x for x in fc.tenants_schedule(10, 5) if fc.kind(x.rid) == "a"]
    assert [x.at for x in s] == sorted(x.at for x in s)


def test_prompts_are_unique_and_stable() -> None:
    arr = fc.longmix_schedule(3, 0.6, 1)
    p1, p2 = fc.prompts_for(arr, 1), fc.prompts_for(arr, 1)
    assert p1 == p2 and len(set(p1.values())) == len(arr)
    assert all(abs(len(p1[x.rid].split()) - x.tokens) <= 3 for x in arr)


def test_stats_counts_goodput_refusals_and_errors() -> None:
    recs = [{"rid": "a-0", "status": 200, "ttft_ms": 100.0, "slo": 1000.0, "reject_ms": None},
            {"rid": "a-1", "status": 200, "ttft_ms": 1500.0, "slo": 1000.0, "reject_ms": None},
            {"rid": "a-2", "status": 429, "ttft_ms": None, "slo": 1000.0, "reject_ms": 4.0},
            {"rid": "a-3", "status": 502, "ttft_ms": None, "slo": 1000.0, "reject_ms": None},
            {"rid": "a-4", "status": -1, "ttft_ms": None, "slo": 1000.0, "reject_ms": None},
            {"rid": "b-0", "status": 200, "ttft_ms": 10.0, "slo": 1000.0, "reject_ms": None}]
    st = fc.stats(recs, "a", 2.0)
    assert (st["n"], st["ok"], st["met"], st["r429"], st["e5xx"], st["other"]) == (5, 2, 1, 1, 1, 1)
    assert st["goodput"] == 0.5 and st["served_rps"] == 1.0 and st["r429_p50"] == 4.0
    assert fc.ratio(None, 1.0) is None and fc.ratio(1.0, 0.0) is None and fc.ratio(3.0, 2.0) == 1.5
