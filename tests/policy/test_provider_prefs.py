"""The decide stage itself applies the request's provider preferences, so any stage wired after it (the
response cache, budgets, routing) only ever sees the tightened decision, whatever order they are inserted in."""
from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.policy.compiler import compile_text
from gateway.policy.stage import PolicyStage
from gateway.types import Principal

POL = compile_text("rules:\n  - id: eea\n    match: {tenant: eu}\n    require: {jurisdiction: EEA, retention: zero}\n")


def ctx(tenant: str, **body) -> RequestContext:
    c = RequestContext(request_id="r", endpoint="chat", headers={},
                       body={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    c.principal = Principal(id="key:1", kind="api_key", tenant=tenant, key_id="1")
    c.model = "m"
    return c


@pytest.mark.parametrize("prefs", [{"zdr": True}, {"data_collection": "deny"}])
async def test_decide_returns_the_tightened_decision(prefs):
    c = ctx("plain", provider=prefs)
    await PolicyStage(lambda: POL).run(c)
    assert c.decision.retention == "zero" and c.zero_retention and not c.content_retainable
    assert c.evidence["decision"]["retention"] == "zero"
    plain = ctx("plain")
    await PolicyStage(lambda: POL).run(plain)
    assert plain.decision.retention is None  # the control: policy alone keeps no zero-retention rule here


async def test_preferences_never_loosen_and_bad_ones_are_a_400_from_decide():
    c = ctx("eu", provider={"zdr": False, "data_collection": "allow"})
    await PolicyStage(lambda: POL).run(c)
    assert c.decision.retention == "zero" and c.decision.allowed_countries
    with pytest.raises(GatewayError) as ei:
        await PolicyStage(lambda: POL).run(ctx("plain", provider={"order": ["a", "a"]}))
    assert ei.value.status == 400 and ei.value.param == "provider.order"


async def test_order_with_allow_fallbacks_false_means_the_listed_backends_only():
    c = ctx("plain", provider={"order": ["b", "a"], "allow_fallbacks": False})
    await PolicyStage(lambda: POL).run(c)
    d = c.decision
    assert d.providers_order == ("b", "a") and d.providers_only == {"a", "b"} and not d.no_fallbacks
    c = ctx("plain", provider={"order": ["b", "a"], "only": ["a", "z"], "allow_fallbacks": False})
    await PolicyStage(lambda: POL).run(c)
    assert c.decision.providers_only == {"a"}  # intersected: order never widens `only`


def test_client_order_puts_listed_backends_first_in_the_clients_order():
    from gateway.config import BackendConfig
    from gateway.routing.plan import Candidate
    from gateway.routing.stage import client_order

    def cand(name: str, operator: str = "self") -> Candidate:
        return Candidate(backend=BackendConfig(name=name, url="http://x/v1", models=["m"], operator=operator),
                         model="m")
    routed = [cand("a"), cand("b"), cand("p1", "partner"), cand("c"), cand("p2", "partner")]
    names = lambda cs: [c.backend.name for c in cs]  # noqa: E731
    assert names(client_order(routed, ())) == ["a", "b", "p1", "c", "p2"]
    assert names(client_order(routed, ("c", "a"))) == ["c", "a", "b", "p1", "p2"]
    # an operator names all its backends; among them the router's order leads
    assert names(client_order(routed, ("partner", "b"))) == ["p1", "p2", "b", "a", "c"]


async def test_only_and_ignore_are_hard_filters_that_only_narrow():
    from gateway.config import BackendConfig
    from gateway.policy.residency import backend_allowed

    c = ctx("plain", provider={"only": ["a", "b"], "ignore": ["b"], "allow_fallbacks": False})
    await PolicyStage(lambda: POL).run(c)
    d = c.decision
    assert d.providers_only == {"a", "b"} and d.providers_ignored == {"b"} and d.no_fallbacks
    def bk(name: str, operator: str = "self") -> BackendConfig:
        return BackendConfig(name=name, url="http://x/v1", models=["m"], operator=operator)
    assert backend_allowed(d, bk("a")) is None
    assert "provider.ignore" in backend_allowed(d, bk("b"))
    assert "provider.only" in backend_allowed(d, bk("c"))
    assert backend_allowed(d, bk("p", "partner")) is not None
    # an operator name selects every backend of that operator
    c2 = ctx("plain", provider={"only": ["partner"]})
    await PolicyStage(lambda: POL).run(c2)
    assert backend_allowed(c2.decision, bk("p", "partner")) is None and backend_allowed(c2.decision, bk("a"))
