"""BudgetService + BudgetStage: 429 codes and headers, evidence, stream allowance, settle with and without
usage, fail-closed 503 / fail-open local limits against an unreachable Redis, and recovery without restart."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.api.endpoints import BY_NAME
from gateway.budget.service import BudgetService
from gateway.budget.stage import BudgetStage
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import BudgetSpec, Decision, Principal, Usage

from .conftest import free_port, make_config

P = Principal(id="key:k1", kind="api_key", tenant="acme", team="search", project="web", key_id="k1")
PRICES = {"m1": {"input": 1.0, "cached_input": 0.5, "output": 4.0}}


class Clock:
    def __init__(self, t: float = 1_750_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ctx(rid: str, budgets, prompt=10, max_tokens=None, stream=True) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={}, body={}, model="m1", model_chain=("m1",),
                       stream=stream, max_tokens=max_tokens, prompt_tokens_est=prompt, principal=P,
                       decision=Decision(budgets=tuple(budgets)))
    return c


@pytest.fixture
async def svc_factory(tmp_path, prefix):
    made = []

    async def make(clock=None, **kw):
        kw.setdefault("prices", PRICES)
        kw.setdefault("key_prefix", prefix)
        kw.setdefault("sqlite_path", str(tmp_path / f"b{len(made)}.db"))
        kw.setdefault("spool_path", str(tmp_path / f"spool{len(made)}.jsonl"))
        s = BudgetService(make_config(tmp_path, **kw), clock=clock or Clock())
        await s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_rpm_429_with_openai_code_and_headers(svc_factory, store, request):
    kw = {"store": store}
    if store == "redis":
        kw["redis_url"] = request.getfixturevalue("redis_url")
    clock = Clock()
    stage = BudgetStage(await svc_factory(clock, **kw))
    b = [BudgetSpec(window="minute", scope="key", requests=2, tokens=10_000)]
    c1 = ctx("a", b, max_tokens=100)
    await stage.run(c1)
    assert c1.extra_headers["x-ratelimit-limit-requests"] == "2"
    assert c1.extra_headers["x-ratelimit-remaining-requests"] == "1"
    assert c1.extra_headers["x-ratelimit-limit-tokens"] == "10000"
    assert c1.extra_headers["x-ratelimit-remaining-tokens"] == str(10_000 - 110)
    assert c1.extra_headers["x-ratelimit-reset-requests"] == "1m0s"
    ev = c1.evidence["budget"]["limits"][0]
    assert ev["before"]["requests"] == 0 and ev["after"]["requests"] == 1 and ev["after"]["tokens"] == 110
    clock.t += 10.5
    await stage.run(ctx("b", b, max_tokens=100))
    with pytest.raises(GatewayError) as ei:
        await stage.run(ctx("c", b, max_tokens=100))
    e = ei.value
    assert e.status == 429 and e.code == "rate_limit_exceeded" and e.type == "rate_limit_error"
    assert e.headers["retry-after"] == "50" and e.headers["retry-after-ms"] == "49500"
    assert e.headers["x-ratelimit-remaining-requests"] == "0"


async def test_money_budget_is_insufficient_quota_and_reports_cost(svc_factory):
    clock = Clock()
    svc = await svc_factory(clock)
    stage = BudgetStage(svc)
    b = [BudgetSpec(window="month", scope="team", money=0.01, currency="EUR")]
    c = ctx("a", b, prompt=1000, max_tokens=1000)  # worst case 1000*1e-6 + 1000*4e-6 = 0.005
    await stage.run(c)
    c.usage = Usage(1000, 500, cached_tokens=400)
    c.backend = "b1"
    await stage.finish(c)
    cost = 600 * 1e-6 + 400 * 0.5e-6 + 500 * 4e-6
    assert c.evidence["cost"]["amount"] == pytest.approx(cost) and c.evidence["cost"]["currency"] == "EUR"
    await stage.run(ctx("b", b, prompt=1000, max_tokens=1000))  # 0.0028 + 0.005 <= 0.01
    with pytest.raises(GatewayError) as ei:
        await stage.run(ctx("c", b, prompt=1000, max_tokens=1000))
    assert ei.value.status == 429 and ei.value.code == "insufficient_quota"
    assert int(ei.value.headers["retry-after"]) > 0  # until the month resets
    assert svc.ledger.queue[0]["request_id"] == "a" and svc.ledger.queue[0]["cost"] == pytest.approx(cost)


async def test_uncapped_stream_gets_allowance_at_remaining_budget(svc_factory):
    stage = BudgetStage(await svc_factory(default_max_tokens=4096))
    b = [BudgetSpec(window="day", scope="tenant", tokens=1000)]
    c = ctx("a", b, prompt=100, max_tokens=None)
    await stage.run(c)
    assert c.completion_token_allowance == 900
    # delivered 250 then cut: settle what was delivered (no usage from the engine)
    c.backend = "b1"
    c.delivered_completion_tokens = 250
    c.cut_by_budget = True
    await stage.finish(c)
    c2 = ctx("b", b, prompt=100, max_tokens=None)
    await stage.run(c2)
    assert c2.completion_token_allowance == 1000 - 350 - 100
    with pytest.raises(GatewayError) as ei:  # 350 spent + 650 held: nothing left even for one token
        await stage.run(ctx("c", b, prompt=10, max_tokens=None))
    assert ei.value.code == "insufficient_quota"
    # capped requests above the remaining budget are refused, never cut
    with pytest.raises(GatewayError):
        await stage.run(ctx("d", b, prompt=10, max_tokens=200))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", [None, "max_completion_tokens"])
async def test_binding_allowance_is_sent_upstream_as_max_tokens(svc_factory, stream, field):
    """Issue 18: a JSON request without max_tokens and 49 tokens left generated 102: the allowance was only
    enforced by cutting streams. It is the request's max_tokens (or max_completion_tokens) upstream now."""
    from gateway.config import BackendConfig
    from gateway.proxy.forward import upstream_body
    from gateway.routing.plan import Candidate

    stage = BudgetStage(await svc_factory(default_max_tokens=4096))
    c = ctx("a", [BudgetSpec(window="day", scope="tenant", tokens=149)], prompt=100, max_tokens=None, stream=stream)
    c.body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}
    if field:
        c.body[field] = None  # the client names the field (null = no limit); the allowance goes into it
    await stage.run(c)
    assert c.completion_token_allowance == 49 and c.max_tokens == 49
    assert c.evidence["budget_max_tokens"] == {"requested": None, "set_max_tokens": 49,
                                               "reason": "remaining completion budget"}
    cand = Candidate(backend=BackendConfig(name="b1", url="http://b1/v1", models=["m1"]), model="m1")
    sent = orjson.loads(upstream_body(c, cand))
    assert sent[field or "max_tokens"] == 49
    if field:
        assert "max_tokens" not in sent


async def test_no_budgets_is_a_noop_and_unscoped_specs_are_ignored(svc_factory):
    stage = BudgetStage(await svc_factory())
    c = ctx("a", [])
    await stage.run(c)
    assert c.budget is None and c.extra_headers == {}
    c2 = ctx("b", [BudgetSpec(window="day", scope="partner", tokens=1)])  # P has no partner
    await stage.run(c2)
    assert c2.budget is None


async def test_fail_closed_503_then_recovers_without_restart(svc_factory, private_redis):
    clock = Clock()
    svc = await svc_factory(clock, store="redis", redis_url=private_redis.url, redis_retry_s=1.0)
    stage = BudgetStage(svc)
    b = [BudgetSpec(window="hour", scope="tenant", tokens=10_000)]
    c = ctx("a", b, max_tokens=10)
    await stage.run(c)
    private_redis.stop()
    c.usage = Usage(10, 5)
    c.backend = "x"
    await stage.finish(c)  # deferred settle, not lost
    assert len(svc._pending) == 1
    with pytest.raises(GatewayError) as ei:
        await stage.run(ctx("b", b, max_tokens=10))
    assert ei.value.status == 503 and ei.value.code == "budget_store_unavailable"
    assert "retry-after" in ei.value.headers
    private_redis.start()
    clock.t += 1.5
    for _ in range(40):  # the background retry loop replays deferred settles every redis_retry_s / 2
        if not svc._pending:
            break
        await asyncio.sleep(0.1)
    assert not svc._pending
    c3 = ctx("c", b, max_tokens=10)
    await stage.run(c3)  # recovered: Script reloads after NOSCRIPT on the fresh server
    assert c3.budget.store == "primary"
    ev = c3.evidence["budget"]["limits"][0]
    # AOF kept a's hold across the restart; the replayed settle replaced it with the actual 15 tokens
    assert ev["before"]["tokens"] == 15 and ev["before"]["requests"] == 1


async def test_settle_whose_reply_was_lost_is_replayed_once(svc_factory, redis_url):
    """Redis executes the settle, then the connection dies before the reply: the service defers it and its
    retry loop replays it; the counter holds the usage once (this double charge was seen in CI when Redis was
    stopped mid-run)."""
    from gateway.budget.store import StoreUnavailable

    clock = Clock()
    svc = await svc_factory(clock, store="redis", redis_url=redis_url, redis_retry_s=0.2)
    real = svc.primary.settle
    lost = []

    async def reply_lost(args):
        applied = await real(args)  # executed on the server...
        if not lost:
            lost.append(args.rid)
            raise StoreUnavailable("budget redis: ConnectionError: reply lost")  # ...answer never arrives
        return applied

    svc.primary.settle = reply_lost
    stage = BudgetStage(svc)
    b = [BudgetSpec(window="hour", scope="tenant", tokens=10_000)]
    c = ctx("a", b, max_tokens=10)
    await stage.run(c)
    c.usage, c.backend = Usage(10, 5), "x"
    await stage.finish(c)
    assert lost == ["a"] and len(svc._pending) == 1
    clock.t += 0.5
    for _ in range(50):
        if not svc._pending:
            break
        await asyncio.sleep(0.05)
    assert not svc._pending
    c2 = ctx("b", b, max_tokens=10)
    await stage.run(c2)
    assert c2.evidence["budget"]["limits"][0]["before"]["tokens"] == 15  # not 30


async def test_fail_open_uses_local_limits(svc_factory):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    svc = await svc_factory(store="redis", redis_url=dead, on_store_error="open", fail_open_fraction=0.5)
    stage = BudgetStage(svc)
    b = [BudgetSpec(window="minute", scope="key", requests=4)]
    ok = 0
    for i in range(4):
        try:
            c = ctx(f"r{i}", b, max_tokens=1)
            await stage.run(c)
            assert c.budget.store == "local"
            ok += 1
            c.usage, c.backend = Usage(1, 1), "x"
            await stage.finish(c)
        except GatewayError as e:
            assert e.status == 429
    assert ok == 2  # half of the limit per replica while Redis is down
    # local settles carry no idempotency marker: a long fail-open outage must not grow memory per request
    assert svc.local.state.done == {} and not svc._pending


async def test_completions_default_length_is_kept_when_within_the_allowance(svc_factory):
    """/v1/completions without max_tokens generates 16 tokens (the OpenAI/vLLM default): an allowance above that
    is not sent (it would lengthen the completion); one below it is."""
    stage = BudgetStage(await svc_factory(default_max_tokens=4096))
    b = [BudgetSpec(window="day", scope="tenant", tokens=1000)]
    c = ctx("a", b, prompt=100, max_tokens=None, stream=False)
    c.endpoint, c.ep = "completions", BY_NAME["completions"]  # ep is looked up at construction
    await stage.run(c)
    assert c.completion_token_allowance == 900 and c.max_tokens is None
    c2 = ctx("b", [BudgetSpec(window="day", scope="tenant", tokens=110)], prompt=100, max_tokens=None, stream=False)
    c2.endpoint, c2.ep = "completions", BY_NAME["completions"]  # ep is looked up at construction
    await BudgetStage(await svc_factory(default_max_tokens=4096)).run(c2)
    assert c2.max_tokens == 10
