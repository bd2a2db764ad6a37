"""Admission decisions, the batch queue, plugin ordering and the cache salt rules."""
from __future__ import annotations

import asyncio
import re

import pytest

from gateway.config import BackendConfig
from gateway.routing.admission import BatchQueue, QueueFull, decide, slo_ms
from gateway.routing.plan import Candidate
from gateway.routing.approx import ApproxPrefixIndex, text_blocks
from gateway.routing.plugin import EngineView, Scored
from gateway.routing.registry import build_strategy
from gateway.pipeline import RequestContext
from gateway.routing.stage import _SALT_DEFAULT_SECRET, engine_cache_salt, tenant_cache_salt
from gateway.types import Decision, Principal


def test_slo_precedence():
    assert slo_ms("250", 1500, 2000) == 250
    assert slo_ms(None, 1500, 2000) == 1500
    assert slo_ms(None, None, 2000) == 2000
    assert slo_ms("garbage", None, None) is None
    assert slo_ms("-5", 900, None) == 900


def test_decide_admit_reject_spill_queue():
    a = decide(1000, [800, 1500], [600, 1200], priority="standard", can_spill=False)
    assert a.action == "admit"
    r = decide(1000, [1800, 2500], [1500, 2000], priority="standard", can_spill=False)
    assert r.action == "reject" and r.best_ms == 1500 and 0.7 < r.retry_after_s < 0.9
    assert decide(1000, [1800], [1500], priority="standard", can_spill=True).action == "spill"
    # batch is held to half the target: it queues while realtime at the same load is still admitted
    assert decide(1000, [700], [500], priority="batch", can_spill=False).action == "queue"
    assert decide(1000, [700], [500], priority="realtime", can_spill=False).action == "admit"
    assert decide(None, [99999], [99999], priority="standard", can_spill=False).action == "admit"


async def test_batch_queue_bounded_and_woken():
    q = BatchQueue(2)
    t1 = asyncio.create_task(q.wait(5))
    t2 = asyncio.create_task(q.wait(5))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await q.wait(5)
    assert q.shed == 1 and len(q) == 2
    q.wake(1)
    assert await t1 is True
    assert not t2.done()
    assert await q.wait(0.01) is False  # timed out
    q.wake(5)
    assert await t2 is True and len(q) == 0


def _items(preds, loads, aff=None):
    out = []
    for i, (p, l) in enumerate(zip(preds, loads)):
        c = Candidate(BackendConfig(name=f"e{i}", url="http://x/v1"), "m", predicted_ttft_ms=p)
        out.append(Scored(c, EngineView(inflight=l, affinity=(aff == i))))
    return out


def test_predicted_picker_lowest_then_load_then_affinity():
    s = build_strategy("predicted_ttft", affinity_slack_ms=15, affinity_rel=0.1)
    order, _ = s.run(_items([300, 100, 100], [0, 5, 1]), 100)
    assert [x.cand.backend.name for x in order] == ["e2", "e1", "e0"]  # tie on 100 ms broken by load
    order, _ = build_strategy("predicted_ttft").run(_items([100, 108, 400], [0, 0, 0], aff=1), 100)
    assert order[0].cand.backend.name == "e1"  # affinity costs 8 ms: honoured
    order, _ = build_strategy("predicted_ttft").run(_items([100, 300, 400], [0, 0, 0], aff=1), 100)
    assert order[0].cand.backend.name == "e0"  # affinity would cost 200 ms: ignored


def test_least_loaded_and_round_robin_and_capacity_filter():
    order, _ = build_strategy("least_loaded").run(_items([1, 1, 1], [3, 0, 2]), 10)
    assert [x.cand.backend.name for x in order] == ["e1", "e2", "e0"]
    rr = build_strategy("round_robin")
    firsts = [rr.run(_items([1, 1, 1], [0, 0, 0]), 10)[0][0].cand.backend.name for _ in range(3)]
    assert firsts == ["e0", "e1", "e2"]
    small = Candidate(BackendConfig(name="small", url="http://x/v1", context_window=512), "m", predicted_ttft_ms=1)
    kept, dropped = build_strategy("predicted_ttft").run([Scored(small, EngineView())], 600)
    assert not kept and dropped[0][1] == "capacity"


def test_prefix_hash_router_prefers_longest_match():
    idx = ApproxPrefixIndex()
    sys_prompt = "You are a careful assistant. " * 100
    idx.insert("e1", text_blocks(sys_prompt + "question one"))
    q = text_blocks(sys_prompt + "question two")
    assert idx.match("e1", q) >= len(q) - 1 and idx.match("e0", q) == 0
    items = _items([1, 1], [0, 9])
    items[1].view.approx_match = idx.match("e1", q) / len(q)
    order, _ = build_strategy("prefix_hash").run(items, 10)
    assert order[0].cand.backend.name == "e1"


def test_cache_salt_is_valid_for_vllm_and_per_tenant():
    a = tenant_cache_salt("acme", "s")
    b = tenant_cache_salt("globex", "s")
    assert a != b and a == tenant_cache_salt("acme", "s") and a != tenant_cache_salt("acme", "other")
    for s in (a, b, tenant_cache_salt("a/b@c\\d\x00", "s")):
        assert 0 < len(s) <= 128 and not re.search(r"[@/\\\x00]", s) and "acme" not in s


def _salt_ctx(tenant: str, client_salt: str | None = None, isolate: bool = False) -> RequestContext:
    body = {"model": "m", "messages": []} if client_salt is None else {"model": "m", "cache_salt": client_salt}
    c = RequestContext(request_id="r", endpoint="chat", headers={}, body=body)
    c.principal = Principal(id=f"key:{tenant}", kind="api_key", tenant=tenant)
    c.decision = Decision(allow=True, cache_isolation=isolate)
    return c


def test_engine_cache_salt_namespaces_a_client_salt_by_tenant():
    """A client's own cache_salt never reaches the engine as sent: tenants choosing the same string do not
    share a cache, and a tenant presenting another tenant's isolation salt (computable when no secret is
    configured) does not get that tenant's cache; one tenant's requests with one salt still share."""
    assert engine_cache_salt(_salt_ctx("acme"), None) is None  # no isolation, no client salt: shared cache
    mine = engine_cache_salt(_salt_ctx("acme", "s1"), None)
    assert mine == engine_cache_salt(_salt_ctx("acme", "s1"), None) != "s1"
    assert mine != engine_cache_salt(_salt_ctx("globex", "s1"), None)
    assert mine != engine_cache_salt(_salt_ctx("acme", "s2"), None)
    victim = engine_cache_salt(_salt_ctx("globex", isolate=True), None)
    assert victim == tenant_cache_salt("globex", _SALT_DEFAULT_SECRET)
    assert engine_cache_salt(_salt_ctx("acme", victim), None) != victim  # forged salt: not the victim's cache
    assert engine_cache_salt(_salt_ctx("acme", victim, isolate=True), None) != victim
    iso_client = engine_cache_salt(_salt_ctx("acme", "s1", isolate=True), None)
    assert iso_client not in (mine, engine_cache_salt(_salt_ctx("acme", isolate=True), None))
    for s in (mine, victim, iso_client, engine_cache_salt(_salt_ctx("a", "x" * 5000 + "/@\\"), None)):
        assert 0 < len(s) <= 128 and not re.search(r"[@/\\\x00]", s)


def test_engine_cache_salt_uses_the_configured_secret(monkeypatch):
    monkeypatch.setenv("GW_SALT_SECRET", "k1")
    a = engine_cache_salt(_salt_ctx("acme", isolate=True), "GW_SALT_SECRET")
    monkeypatch.setenv("GW_SALT_SECRET", "k2")
    assert a != engine_cache_salt(_salt_ctx("acme", isolate=True), "GW_SALT_SECRET")
    assert a == tenant_cache_salt("acme", "k1")


def test_target_fit_puts_a_loose_target_on_the_engine_with_least_slack_and_keeps_fast_ones_free():
    from gateway.routing.scorers.target_fit import target_fit_score

    # engines predicted (upper) at 100, 700 and 1500 ms
    loose = [target_fit_score(m, u, 2500.0) for m, u in ((80, 100), (600, 700), (1300, 1500))]
    assert min(range(3), key=loose.__getitem__) == 2  # 1500 <= 0.8 x 2500 with the least slack
    tight = [target_fit_score(m, u, 600.0) for m, u in ((80, 100), (600, 700), (1300, 1500))]
    assert min(range(3), key=tight.__getitem__) == 0  # only the fast engine meets 0.8 x 600
    over = [target_fit_score(m, u, 50.0) for m, u in ((80, 100), (600, 700))]
    assert over[0] < over[1] and over[0] > 1e6  # none meets it: by upper prediction, after any that would
    assert target_fit_score(80, 100, None) == 80 and target_fit_score(None, None, 100) == 1e12


def test_target_fit_is_a_registered_strategy_and_off_by_default():
    from gateway.routing.config import RoutingConfig
    from gateway.routing.registry import PRESETS

    assert "target_fit" in PRESETS and build_strategy("target_fit").scorers[0].name == "target_fit"
    assert RoutingConfig().target_fit is False
