"""Issue 34, first do no harm: which upstreams the gateway has a model of (gateway/routing/mode.py), the
load-aware order of the others, and the harmful-hold check's healthy peak (gateway/routing/room.py)."""
from __future__ import annotations

import logging

from gateway.config import BackendConfig
from gateway.routing.config import ModelValidity
from gateway.routing.mode import ModeBook, Observed, decide_mode, load_order
from gateway.routing.plan import Candidate
from gateway.routing.plugin import EngineView, Scored
from gateway.routing.room import MIN_SAMPLES, Room, healthy_peak

V = ModelValidity(min_observations=16, max_mdare=0.5, exit_factor=1.25, telemetry_fresh_s=5.0)
LIVE = dict(telemetry=True, scrape_age_s=0.3, observations=40, mdare=0.2)


def test_partner_kinds_are_never_modelled_whatever_their_telemetry_says():
    for kind in ("openai", "anthropic"):
        m = decide_mode(Observed(kind, **LIVE), V)
        assert not m.modelled and f"kind {kind}" in m.reason


def test_an_engine_is_modelled_only_with_live_telemetry_and_a_valid_fit():
    assert decide_mode(Observed("vllm", **LIVE), V).modelled
    assert decide_mode(Observed("sim", **LIVE), V).modelled
    cases = {
        "no telemetry service": Observed("vllm", telemetry=False, scrape_age_s=0.1, observations=40, mdare=0.1),
        "no metrics scraped yet": Observed("vllm", telemetry=True, observations=40, mdare=0.1),
        "metrics scrape failing": Observed("vllm", telemetry=True, scrape_error="ConnectError: refused",
                                           observations=40, mdare=0.1),
        "metrics stale": Observed("vllm", telemetry=True, scrape_age_s=9.0, observations=40, mdare=0.1),
        "KV-event stream stale": Observed("vllm", telemetry=True, scrape_age_s=0.1, kv_stale=True,
                                          observations=40, mdare=0.1),
        "model not learned yet (3 of 16": Observed("vllm", telemetry=True, scrape_age_s=0.1, observations=3),
        "fit outside its band": Observed("vllm", telemetry=True, scrape_age_s=0.1, observations=40, mdare=0.7),
    }
    for why, obs in cases.items():
        m = decide_mode(obs, V)
        assert not m.modelled and why in m.reason, (why, m)


def test_the_band_has_hysteresis_so_a_fit_at_its_edge_does_not_flap():
    edge = Observed("vllm", telemetry=True, scrape_age_s=0.1, observations=40, mdare=0.55)
    assert not decide_mode(edge, V, was_modelled=False).modelled  # enters only inside max_mdare
    assert decide_mode(edge, V, was_modelled=True).modelled  # leaves only past max_mdare x exit_factor
    worse = Observed("vllm", telemetry=True, scrape_age_s=0.1, observations=40, mdare=0.7)
    assert not decide_mode(worse, V, was_modelled=True).modelled


def test_the_mode_book_says_each_change_of_state_once(caplog):
    seen = []
    book = ModeBook(on_change=lambda name, m: seen.append((name, m.modelled)))
    cold = Observed("sim", telemetry=True, scrape_age_s=0.1, observations=2)
    warm = Observed("sim", **LIVE)
    with caplog.at_level(logging.WARNING, logger="gateway.routing.mode"):
        for obs in (cold, cold, warm, warm, warm, cold):
            book.update("e0", obs, V)
    assert seen == [("e0", False), ("e0", True), ("e0", False)]
    assert book.changes == 2
    assert [r.getMessage() for r in caplog.records] == [
        "upstream e0 is now modelled: telemetry live, fit valid (40 observations, MdARE 0.20)",
        "upstream e0 is now pass_through: model not learned yet (2 of 16 observations)"]
    assert book.snapshot()["e0"]["mode"] == "pass_through"


def _cand(name: str, model: str = "m", cached: int = 0) -> Candidate:
    return Candidate(BackendConfig(name=name, url=f"http://127.0.0.1:9/{name}/v1", models=[model]), model,
                     cached_tokens=cached)


def test_pass_through_candidates_are_ordered_fewest_in_flight_then_most_cached_in_their_places():
    a, b, c, mod, fb = _cand("a"), _cand("b", cached=64), _cand("c", cached=512), _cand("mod"), _cand("fb", "m2")
    inflight = {"a": 3, "b": 1, "c": 1, "mod": 0, "fb": 0}
    items = [Scored(x, EngineView(inflight=inflight[x.backend.name])) for x in (a, b, c, mod, fb)]
    order = [a, mod, b, c, fb]  # the strategy's order; fb is the alias chain's fallback model
    load_order(order, {"mod"}, items)
    assert [x.backend.name for x in order] == ["c", "mod", "b", "a", "fb"]


def test_the_healthy_peak_is_the_most_in_flight_served_without_ttft_rising():
    flat = [(n, 0.2) for n in range(1, 65)]  # a partner: 200 ms whatever the load
    assert healthy_peak(flat) == 64
    rising = [(n, 0.1 if n <= 8 else 0.1 * n) for n in range(1, 33)]  # TTFT grows past 8 in flight
    assert healthy_peak(rising) == 8
    assert healthy_peak(flat[: MIN_SAMPLES - 1]) == 0  # too few samples: no claim of room
    # a lucky request at high load is no evidence: level medians decide
    lucky = rising + [(20, 0.1), (20, 2.5), (20, 2.4)]
    assert healthy_peak(lucky) == 8


def test_an_engine_never_seen_lightly_loaded_gives_no_evidence_of_room():
    """A slow engine that was always busy (its fastest TTFTs already under load) must not call its own load
    healthy: no baseline, no claim."""
    busy = [(n, 2.0 + 0.01 * n) for n in range(12, 30)]
    assert healthy_peak(busy) == 0


def test_room_forgets_samples_older_than_its_window():
    r = Room()
    for n in (1, 1, 2, 2, 3, 4, 5, 6, 8, 10):
        r.observe("e", 0.0, n, 0.2)
    assert r.peak("e", 1.0) == 10
    assert r.peak("e", 61.0 + 1.0) == 0
