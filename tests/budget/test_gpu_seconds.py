"""GPU-second budgets (issue 25): the reference model's new limit, the service's reservation with the learned
worst case (a fixed prefill part + a per-completion-token part, the completion allowance shrinking to what
fits), settle with the apportioned figure, headers/evidence/refusals, the policy field and its load-time check,
and the cost meter's learned worst case."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from gateway.budget.model import BudgetState, ReserveArgs, ScopePlan, SettleArgs
from gateway.budget.service import BudgetService
from gateway.budget.stage import BudgetStage
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import BudgetSpec, Decision, Principal, Usage

from .conftest import make_config, reserve_args, settle_args, window_plan

P = Principal(id="key:k1", kind="api_key", tenant="acme", team="search", project="web", key_id="k1")
T0 = 1_750_000_000.0
GPU_DAY = [BudgetSpec(window="day", scope="tenant", gpu_seconds=10.0)]


# ------------------------------------------------------------------------------------ BudgetState


def _args(rid: str, now: float, gpu_limit: int, prompt_gpu: int, per_token: int, maxc: int, minc: int) -> ReserveArgs:
    w = window_plan("lifetime", "t:acme:lifetime:all", False, gpu=gpu_limit)
    return reserve_args(rid, now, now + 60, 120, 100, 0, maxc, minc, 0,
                        (ScopePlan("tenant", "acme", "t:acme:hold", None, (w,)),),
                        fixed_gpu=prompt_gpu, gpu_per_token=per_token)


def _settle(rid: str, now: float, gpu: int) -> SettleArgs:
    w = window_plan("lifetime", "t:acme:lifetime:all", False)
    return settle_args(rid, now, 150, 0, (ScopePlan("tenant", "acme", "t:acme:hold", None, (w,)),), gpu=gpu)


def test_state_refuses_a_worst_case_that_does_not_fit():
    st = BudgetState()
    # 1 s limit; prefill worst case 0.4 s + 100 tokens x 0.01 s = 1.4 s: a capped request is refused whole
    out = st.reserve(_args("a", T0, 1_000_000, 400_000, 10_000, 100, 100))
    assert out[:5] == [0, 0, 1, 1, "gpu_seconds"]
    assert st.holds["t:acme:hold"] == {}  # nothing held, nothing counted
    assert st.fixed.get("t:acme:lifetime:all") is None


def test_state_shrinks_the_completion_allowance_to_what_fits():
    st = BudgetState()
    out = st.reserve(_args("a", T0, 1_000_000, 400_000, 10_000, 4096, 1))
    assert out[0] == 1 and out[1] == 60  # (1 - 0.4) / 0.01
    assert st.holds["t:acme:hold"]["a"] == (T0 + 60, 160, 0, 1_000_000)
    out = st.reserve(_args("b", T0, 1_000_000, 0, 10_000, 4096, 1))
    assert out[0] == 0 and out[4] == "gpu_seconds"  # the hold leaves no room for one more token


def test_state_settle_charges_the_apportioned_figure_not_the_hold():
    st = BudgetState()
    assert st.reserve(_args("a", T0, 1_000_000, 400_000, 10_000, 4096, 1))[0] == 1
    assert st.settle(_settle("a", T0 + 1, 123_456)) == 1
    assert st.fixed["t:acme:lifetime:all"] == [1, 150, 0, 123_456]
    assert st.holds["t:acme:hold"] == {}
    out = st.reserve(_args("b", T0 + 2, 1_000_000, 0, 10_000, 4096, 1))
    assert out[0] == 1 and out[1] == (1_000_000 - 123_456) // 10_000


# ------------------------------------------------------------------------------------ service + stage


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ctx(rid: str, budgets=GPU_DAY, prompt=1000, max_tokens=None) -> RequestContext:
    return RequestContext(request_id=rid, endpoint="chat", headers={}, body={}, model="m1", model_chain=("m1",),
                          stream=True, max_tokens=max_tokens, prompt_tokens_est=prompt, principal=P,
                          decision=Decision(budgets=tuple(budgets)))


@pytest.fixture
async def gpu_svc(tmp_path, prefix, request):
    store = getattr(request, "param", "memory")
    kw: dict = {"store": store, "key_prefix": prefix, "sqlite_path": str(tmp_path / "b.db"),
                "spool_path": str(tmp_path / "spool.jsonl"), "prices": {"m1": {"input": 1.0, "output": 2.0}}}
    if store == "redis":
        kw["redis_url"] = request.getfixturevalue("redis_url")
    svc = BudgetService(make_config(tmp_path, **kw), clock=Clock())
    seen: list[tuple[str, ...]] = []

    def estimate(backends: tuple[str, ...]) -> tuple[float, float]:
        seen.append(backends)
        return 0.002, 0.01  # 2 ms of GPU per prompt token, 10 ms per completion token

    svc.set_gpu_estimator(estimate)
    svc.estimates = seen  # type: ignore[attr-defined]
    await svc.start()
    yield svc
    await svc.close()


def served(c: RequestContext, gpu_s: float, usage=(1000, 50)) -> None:
    """What dispatch and the cost meter's close leave on the context for the budget stage's finish."""
    c.backend = "b1"
    c.usage = Usage(*usage)
    c.outcome.unit_cost = {"engine": "b1", "method": "apportioned", "gpu_seconds": gpu_s}


@pytest.mark.parametrize("gpu_svc", ["memory", "redis"], indirect=True)
async def test_reserve_with_the_learned_worst_case_then_settle_the_apportioned_figure(gpu_svc):
    stage = BudgetStage(gpu_svc)
    c = ctx("a")
    await stage.run(c)
    # 10 s: the prompt's prefill 1000 x 2 ms = 2 s is fixed, (10 - 2) / 0.01 = 800 completion tokens fit
    assert c.completion_token_allowance == 800
    ev = c.evidence["budget"]
    assert ev["reserved"]["gpu_seconds"] == pytest.approx(10.0)
    assert ev["gpu_worst_case"] == {"prompt_gpu_seconds": 2.0, "gpu_seconds_per_completion_token": 0.01}
    assert ev["limits"][0]["limit"]["gpu_seconds"] == 10.0
    assert ev["limits"][0]["before"]["gpu_seconds"] == 0 and ev["limits"][0]["after"]["gpu_seconds"] == 10.0
    assert c.extra_headers["x-ratelimit-limit-gpu-seconds"] == "10"
    assert c.extra_headers["x-ratelimit-remaining-gpu-seconds"] == "0"
    assert "x-ratelimit-reset-gpu-seconds" in c.extra_headers
    served(c, 3.25)
    await stage.finish(c)
    assert c.evidence["budget"]["settled"]["gpu_seconds"] == 3.25
    # 3.25 s settled: the next one gets (10 - 3.25 - 2) / 0.01 = 475 tokens
    c2 = ctx("b")
    await stage.run(c2)
    assert c2.completion_token_allowance == 475
    assert c2.evidence["budget"]["limits"][0]["before"]["gpu_seconds"] == pytest.approx(3.25)
    assert c2.extra_headers["x-ratelimit-remaining-gpu-seconds"] == "0"


async def test_gpu_seconds_refusal_is_insufficient_quota_on_a_calendar_window(gpu_svc):
    stage = BudgetStage(gpu_svc)
    c = ctx("a", max_tokens=100)
    await stage.run(c)
    served(c, 9.9)
    await stage.finish(c)
    with pytest.raises(GatewayError) as ei:
        await stage.run(ctx("b", prompt=100, max_tokens=None))  # 9.9 + 0.2 prefill > 10
    e = ei.value
    assert e.status == 429 and e.code == "insufficient_quota"
    assert "tenant gpu_seconds limit of 10 per day" in e.message
    assert e.extra["budget"] == {"kind": "gpu_seconds", "scope": "tenant", "window": "day"}
    assert e.headers["x-ratelimit-remaining-gpu-seconds"] == "0.1"
    assert int(e.headers["retry-after"]) > 0


async def test_requests_no_engine_of_ours_served_settle_zero_gpu_seconds(gpu_svc):
    stage = BudgetStage(gpu_svc)
    partner = ctx("p", max_tokens=10)
    await stage.run(partner)
    partner.backend = "opper"  # a partner route: the meter opens no span, no unit_cost
    partner.usage = Usage(1000, 10)
    await stage.finish(partner)
    failed = ctx("f", max_tokens=10)
    await stage.run(failed)  # reserved, then no engine took it (routing refused, connect failed)
    await stage.finish(failed)
    assert partner.evidence["budget"]["settled"]["gpu_seconds"] == 0
    assert failed.evidence["budget"]["settled"]["gpu_seconds"] == 0
    c = ctx("x", max_tokens=None)
    await stage.run(c)
    assert c.completion_token_allowance == 800  # nothing was charged: the whole 10 s is free again


async def test_the_estimate_covers_every_backend_serving_the_chain(tmp_path, prefix):
    cfg = make_config(tmp_path, key_prefix=prefix, sqlite_path=str(tmp_path / "b.db"),
                      spool_path=str(tmp_path / "s.jsonl"))
    svc = BudgetService(cfg, clock=Clock())
    svc._config = SimpleNamespace(raw=cfg.raw, models={"m1": ("e1", "e2"), "m2": ("e3",)},  # type: ignore
                                  resolve_path=cfg.resolve_path)
    asked: list[tuple[str, ...]] = []
    svc.set_gpu_estimator(lambda b: asked.append(b) or (0.0, 0.0))
    await svc.start()
    try:
        await svc.reserve("r", P, tuple(GPU_DAY), ("m1", "m2"), 10, 5)
        await svc.reserve("s", P, (BudgetSpec(window="day", scope="tenant", tokens=100),), ("m1",), 10, 5)
    finally:
        await svc.close()
    assert asked == [("e1", "e2", "e3")]  # and not asked at all without a GPU-second limit


async def test_a_gpu_second_limit_without_the_cost_meter_is_refused_not_unlimited(tmp_path, prefix):
    svc = BudgetService(make_config(tmp_path, key_prefix=prefix, sqlite_path=str(tmp_path / "b.db"),
                                    spool_path=str(tmp_path / "s.jsonl")), clock=Clock())
    await svc.start()
    try:
        with pytest.raises(GatewayError) as ei:
            await BudgetStage(svc).run(ctx("a"))
    finally:
        await svc.close()
    assert ei.value.status == 500 and ei.value.code == "budget_misconfigured"


# ------------------------------------------------------------------------------------ policy


def _policy_config(tmp_path, cost_enabled: bool, budget: dict):
    from gateway.config import parse_config

    (tmp_path / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "gpu", "match": {"tenant": "acme"}, "budgets": [budget]}]}))
    return parse_config(yaml.safe_dump({"policy": {"files": [str(tmp_path / "policy.yaml")]},
                                        "cost": {"enabled": cost_enabled}, "data_dir": str(tmp_path)}),
                        "gw.yaml", base_dir=tmp_path)


def test_policy_gpu_seconds_budget_compiles_to_the_spec(tmp_path):
    from gateway.policy.cli import load_for_config

    pol = load_for_config(_policy_config(tmp_path, True, {"window": "day", "scope": "tenant", "gpu_seconds": 3600}))
    (rule,) = pol.rules
    assert rule.budgets == (BudgetSpec(window="day", scope="tenant", rule_id="gpu", gpu_seconds=3600.0),)


def test_policy_gpu_seconds_budget_is_a_load_error_when_the_cost_meter_is_disabled(tmp_path):
    from gateway.config import ConfigError
    from gateway.wiring import check_config

    cfg = _policy_config(tmp_path, False, {"window": "day", "gpu_seconds": 3600})
    with pytest.raises(ConfigError, match="gpu_seconds needs the cost meter"):
        check_config(cfg)
    check_config(_policy_config(tmp_path, False, {"window": "day", "tokens": 3600}))  # other budgets load


@pytest.mark.parametrize("value", [0, -5, "lots"])
def test_policy_gpu_seconds_must_be_positive_number(tmp_path, value):
    from gateway.policy.compiler import PolicyError
    from gateway.policy.cli import load_for_config

    with pytest.raises(PolicyError):
        load_for_config(_policy_config(tmp_path, True, {"window": "day", "gpu_seconds": value}))
