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


def _reference_view(flights, now, drain, scrape=None, avg_uncached=512.0):
    """engine_view as it was written before `drained`: one Drain.remaining call per prefilling request."""
    n = decoding = 0
    raw = own = 0.0
    t_own = None
    t_scr = now - scrape.age_s if scrape is not None else now
    other = max(0.0, scrape.waiting * avg_uncached) if scrape is not None else 0.0
    t_other = t_scr
    for started, unc, prefilling in flights:
        n += 1
        if not prefilling:
            decoding += 1
            continue
        raw += unc
        if drain is not None:
            if t_own is not None:
                own = drain.remaining(own, started - t_own)
            t_own = started
            if scrape is not None and started > t_scr:
                other = drain.remaining(other, started - t_other) + unc
                t_other = started
        own += unc
    if drain is not None:
        if t_own is not None:
            own = drain.remaining(own, now - t_own)
        if scrape is not None:
            other = drain.remaining(other, now - t_other)
    ahead = max(own, other) if scrape is not None else own
    running = max(float(decoding), scrape.running) if scrape is not None else float(decoding)
    return n, int(raw), running, ahead


def test_view_is_the_per_request_drain_to_the_last_bit() -> None:
    """`drained` writes Drain.remaining out in its loop: the same floats as calling it once per request, over
    random queues (chunks above and below the budget, gaps that drain the queue empty, the same instant)."""
    import random
    rnd = random.Random(3)
    for _ in range(3000):
        d = Drain(rnd.choice([0.0, 0.004, 0.015]), rnd.choice([1e-5, 1.25e-4, 7e-4]), rnd.choice([0, 64, 512, 8192]))
        t, fl = 0.0, []
        for _ in range(rnd.randrange(0, 40)):
            t += rnd.choice([0.0, 0.001, 0.004, 0.03, 0.5])
            fl.append((t, rnd.choice([1, 9, 300, 4000, 20000]), rnd.random() < 0.8))
        now = t + rnd.choice([0.0, 0.002, 0.1, 2.0])
        s = rnd.choice([None, Scrape(rnd.randrange(9), rnd.randrange(5), 0.3, rnd.choice([0.0, 0.05, 0.5]))])
        for dr in (d, None):
            v = engine_view(fl, now, dr, s, 300.0)
            assert (v.inflight, v.prefilling_tokens, v.running, v.ahead_tokens) == _reference_view(fl, now, dr, s,
                                                                                                   300.0)
