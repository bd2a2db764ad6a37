"""The response-cache price (`budgets.prices.<model>.cache_hit`, docs/cache.md#price): its lookup and cost, and
BudgetStage.charge_answer: a free hit (the default) reserves, settles and files nothing; a priced hit is charged
over the same scopes and windows as any request, through the store (exact across replicas on Redis), and a hit
that does not fit is the same 429."""
from __future__ import annotations

import pytest

from gateway.budget.config import BudgetsConfig, ModelPrice
from gateway.budget.pricing import cost, find_price
from gateway.budget.service import BudgetService
from gateway.budget.stage import BudgetStage
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import BudgetSpec, Decision, Principal, Usage

from .conftest import make_config

P = Principal(id="key:k1", kind="api_key", tenant="acme", team="search", project="web", key_id="k1")
PRICES = {"m1": {"input": 1.0, "output": 4.0, "gpu_second": 0.01, "cache_hit": 0.5},
          "b1:m1": {"input": 2.0, "output": 8.0, "cache_hit": 9.0},
          "free": {"input": 1.0, "output": 4.0}}


def test_the_cache_price_defaults_to_zero():
    assert ModelPrice().cache_hit == 0.0
    assert BudgetsConfig(prices={"m": ModelPrice(input=1.0)}).prices["m"].cache_hit == 0.0


def test_find_price_for_a_hit_is_the_cache_rate_for_every_token_and_no_gpu_seconds():
    prices = {k: ModelPrice(**v) for k, v in PRICES.items()}
    p = find_price("m1", prices, cache_hit=True)
    assert p is not None and (p.input, p.cached_input, p.output, p.gpu_second) == (0.5, None, 0.5, None)
    # a hit has no backend: `backend:model` prices do not apply to it
    assert find_price("m1", prices, "b1", cache_hit=True) == p
    assert find_price("m1", prices, "b1").input == 2.0  # a normal request on b1 still gets its own price
    free = find_price("free", prices, cache_hit=True)
    assert free is not None and free.input == free.output == 0.0
    assert find_price("unpriced", prices, cache_hit=True) is None
    u = Usage(1000, 200, cached_tokens=600)
    assert cost("m1", u, prices, gpu_seconds=5.0, cache_hit=True) == pytest.approx(1200 * 0.5 / 1e6)
    assert cost("m1", u, prices, gpu_seconds=5.0) == pytest.approx((1000 * 1.0 + 200 * 4.0) / 1e6 + 0.05)


def _hit(rid: str, budgets, usage=Usage(1000, 200)) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={}, body={}, model="m1", model_chain=("m1",),
                       principal=P, decision=Decision(budgets=tuple(budgets)))
    c.usage = usage
    return c


@pytest.fixture
async def make(tmp_path, prefix):
    made = []

    async def build(**kw):
        kw.setdefault("prices", PRICES)
        kw.setdefault("key_prefix", prefix)
        kw.setdefault("sqlite_path", str(tmp_path / f"b{len(made)}.db"))
        kw.setdefault("spool_path", str(tmp_path / f"spool{len(made)}.jsonl"))
        s = BudgetService(make_config(tmp_path, **kw))
        await s.start()
        made.append(s)
        return s

    yield build
    for s in made:
        await s.close()


async def test_a_free_hit_reserves_settles_and_files_nothing(make):
    svc = await make(prices={"m1": {"input": 1.0, "output": 4.0}})
    stage = BudgetStage(svc)
    b = [BudgetSpec(window="day", scope="key", requests=1)]
    for rid in ("a", "b", "c"):  # a free hit uses no request budget
        c = _hit(rid, b)
        assert await stage.charge_answer(c, 0.003) == (0.0, 0.003)
        assert c.budget is None and "cost" not in c.evidence and "budget" not in c.evidence
        assert not c.extra_headers
    assert not svc.ledger.queue
    # no recorded cost: what it saved is the model's normal token price
    assert (await stage.charge_answer(_hit("d", b), None))[1] == pytest.approx((1000 * 1.0 + 200 * 4.0) / 1e6)


async def test_a_priced_hit_is_charged_and_a_hit_that_does_not_fit_is_a_429(make):
    svc = await make()
    stage = BudgetStage(svc)
    charge = 1200 * 0.5 / 1e6  # 0.0006
    b = [BudgetSpec(window="day", scope="team", money=0.001), BudgetSpec(window="day", scope="key", tokens=5000)]
    c = _hit("a", b)
    assert await stage.charge_answer(c, 0.002) == (pytest.approx(charge), pytest.approx(0.002 - charge))
    assert c.budget.settled and c.evidence["cost"]["amount"] == pytest.approx(charge)
    assert c.evidence["cost"]["priced_as"] == "cache_hit" and c.evidence["cost"]["gpu_seconds"] is None
    assert c.evidence["budget"]["reserved"]["tokens"] == 1200
    assert c.evidence["budget"]["settled"] == {"tokens": 1200, "money": pytest.approx(charge), "gpu_seconds": 0.0}
    assert c.extra_headers["x-ratelimit-remaining-tokens"] == str(5000 - 1200)
    (row,) = svc.ledger.queue
    assert row["request_id"] == "a" and row["cost_category"] == "cache_hit" and row["backend"] is None
    assert row["cost"] == pytest.approx(charge) and row["saved_tokens"] == 1200
    assert row["saved_cost"] == pytest.approx(0.002 - charge) and row["status"] == 200
    # 0.0006 spent of 0.001: a second such hit does not fit the team's money budget
    with pytest.raises(GatewayError) as ei:
        await stage.charge_answer(_hit("b", b), 0.002)
    assert ei.value.status == 429 and ei.value.code == "insufficient_quota"
    assert len(svc.ledger.queue) == 1
    # a smaller hit still fits (exactly its stored usage is reserved, not a worst case)
    small = _hit("c", b, Usage(300, 100))
    assert (await stage.charge_answer(small, None))[0] == pytest.approx(400 * 0.5 / 1e6)


async def test_a_hit_reserves_no_gpu_seconds(make):
    svc = await make()
    svc.set_gpu_estimator(lambda backends: (1.0, 1.0))  # a huge learned worst case: a request would not fit
    b = [BudgetSpec(window="day", scope="key", gpu_seconds=1.0)]
    c = _hit("a", b)
    charged, _ = await BudgetStage(svc).charge_answer(c, None)
    assert charged == pytest.approx(1200 * 0.5 / 1e6) and c.evidence["budget"]["reserved"]["gpu_seconds"] == 0


async def test_priced_hits_are_exact_across_replicas_on_redis(make, redis_url):
    a = BudgetStage(await make(store="redis", redis_url=redis_url))
    b = BudgetStage(await make(store="redis", redis_url=redis_url))
    spec = [BudgetSpec(window="day", scope="tenant", requests=3)]
    await a.charge_answer(_hit("r1", spec), None)
    await b.charge_answer(_hit("r2", spec), None)
    await a.charge_answer(_hit("r3", spec), None)
    with pytest.raises(GatewayError) as ei:
        await b.charge_answer(_hit("r4", spec), None)
    assert ei.value.status == 429
