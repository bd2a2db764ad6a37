"""The cost meter's learned worst case of a request's GPU-seconds (what GPU-second budgets reserve with):
priors before anything is learned, the router's learned prefill cost and step, the apportioned decode time
per completion token of recent requests, x gpus, the largest over our engines, partner routes excluded."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from gateway.config import parse_config
from gateway.cost.meter import DECODE_MIN_TOKENS, PRIOR_S_PER_TOKEN, PRIOR_STEP_S, CostMeter
from gateway.pipeline import RequestContext
from gateway.types import Usage


def config(tmp_path):
    cfg = {"backends": [
        {"name": "e1", "url": "http://127.0.0.1:1/v1", "kind": "vllm", "models": ["m"]},
        {"name": "tp4", "url": "http://127.0.0.1:2/v1", "kind": "vllm", "models": ["m"]},
        {"name": "partner", "url": "http://127.0.0.1:3/v1", "kind": "openai", "operator": "partner",
         "models": ["m"]}],
        "cost": {"default": {"gpu_hour": 2.0}, "backends": {"tp4": {"gpu_hour": 8.0, "gpus": 4}}},
        "data_dir": str(tmp_path)}
    return parse_config(yaml.safe_dump(cfg), "gw.yaml", base_dir=tmp_path)


class Learner:
    def __init__(self, spt: float, step: float) -> None:
        self.spt, self.st = spt, step

    def s_per_token(self) -> float:
        return self.spt

    def step(self) -> float:
        return self.st


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_priors_before_anything_is_learned_times_gpus_partner_excluded(tmp_path):
    cfg = config(tmp_path)
    m = CostMeter(lambda: cfg)
    assert m.gpu_worst_case(("e1",)) == (PRIOR_S_PER_TOKEN, PRIOR_STEP_S)
    assert m.gpu_worst_case() == (PRIOR_S_PER_TOKEN * 4, PRIOR_STEP_S * 4)  # the whole fleet: tp4 is the worst
    assert m.gpu_worst_case(("partner",)) == (0.0, 0.0)  # token-priced, no GPU of ours
    assert m.gpu_worst_case(("e1", "partner")) == (PRIOR_S_PER_TOKEN, PRIOR_STEP_S)


def test_learned_prefill_cost_and_step_from_the_router(tmp_path):
    cfg = config(tmp_path)
    learners = {"e1": Learner(0.0004, 0.030), "tp4": Learner(0.0001, 0.005)}
    m = CostMeter(lambda: cfg, predictor=lambda: SimpleNamespace(learner=lambda e: learners[e]))
    assert m.gpu_worst_case(("e1",)) == pytest.approx((0.0004, 0.030))
    assert m.gpu_worst_case(("e1", "tp4")) == pytest.approx((0.0004, 0.030))  # largest of 0.0004 / 4 x 0.0001
    assert m.gpu_worst_case(("tp4",)) == pytest.approx((0.0004, 0.020))  # x 4 GPUs


def _served(m: CostMeter, clock: Clock, rid: str, seconds: float, completion: int) -> None:
    c = RequestContext(request_id=rid, endpoint="chat", headers={}, body={}, model="m", prompt_tokens_est=0)
    backend = m._config().backend("e1")  # the configured backend, as a route plan's candidate carries it
    c.route = SimpleNamespace(candidates=[SimpleNamespace(backend=backend, cached_tokens=0)])
    m.open(c)
    clock.t += seconds
    c.backend = "e1"
    c.usage = Usage(0, completion)
    m.close(c)


def test_apportioned_decode_per_completion_token_raises_the_worst_case(tmp_path):
    """A request alone on the engine for 2 s producing 40 tokens was apportioned 50 ms per token: above the
    15 ms step prior, so the worst case follows it; a short completion teaches nothing (its fixed costs)."""
    cfg = config(tmp_path)
    clock = Clock()
    m = CostMeter(lambda: cfg, clock=clock)
    _served(m, clock, "short", 5.0, DECODE_MIN_TOKENS - 1)
    assert m.gpu_worst_case(("e1",))[1] == PRIOR_STEP_S
    _served(m, clock, "long", 2.0, 40)
    assert m.gpu_worst_case(("e1",))[1] == pytest.approx(0.05)
    _served(m, clock, "fast", 0.4, 40)  # a faster one does not lower the worst of the recent window
    assert m.gpu_worst_case(("e1",))[1] == pytest.approx(0.05)
    for i in range(64):  # ... until the slow one left the window of the last 64
        _served(m, clock, f"f{i}", 0.4, 40)
    assert m.gpu_worst_case(("e1",))[1] == pytest.approx(PRIOR_STEP_S)  # 10 ms apportioned < the step prior


async def test_a_reload_cannot_switch_the_cost_meter_on(tmp_path):
    """The meter (stage, engine clocks, ledger) is assembled at startup only: a gateway started with
    `cost.enabled: false` refuses a reload that enables it (a GPU-second budget would then reserve with no
    meter behind it) and keeps serving the old snapshot; a reload that keeps it off is taken."""
    from gateway.app import Gateway
    from gateway.config import ConfigError, load_config
    from gateway.wiring import wire

    path = tmp_path / "gw.yaml"
    base = {"backends": [{"name": "e1", "url": "http://127.0.0.1:1/v1", "kind": "vllm", "models": ["m"]}],
            "keys": [{"name": "k", "key": "k-0123456789abcdef", "tenant": "t"}],
            "identity": {"sqlite_path": str(tmp_path / "id.db")},
            "budgets": {"sqlite_path": str(tmp_path / "b.db")},
            "policy": {"audit_path": str(tmp_path / "audit.jsonl")},
            "cost": {"enabled": False}, "data_dir": str(tmp_path)}
    path.write_text(yaml.safe_dump(base))
    gw = Gateway(load_config(path))
    wire(gw)
    assert gw.cost is None
    path.write_text(yaml.safe_dump({**base, "cost": {"enabled": True}}))
    with pytest.raises(ConfigError, match="needs a restart"):
        await gw.reload()
    assert gw.config.raw.cost.enabled is False and gw.config.generation == 0
    path.write_text(yaml.safe_dump({**base, "cost": {"enabled": False, "currency": "USD"}}))
    assert (await gw.reload()).raw.cost.currency == "USD"
