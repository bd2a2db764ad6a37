"""The worst case a reservation holds: money at the highest price over every (backend, model) the request may
be charged at (`<backend>:<model>` prices included), GPU-second-priced models reserving the longest request
the backends allow, and holds that outlive the longest backend timeout (a slow request's hold must not lapse
while it runs). Settle keeps charging the price of the backend actually used."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.budget.service import REQUEST_SLACK_S, BudgetService
from gateway.budget.stage import BudgetStage
from gateway.config import ConfigError, parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import BudgetSpec, Decision, Principal, Usage
from gateway.completion import Step

P = Principal(id="key:k1", kind="api_key", tenant="acme", team="search", project="web", key_id="k1")
MONEY = [BudgetSpec(window="month", scope="team", money=1000.0, currency="EUR")]


class Clock:
    def __init__(self, t: float = 1_750_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def gw_config(tmp_path: Path, backends: dict[str, dict], aliases: dict[str, list[str]] | None = None,
              routing: dict | None = None, **budgets):
    """A config with backends {name: {"models": [...], "total_s": s}} and a `budgets:` section."""
    data = {
        "backends": [{"name": n, "url": f"http://127.0.0.1:9/{n}/v1", "models": b["models"],
                      **({"timeouts": {"total_s": b["total_s"]}} if "total_s" in b else {})}
                     for n, b in backends.items()],
        "aliases": [{"name": a, "targets": t} for a, t in (aliases or {}).items()],
        "routing": routing or {},
        "budgets": budgets,
        "data_dir": str(tmp_path),
    }
    return parse_config(yaml.safe_dump(data), "test.yaml", base_dir=tmp_path)


@pytest.fixture
async def make_svc(tmp_path, prefix):
    made = []

    async def make(backends, clock=None, aliases=None, routing=None, **budgets):
        budgets.setdefault("key_prefix", prefix)
        budgets.setdefault("sqlite_path", str(tmp_path / f"b{len(made)}.db"))
        budgets.setdefault("spool_path", str(tmp_path / f"spool{len(made)}.jsonl"))
        s = BudgetService(gw_config(tmp_path, backends, aliases, routing, **budgets), clock=clock or Clock())
        await s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


def store_kw(store: str, request) -> dict:
    return {"store": store, **({"redis_url": request.getfixturevalue("redis_url")} if store == "redis" else {})}


def ctx(rid: str, chain: tuple[str, ...], budgets=MONEY, prompt=1000, max_tokens=1000) -> RequestContext:
    return RequestContext(request_id=rid, endpoint="chat", headers={}, body={}, model=chain[0], model_chain=chain,
                          max_tokens=max_tokens, prompt_tokens_est=prompt, principal=P,
                          decision=Decision(budgets=tuple(budgets)))


async def reserved_money(svc: BudgetService, chain: tuple[str, ...], prompt=1000, max_tokens=1000) -> float:
    c = ctx("r-" + "-".join(chain), chain, prompt=prompt, max_tokens=max_tokens)
    await BudgetStage(svc).run(c)
    return c.evidence["budget"]["reserved"]["money"]


# ------------------------------------------------------------------------------------ per-backend prices


async def test_backend_only_price_is_reserved(make_svc):
    """docs/budgets.md's own example: `opper:gpt-x` is the only price of gpt-x. It used to reserve 0."""
    svc = await make_svc({"opper": {"models": ["gpt-x"]}}, fx_rates={"USD": 0.92},
                         prices={"opper:gpt-x": {"input": 2.5, "output": 10, "currency": "USD"}})
    expected = (1000 * 2.5 + 1000 * 10) * 0.92 / 1e6
    assert await reserved_money(svc, ("gpt-x",)) == pytest.approx(expected, rel=1e-3)  # nano-units round up


async def test_pricier_backend_override_sets_the_reservation_settle_charges_the_backend_used(make_svc):
    svc = await make_svc({"small": {"models": ["m"]}, "big": {"models": ["m"]}},
                         prices={"m": {"input": 1, "output": 4}, "big:m": {"input": 10, "output": 40}})
    stage = BudgetStage(svc)
    c = ctx("a", ("m",))
    await stage.run(c)
    assert c.evidence["budget"]["reserved"]["money"] == pytest.approx((1000 * 10 + 1000 * 40) / 1e6)
    c.usage, c.backend, c.backend_model = Usage(1000, 100), "small", "m"
    await stage.finish(c)
    assert c.evidence["cost"]["amount"] == pytest.approx((1000 * 1 + 100 * 4) / 1e6)  # small's (plain) price
    c2 = ctx("b", ("m",))
    await stage.run(c2)
    c2.usage, c2.backend, c2.backend_model = Usage(1000, 100), "big", "m"
    await stage.finish(c2)
    assert c2.evidence["cost"]["amount"] == pytest.approx((1000 * 10 + 100 * 40) / 1e6)  # big's override


async def test_chain_reserves_the_priciest_partner_it_may_spill_to(make_svc):
    """An alias chain m1 (own engine) -> m2 (own engine and a partner priced per backend): the reservation
    covers the partner's price even though the first choice is the cheap engine."""
    svc = await make_svc({"own": {"models": ["m1", "m2"]}, "partner": {"models": ["m2"]}},
                         aliases={"fast": ["m1", "m2"]},
                         prices={"m1": {"input": 1, "output": 2}, "m2": {"input": 1, "output": 3},
                                 "partner:m2": {"input": 3, "output": 30}})
    assert await reserved_money(svc, ("m1", "m2")) == pytest.approx((1000 * 3 + 1000 * 30) / 1e6)
    # a chain that cannot reach the partner is not charged for it
    assert await reserved_money(svc, ("m1",)) == pytest.approx((1000 * 1 + 1000 * 2) / 1e6)


async def test_unserved_model_falls_back_to_its_plain_price(make_svc):
    svc = await make_svc({}, prices={"m": {"input": 1, "output": 4}})
    assert await reserved_money(svc, ("m",)) == pytest.approx(5000 / 1e6)


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_money_limit_is_not_overshot_when_the_priciest_backend_serves_everything(make_svc, store, request):
    """The audit's failure: with the override ignored, a 0.10 EUR budget admitted 20 requests at the cheap
    worst case (0.005) that all landed on the pricier backend (0.05 each): 1.00 EUR settled. Now at most two
    are admitted at once and settled spend stays within the limit."""
    svc = await make_svc({"small": {"models": ["m"]}, "big": {"models": ["m"]}}, **store_kw(store, request),
                         prices={"m": {"input": 1, "output": 4}, "big:m": {"input": 10, "output": 40}})
    stage = BudgetStage(svc)
    limit = [BudgetSpec(window="month", scope="team", money=0.10, currency="EUR")]
    admitted, refused = [], 0
    for i in range(20):
        c = ctx(f"c{i}", ("m",), budgets=limit)
        try:
            await stage.run(c)
            admitted.append(c)
        except GatewayError as e:
            assert e.status == 429 and e.code == "insufficient_quota"
            refused += 1
    assert len(admitted) == 2 and refused == 18
    settled = 0.0
    for c in admitted:  # every admitted request spills to the pricier backend and uses its whole worst case
        c.usage, c.backend, c.backend_model = Usage(1000, 1000), "big", "m"
        await stage.finish(c)
        settled += c.evidence["cost"]["amount"]
    assert settled <= 0.10 + 1e-12


async def test_price_cache_follows_a_config_swap(make_svc, tmp_path):
    backends = {"a": {"models": ["m"]}}
    svc = await make_svc(backends, prices={"m": {"input": 1, "output": 4}})
    assert await reserved_money(svc, ("m",)) == pytest.approx(5000 / 1e6)
    svc.swap_config(gw_config(tmp_path, backends, key_prefix=svc.cfg.key_prefix, sqlite_path=svc.cfg.sqlite_path,
                              prices={"m": {"input": 1, "output": 4}, "a:m": {"input": 2, "output": 8}}))
    assert await reserved_money(svc, ("m",)) == pytest.approx(10_000 / 1e6)


# ------------------------------------------------------------------------------------ GPU-second prices


async def test_gpu_second_price_reserves_the_longest_request_of_the_serving_backends(make_svc):
    """reserve_gpu_seconds unset: the longest timeouts.total_s among the backends serving the chain + the
    routing queue wait + slack. It used to default to 0: GPU-priced requests reserved no money at all."""
    backends = {"gpu": {"models": ["sim"], "total_s": 100}, "slow": {"models": ["other"], "total_s": 1000}}
    svc = await make_svc(backends, routing={"batch_queue_timeout_s": 10},
                         prices={"sim": {"gpu_second": 0.001}, "other": {"input": 1}})
    assert svc.longest_request_s(["gpu"]) == 100 + 10 + REQUEST_SLACK_S
    # the slow backend does not serve sim, so it does not count
    assert await reserved_money(svc, ("sim",)) == pytest.approx((100 + 10 + REQUEST_SLACK_S) * 0.001)


async def test_explicit_reserve_gpu_seconds_wins(make_svc):
    svc = await make_svc({"gpu": {"models": ["sim"]}}, reserve_gpu_seconds=5,
                         prices={"sim": {"gpu_second": 0.001}, "gpu:sim": {"gpu_second": 0.002}})
    assert await reserved_money(svc, ("sim",)) == pytest.approx(5 * 0.002)  # the backend's own, pricier rate


async def test_gpu_second_settle_without_a_duration_charges_reserve_to_settle_wall_time(make_svc):
    """The wired gateway sets ctx.total_s only after the budget stage settled: the stage charges the wall time
    since the request arrived (it used to charge nothing) and records it in the evidence and the ledger."""
    clock = Clock()
    svc = await make_svc({"gpu": {"models": ["sim"]}}, clock=clock, prices={"sim": {"gpu_second": 0.001}})
    stage = BudgetStage(svc)
    c = ctx("g", ("sim",))
    await stage.run(c)
    c.received_at -= 12.5  # the request arrived 12.5 s ago
    c.usage, c.backend, c.backend_model = Usage(10, 5), "gpu", "sim"
    assert c.total_s is None
    await stage.finish(c)
    assert c.evidence["cost"]["amount"] == pytest.approx(12.5 * 0.001, rel=0.02)
    assert svc.ledger.queue[-1]["cost"] == pytest.approx(12.5 * 0.001, rel=0.02)
    assert svc.ledger.queue[-1]["gpu_seconds"] == pytest.approx(12.5, rel=0.02)
    # unreserved requests (no budget applies) are charged the same way
    c0 = ctx("g0", ("sim",), budgets=[])
    await stage.run(c0)
    c0.received_at -= 2.0
    c0.usage, c0.backend, c0.backend_model = Usage(10, 5), "gpu", "sim"
    await stage.finish(c0)
    assert svc.ledger.queue[-1]["gpu_seconds"] == pytest.approx(2.0, rel=0.05)
    assert svc.ledger.queue[-1]["cost"] == pytest.approx(0.002, rel=0.05)
    # a duration given by the caller is charged as given; a request no backend served is charged no GPU time
    c2 = ctx("h", ("sim",))
    await stage.run(c2)
    out = await svc.settle(c2.budget, Usage(10, 5), "sim", "gpu", gpu_seconds=3.0)
    assert out.cost == pytest.approx(0.003) and out.gpu_seconds == 3.0
    c3 = ctx("i", ("sim",))
    await stage.run(c3)
    clock.t += 5
    out = await svc.settle(c3.budget, Usage(0, 0), "sim", None)
    assert out.cost == 0.0 and out.gpu_seconds is None


# ------------------------------------------------------------------------------------ hold expiry


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_hold_outlives_the_longest_backend_timeout(make_svc, store, request):
    """Defaults: reservation_ttl_s 120 s, but a backend's total_s is 600 s. A request still running at 300 s
    must still hold its concurrency slot; once past the longest request (the crash bound) the hold lapses."""
    clock = Clock()
    svc = await make_svc({"a": {"models": ["m"]}}, clock=clock, **store_kw(store, request))
    assert svc.cfg.reservation_ttl_s == 120
    assert svc.hold_ttl_s == 600 + 30 + REQUEST_SLACK_S
    stage = BudgetStage(svc)
    one = [BudgetSpec(window="minute", scope="key", concurrency=1)]
    c = ctx("long", ("m",), budgets=one)
    await stage.run(c)
    assert c.budget.args.expires - c.budget.args.now == pytest.approx(svc.hold_ttl_s)
    clock.t += 300  # the long request is still streaming
    with pytest.raises(GatewayError) as ei:
        await stage.run(ctx("second", ("m",), budgets=one))
    assert ei.value.status == 429 and ei.value.code == "rate_limit_exceeded"
    clock.t += svc.hold_ttl_s - 300 + 1  # its replica died without settling: the hold lapses at the bound
    await stage.run(ctx("third", ("m",), budgets=one))


async def test_hold_ttl_keeps_a_longer_configured_value_and_follows_swaps(make_svc, tmp_path):
    svc = await make_svc({"a": {"models": ["m"], "total_s": 20}}, reservation_ttl_s=1000)
    assert svc.hold_ttl_s == 1000
    cfg = gw_config(tmp_path, {"a": {"models": ["m"], "total_s": 900}}, routing={"batch_queue_timeout_s": 5},
                    key_prefix=svc.cfg.key_prefix, sqlite_path=svc.cfg.sqlite_path)
    svc.swap_config(cfg)
    assert svc.hold_ttl_s == 900 + 5 + REQUEST_SLACK_S
    svc.swap_config(gw_config(tmp_path, {"a": {"models": ["m"], "total_s": 30}}))
    assert svc.hold_ttl_s == 120  # 30 + 30 + 60 = 120: the configured value already covers it


# ------------------------------------------------------------------------------------ config validation


@pytest.mark.parametrize("key,value", [("reserve_gpu_seconds", -1), ("reservation_ttl_s", 0)])
def test_nonsense_budget_durations_are_refused_at_load(tmp_path, key, value):
    text = yaml.safe_dump({"budgets": {key: value}})
    with pytest.raises(ConfigError) as ei:
        parse_config(text, "gw.yaml", base_dir=tmp_path)
    assert str(ei.value).startswith(f"gw.yaml:2: budgets.{key}: must be")
    parse_config(yaml.safe_dump({"budgets": {"reserve_gpu_seconds": 0}}), "gw.yaml", base_dir=tmp_path)


# ------------------------------------------------------------------------------------ wired gateway


async def test_wired_gateway_reserves_and_charges_gpu_seconds(tmp_path):
    """Through the real pipeline (ObserveStage sets ctx.total_s only after the budget settled): a GPU-second-
    priced model reserves the longest request's GPU time and is charged a positive GPU cost (it was 0 / 0)."""
    import asyncio

    import httpx

    from backends.sim.fleet import start_fleet
    from gateway.app import Gateway, build_app
    from gateway.wiring import wire

    key = "budget-gpu-key-0123456789"
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "defaults": {"allow": True}, "rules": [
        {"id": "money", "match": {"tenant": "acme"}, "budgets": [{"window": "day", "money": 100.0}]}]}))
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        engines = fleet.manifest()["engines"]
        cfg = {"server": {"host": "127.0.0.1", "port": 0},
               "backends": [{"name": e["name"], "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                             "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                             "location": {"country": "DE"}, "retention": "zero"} for e in engines],
               "keys": [{"name": "k", "key": key, "tenant": "acme"}],
               "policy": {"files": [str(tmp_path / "policy.yaml")], "audit_path": str(tmp_path / "audit.jsonl")},
               "identity": {"sqlite_path": str(tmp_path / "id.db")},
               "budgets": {"sqlite_path": str(tmp_path / "budgets.db"), "spool_path": str(tmp_path / "spool.jsonl"),
                           "prices": {"sim-model": {"gpu_second": 0.01}}},
               "data_dir": str(tmp_path)}
        gw = Gateway(parse_config(yaml.safe_dump(cfg), base_dir=tmp_path))
        wire(gw)
        app = build_app(gw)
        seen: list[dict] = []

        async def hook(c) -> None:
            seen.append({"cost": c.evidence.get("cost"), "budget": c.evidence.get("budget")})

        gw.pipeline = gw.pipeline.with_step(Step("probe", hook), after="access_log")
        await gw.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as cl:
                r = await cl.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                  json={"model": "sim-model", "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
            for _ in range(50):
                if seen:
                    break
                await asyncio.sleep(0.02)
        finally:
            await gw.close()
    assert seen, "the finish hook never ran"
    reserved = seen[0]["budget"]["reserved"]["money"]
    assert reserved == pytest.approx((600 + 30 + REQUEST_SLACK_S) * 0.01)
    assert 0 < seen[0]["cost"]["amount"] < reserved
