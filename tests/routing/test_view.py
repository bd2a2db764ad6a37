"""engine_view: the shared pure view (stage + DES) drains in-flight prefill in budget-sized chunks."""
from __future__ import annotations

from gateway.routing.view import Drain, Scrape, engine_view

D = Drain(step_s=0.01, s_per_token=0.0001, budget=1000)  # a full chunk: 0.11 s


def test_drain_chunks_then_last_chunk() -> None:
    assert D.remaining(3000, 0.0) == 3000
    assert abs(D.remaining(3000, 0.11) - 2000) < 1e-6  # one full chunk
    assert abs(D.remaining(3000, 0.22) - 1000) < 1e-6
    assert D.remaining(3000, 0.33) == 0.0
    assert abs(D.remaining(500, 0.03) - 250) < 1e-6  # last chunk: 0.06 s for 500 tokens


def test_view_drains_own_work_since_dispatch_and_counts_decodes() -> None:
    fl = [(0.0, 3000, True), (0.05, 500, False), (0.2, 1000, True)]
    v = engine_view(fl, 0.2, D)
    assert v.inflight == 3 and v.running == 1 and v.prefilling_tokens == 4000
    assert 2150 < v.ahead_tokens < 2200  # 3000 queued at 0, ~1818 drained by 0.2, +1000 dispatched at 0.2
    old = engine_view(fl, 0.2, None)
    assert old.ahead_tokens == 4000  # without a drain model: the plain (overstated) sum


def test_scrape_is_aged_and_own_later_work_added() -> None:
    s = Scrape(running=7, waiting=4, kv_usage=0.5, age_s=0.11)  # 4 x 500 = 2000 tokens, 0.11 s ago
    v = engine_view([], 1.0, D, s, avg_uncached=500)
    assert v.running == 7 and abs(v.ahead_tokens - 1000) < 1e-6
    v2 = engine_view([(1.0, 300, True)], 1.0, D, s, avg_uncached=500)
    assert v2.ahead_tokens > 1000  # own dispatch after the scrape adds to the other replicas' queue
