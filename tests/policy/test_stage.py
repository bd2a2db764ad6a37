"""PolicyStage: sets the decision, caps max_tokens, refuses with OpenAI-shaped 403s, follows hot reload."""
import pytest

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.policy.compiler import compile_text
from gateway.policy.stage import PolicyStage
from gateway.types import Principal

POL = """
rules:
  - id: eea
    match: {partner: opper}
    require: {jurisdiction: EEA, retention: zero}
  - id: cap
    match: {team: t1}
    set: {max_tokens: 256}
  - id: no-kimi
    match: {team: t1}
    deny: {models: ["kimi*"]}
    reason: frontier models need an owner
  - id: kimi-us-only
    match: {model: kimi-us}
    require: {jurisdiction: [US]}
"""


def ctx(principal, model="qwen", max_tokens=None, headers=None, chain=()):
    c = RequestContext(request_id="r1", endpoint="chat", headers=headers or {}, body={"model": model})
    c.principal, c.model, c.max_tokens, c.model_chain = principal, model, max_tokens, chain
    return c


P = lambda **kw: Principal(id="k", kind="api_key", tenant="acme", **kw)  # noqa: E731


async def test_sets_decision_and_evidence():
    st = PolicyStage(lambda: compile_text(POL))
    c = ctx(P(partner="opper"))
    await st.run(c)
    assert c.decision.jurisdiction == "EEA" and c.zero_retention
    assert c.evidence["decision"]["matched_rules"] == ["eea"]


async def test_caps_max_tokens_including_absent():
    st = PolicyStage(lambda: compile_text(POL))
    c = ctx(P(team="t1"), max_tokens=4000)
    await st.run(c)
    assert c.max_tokens == 256 and c.body_overrides["max_tokens"] == 256
    c = ctx(P(team="t1"))
    await st.run(c)
    assert c.max_tokens == 256
    c = ctx(P(team="t1"), max_tokens=10)
    await st.run(c)
    assert c.max_tokens == 10 and "max_tokens" not in c.body_overrides


async def test_deny_is_a_403_naming_the_rule():
    st = PolicyStage(lambda: compile_text(POL))
    with pytest.raises(GatewayError) as ei:
        await st.run(ctx(P(team="t1"), model="kimi-k3"))
    e = ei.value
    assert e.status == 403 and e.code == "policy_denied" and "no-kimi" in e.message
    assert e.body()["error"]["type"] == "permission_error"


async def test_key_allowed_models():
    st = PolicyStage(lambda: compile_text(POL))
    with pytest.raises(GatewayError) as ei:
        await st.run(ctx(P(allowed_models=("qwen*",)), model="glm-4"))
    assert ei.value.status == 403 and ei.value.code == "model_not_allowed"
    await st.run(ctx(P(allowed_models=("qwen*",)), model="qwen3"))


async def test_alias_chain_drops_targets_policy_or_residency_forbid():
    st = PolicyStage(lambda: compile_text(POL))
    c = ctx(P(team="t1"), model="fast", chain=("kimi-k3", "qwen3"))
    await st.run(c)
    assert c.model_chain == ("qwen3",) and c.evidence["model_chain_dropped"] == ["kimi-k3"]
    # a fallback whose own rules require a residency the request's decision does not enforce is dropped
    c = ctx(P(), model="fast", chain=("kimi-us", "qwen3"))
    await st.run(c)
    assert c.model_chain == ("qwen3",)
    with pytest.raises(GatewayError) as ei:
        await st.run(ctx(P(team="t1"), model="fast", chain=("kimi-k3",)))
    assert ei.value.code == "model_not_allowed"


async def test_hot_reload_swaps_snapshots():
    current = {"p": compile_text(POL)}
    st = PolicyStage(lambda: current["p"])
    await st.run(ctx(P(team="t2"), model="kimi-k3"))
    current["p"] = compile_text("rules:\n  - id: all-kimi-denied\n    match: {model: 'kimi*'}\n    deny: true\n")
    with pytest.raises(GatewayError) as ei:
        await st.run(ctx(P(team="t2"), model="kimi-k3"))
    assert "all-kimi-denied" in ei.value.message


async def test_unauthenticated_is_refused():
    with pytest.raises(GatewayError) as ei:
        await PolicyStage(lambda: compile_text(POL)).run(ctx(None))
    assert ei.value.status == 401
