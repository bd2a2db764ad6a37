"""What the route stage memoises to keep its per-request cost down must follow what it is memoised on: the
strategy (and its label) a config reload changes, the drain a learner's new step time changes."""
from __future__ import annotations

import yaml

from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.routing.admission import decide
from gateway.routing.predictor import Predictor
from gateway.routing.stage import PredictiveRouteStage
from gateway.types import Decision, Principal


def _cfg(strategy: str):
    return parse_config(yaml.safe_dump({
        "backends": [{"name": n, "kind": "openai", "url": f"http://127.0.0.1:9/{n}/v1", "models": ["m"],
                      "location": {"country": "DE"}, "retention": "zero"} for n in ("a", "b")],
        "routing": {"strategy": strategy}}))


def _ctx(i: int) -> RequestContext:
    c = RequestContext(request_id=f"r{i}", endpoint="chat", headers={},
                       body={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    c.model, c.model_chain, c.prompt_tokens_est = "m", ("m",), 10
    c.principal = Principal(id="k", kind="api_key", tenant="acme")
    c.decision = Decision(allow=True)
    return c


async def test_the_strategy_and_its_label_follow_a_config_reload():
    current = [_cfg("least_loaded")]
    st = PredictiveRouteStage(lambda: current[0], Health(current[0]))
    c = _ctx(1)
    await st.run(c)
    assert c.evidence["route"]["strategy"] == "least_loaded"
    assert st._strategy(current[0]).name == "least_loaded"
    current[0] = _cfg("round_robin")  # a reload: a new config object
    c = _ctx(2)
    await st.run(c)
    assert c.evidence["route"]["strategy"] == "round_robin"
    assert st._strategy(current[0]).name == "round_robin"
    rr = st._strategy(current[0])
    current[0] = _cfg("round_robin")  # the same strategy again: the built one (its counter) is kept
    assert st._strategy(current[0]) is rr


def test_the_drain_is_rebuilt_when_a_learned_value_or_the_budget_moves():
    p = Predictor()
    a = p.drain("e", 2048)
    assert p.drain("e", 2048) is a  # nothing moved: the same (frozen) value
    b = p.drain("e", 4096)
    assert b.budget == 4096 and b.step_s == a.step_s
    p.observe_step("e", 0.123)
    c = p.drain("e", 4096)
    lr = p.learner("e")
    assert (c.step_s, c.s_per_token, c.budget) == (lr.step(), lr.s_per_token(), 4096) and c.step_s != b.step_s


def test_an_unjudged_admission_is_the_same_answer_as_before():
    adm = decide(None, [], [], priority="standard", can_spill=False)
    assert (adm.action, adm.slo_ms, adm.best_ms, adm.best_upper_ms, adm.retry_after_s, adm.reason) == \
        ("admit", None, None, None, 0.0, "")
    adm = decide(500.0, [], [], priority="standard", can_spill=False)  # a target, nothing predicted
    assert (adm.action, adm.slo_ms) == ("admit", 500.0)
