"""PolicyStage: sets the decision, caps max_tokens, refuses with OpenAI-shaped 403s, follows hot reload."""
import pytest

from gateway.api.endpoints import BY_NAME
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


async def test_a_cap_does_not_raise_the_completions_default_of_16():
    """/v1/completions without max_tokens generates 16 tokens (OpenAI's and vLLM's default): a cap of 256
    must not turn that into 256; a cap below 16 still applies."""
    st = PolicyStage(lambda: compile_text(POL))
    c = ctx(P(team="t1"))
    c.endpoint, c.ep = "completions", BY_NAME["completions"]  # ep is looked up at construction
    await st.run(c)
    assert c.max_tokens is None and "max_tokens" not in c.body_overrides
    small = PolicyStage(lambda: compile_text(POL.replace("max_tokens: 256", "max_tokens: 8")))
    c = ctx(P(team="t1"))
    c.endpoint, c.ep = "completions", BY_NAME["completions"]  # ep is looked up at construction
    await small.run(c)
    assert c.max_tokens == 8 and c.body_overrides["max_tokens"] == 8


async def test_deny_is_a_403_naming_the_rule():
    st = PolicyStage(lambda: compile_text(POL))
    with pytest.raises(GatewayError) as ei:
        await st.run(ctx(P(team="t1"), model="kimi-k3"))
    e = ei.value
    assert e.status == 403 and e.code == "policy_denied" and "no-kimi" in e.message
    assert e.body()["error"]["type"] == "permission_error"


async def test_key_allowed_models_are_owned_by_the_authenticate_stage():
    """Issue 18: the key's model list was checked twice with two meanings (authenticate: the name or every
    alias target; decide: the name only), so an alias whose every target a `qwen*` key allows passed
    authentication and was refused here. The authenticate stage owns it; policy decides on policy alone."""
    from gateway.identity.stage import model_allowed

    st = PolicyStage(lambda: compile_text(POL))
    key = P(allowed_models=("qwen*",))
    c = ctx(key, model="fast", chain=("qwen3", "qwen3-4b"))
    assert model_allowed(key, "fast", ("qwen3", "qwen3-4b"))
    await st.run(c)
    assert c.decision.allow and c.model_chain == ("qwen3", "qwen3-4b")
    assert not model_allowed(key, "glm-4", ("glm-4",))


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


# ------------------------------------------------------------------------------------------ max_context

CTX_POL = """
rules:
  - id: tenant-context
    match: {tenant: acme}
    set: {max_context: 1000}
  - id: team-context
    match: {tenant: acme, team: small}
    set: {max_context: 100, max_tokens: 50}
"""


def sized(principal, prompt_est, max_tokens=None, endpoint="chat", body=None, prompt_max=None):
    c = RequestContext(request_id="r1", endpoint=endpoint, headers={}, body=body or {"model": "qwen"})
    c.principal, c.model, c.max_tokens = principal, "qwen", max_tokens
    c.prompt_tokens_est = prompt_est
    c.prompt_tokens_max = prompt_max if prompt_max is not None else prompt_est * 4 + 32
    return c


async def test_max_context_refuses_a_request_that_does_not_fit():
    st = PolicyStage(lambda: compile_text(CTX_POL))
    c = sized(P(), 900, max_tokens=200)
    with pytest.raises(GatewayError) as ei:
        await st.run(c)
    e = ei.value
    assert e.status == 400 and e.code == "context_length_exceeded" and e.param == "max_tokens"
    err = e.body()["error"]
    assert err["type"] == "invalid_request_error" and err["rule"] == "tenant-context"
    assert {"message", "type", "code", "param"} <= set(err)
    assert "tenant-context" in e.message and "1100" in e.message and "1000" in e.message
    assert "at most 100 " in e.message
    assert c.evidence["max_context"] == {"rule": "tenant-context", "max_context": 1000, "prompt_tokens_est": 900,
                                         "max_tokens": 200, "requested_context": 1100, "outcome": "refused"}
    assert c.evidence["decision"]["max_context"] == 1000


async def test_max_context_lets_a_fitting_request_through_untouched():
    st = PolicyStage(lambda: compile_text(CTX_POL))
    c = sized(P(), 800, max_tokens=200)  # exactly the limit
    await st.run(c)
    assert c.max_tokens == 200 and not c.body_overrides and "max_context" not in c.evidence


async def test_max_context_counts_the_estimate_not_the_byte_bound():
    # the byte-level bound (4x the estimate for ASCII text) would refuse this ordinary request
    st = PolicyStage(lambda: compile_text(CTX_POL))
    c = sized(P(), 700, max_tokens=100, prompt_max=2900)
    await st.run(c)
    assert c.max_tokens == 100


async def test_max_context_prompt_alone_too_long():
    st = PolicyStage(lambda: compile_text(CTX_POL))
    for mt in (None, 1):
        c = sized(P(), 1000, max_tokens=mt)
        with pytest.raises(GatewayError) as ei:
            await st.run(c)
        assert ei.value.code == "context_length_exceeded" and ei.value.param == "messages"
        assert c.evidence["max_context"]["outcome"] == "refused"


async def test_max_context_lowers_a_max_tokens_the_client_did_not_send():
    st = PolicyStage(lambda: compile_text(CTX_POL))
    c = sized(P(), 900)  # chat without max_tokens: the engine would run to its own context length
    await st.run(c)
    assert c.max_tokens == 100 and c.body_overrides == {"max_tokens": 100}
    assert c.evidence["max_context"]["outcome"] == "max_tokens_lowered"
    assert c.evidence["max_context"]["rule"] == "tenant-context"
    c = sized(P(), 900, body={"model": "qwen", "max_completion_tokens": None})
    await st.run(c)
    assert c.body_overrides == {"max_completion_tokens": 100}
    # completions without max_tokens: the engine default of 16 fits, nothing to change
    c = sized(P(), 900, endpoint="completions")
    await st.run(c)
    assert c.max_tokens is None and not c.body_overrides
    c = sized(P(), 990, endpoint="completions")
    await st.run(c)
    assert c.max_tokens == 10 and c.body_overrides == {"max_tokens": 10}


async def test_max_context_with_a_max_tokens_cap_from_the_most_specific_rule():
    st = PolicyStage(lambda: compile_text(CTX_POL))
    # team rule (more specific) wins: max_context 100, cap 50. No max_tokens sent: the cap, lowered to what fits
    c = sized(P(team="small"), 70)
    await st.run(c)
    assert c.max_tokens == 30 and c.body_overrides == {"max_tokens": 30}
    c = sized(P(team="small"), 40)
    await st.run(c)
    assert c.max_tokens == 50 and "max_context" not in c.evidence
    # a client max_tokens over the cap is capped first; what is left must fit, else refused naming the team rule
    c = sized(P(team="small"), 40, max_tokens=4000)
    await st.run(c)
    assert c.max_tokens == 50
    with pytest.raises(GatewayError) as ei:
        await st.run(sized(P(team="small"), 60, max_tokens=4000))
    assert ei.value.extra["rule"] == "team-context" and "110" in ei.value.message


async def test_max_context_embeddings_count_the_input_only():
    st = PolicyStage(lambda: compile_text(CTX_POL))
    c = sized(P(), 1000, endpoint="embeddings")
    await st.run(c)
    assert c.max_tokens is None and not c.body_overrides
    with pytest.raises(GatewayError) as ei:
        await st.run(sized(P(), 1001, endpoint="embeddings"))
    assert ei.value.param == "input" and ei.value.code == "context_length_exceeded"


async def test_no_max_context_no_limit():
    st = PolicyStage(lambda: compile_text(POL))
    c = sized(P(), 10**6, max_tokens=10**6)
    await st.run(c)
    assert c.max_tokens == 10**6


async def test_max_context_rule_named_for_opa_decisions():
    from gateway.policy.config import OPAConfig
    from gateway.policy.opa import OPAPolicy, merge_result
    from gateway.policy.model import RequestAttrs

    local = compile_text(CTX_POL)
    opa = OPAPolicy(OPAConfig(url="http://127.0.0.1:1", mode="merge"), local=lambda: local)
    base = local.decide(P(), RequestAttrs(model="qwen"))
    assert local.setting_rule(base, "max_context") == "tenant-context"
    assert opa.setting_rule(merge_result(base, {"allow": True}, True), "max_context") == "tenant-context"
    d = merge_result(base, {"allow": True, "max_context": 64}, True)
    assert d.max_context == 64 and opa.setting_rule(d, "max_context") == "opa"
    # a remote policy's decision is enforced by the stage like a local one
    st = PolicyStage(lambda: type("Remote", (), {"adecide": staticmethod(_async(d)), "is_remote": True,
                                                 "setting_rule": opa.setting_rule})())
    with pytest.raises(GatewayError) as ei:
        await st.run(sized(P(), 60, max_tokens=10))
    assert ei.value.extra["rule"] == "opa" and ei.value.status == 400


def _async(value):
    async def f(*_a):
        return value
    return f
