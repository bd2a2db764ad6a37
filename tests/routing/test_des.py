"""The discrete-event routing benchmark (bench/routing_des.py) as a regression test, in virtual time.

Bounds come from measured runs with a safety margin (seeds 1-4, 20 virtual s shared prefix: least_loaded p90
974-3603 ms vs ours 32-65 ms, i.e. 22-66x; 40 s multi-turn, seeds 1-2: ours' MAPE 11.8% over all engines, worst
engine with >= 50 samples 12.2%; overload at 36 req/s: 96-98% of admitted within 1000 ms; 40 s overload at
33.09 req/s, seed 1: per-engine MAPE 18-23% with the windowed batch refit, 34-87% with the recursive fit alone).
"""
from __future__ import annotations

import pytest

from bench import routing_des as des


def _p90(o: des.Outcome) -> float:
    return des.pct(o.ttft, 0.9)


@pytest.mark.parametrize("seed", [1, 2])
def test_ours_beats_least_loaded_p90_on_shared_prefix(seed: int) -> None:
    ll = des.simulate(des.shared_prefix(seed, 12.4, 20), "least_loaded", 5)
    ours = des.simulate(des.shared_prefix(seed, 12.4, 20), "predicted_ttft", 5)
    assert len(ours.ttft) == len(ll.ttft) > 150  # same arrivals, all served
    assert _p90(ours) * 8 < _p90(ll), (_p90(ours), _p90(ll))
    # the precise KV index (fed through encode -> decode_batch -> KVIndex.apply) is what concentrates prefixes
    assert ours.cached_tokens / ours.prompt_tokens > 0.85
    assert ours.cached_tokens / ours.prompt_tokens > ll.cached_tokens / ll.prompt_tokens + 0.15


def test_predictor_mape_bounded_on_steady_multi_turn() -> None:
    o = des.simulate(des.multi_turn(1, 1.5, 40), "predicted_ttft", 10)
    pairs = [x for v in o.pred.values() for x in v]
    assert len(pairs) > 200
    assert des.mape(pairs) < 0.16
    for eng, v in o.pred.items():
        if len(v) >= 50:
            assert des.mape(v) < 0.18, eng


def test_predictor_mape_bounded_per_engine_under_overload() -> None:
    o = des.simulate(des.unique_prompts(1, 33.09, 40, 1000.0), "predicted_ttft", 10)
    assert sum(len(v) for v in o.pred.values()) > 400
    for eng, v in o.pred.items():
        if len(v) >= 50:
            assert des.mape(v) < 0.30, (eng, des.mape(v))


def test_admission_keeps_admitted_within_target_under_overload() -> None:
    o = des.simulate(des.unique_prompts(1, 36.0, 15, 1000.0), "predicted_ttft", 4)
    assert o.rejected > 0 and o.admitted > 150
    assert o.met / o.admitted >= 0.93
    base = des.simulate(des.unique_prompts(1, 36.0, 15, 1000.0), "least_loaded", 4)
    assert base.rejected == 0 and base.met / base.admitted < 0.2  # no admission: the queue explodes
    assert o.met > 3 * base.met
