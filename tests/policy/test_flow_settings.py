"""`set.share` and `set.long_ttft_slo_ms`: compiled values, the flow scope of a share rule, most specific wins,
schema bounds, the OPA mapping and the explain output (issue #21, docs/policy.md)."""
from __future__ import annotations

import pytest

from gateway.policy.cli import main
from gateway.policy.compiler import PolicyError, compile_text
from gateway.policy.model import RequestAttrs
from gateway.policy.opa import merge_result
from gateway.routing.flowkey import flow_id, flow_weight
from gateway.types import Decision, Principal

POLICY = """
rules:
  - id: acme-share
    match: {tenant: acme}
    set: {share: 2, long_ttft_slo_ms: 8000}
  - id: acme-team-a
    match: {tenant: acme, team: a}
    set: {share: 5}
  - id: acme-key
    match: {key: k9}
    set: {share: 0.5, long_ttft_target_ms: 12000}
  - id: opper
    match: {partner: opper}
    set: {share: 4}
  - id: realtime-by-model
    match: {model: "fast-*"}
    set: {share: 7}
"""


def P(**kw):
    kw.setdefault("tenant", "acme")
    return Principal(id="t", kind="api_key", **kw)


@pytest.fixture(scope="module")
def pol():
    return compile_text(POLICY, source="p.yaml")


def test_a_tenant_rule_weighs_the_tenants_flow(pol):
    d = pol.decide(P(team="b"), RequestAttrs(model="m"))
    assert (d.share, d.share_scope, d.long_ttft_slo_ms) == (2.0, "tenant", 8000.0)
    assert flow_id(P(team="b"), d) == "acme" and flow_weight(d) == 2.0


def test_a_team_rule_is_more_specific_and_names_the_teams_flow(pol):
    p = P(team="a")
    d = pol.decide(p, RequestAttrs(model="m"))
    assert (d.share, d.share_scope) == (5.0, "team")
    assert d.long_ttft_slo_ms == 8000.0  # only the tenant rule sets it: single values are chosen key by key
    assert flow_id(p, d) == "acme/a"


def test_a_key_rule_wins_over_team_and_tenant_and_the_alias_sets_long_ttft(pol):
    p = P(team="a", key_id="k9")
    d = pol.decide(p, RequestAttrs(model="m"))
    assert (d.share, d.share_scope, d.long_ttft_slo_ms) == (0.5, "key", 12000.0)
    assert flow_id(p, d) == "key:k9"


def test_a_partner_rule_names_the_partners_flow(pol):
    p = Principal(id="p", kind="partner", tenant="opper-users", partner="opper")
    d = pol.decide(p, RequestAttrs(model="m"))
    assert (d.share, d.share_scope) == (4.0, "partner")
    assert flow_id(p, d) == "partner:opper"


def test_a_rule_without_a_principal_match_weighs_the_tenant_flow():
    pol = compile_text("rules:\n  - id: m\n    match: {model: 'fast-*'}\n    set: {share: 7}\n", "p.yaml")
    p = P(tenant="other", team="x")
    d = pol.decide(p, RequestAttrs(model="fast-1"))
    assert (d.share, d.share_scope) == (7.0, "tenant") and flow_id(p, d) == "other"


def test_no_share_rule_is_weight_one_on_the_tenant():
    d = compile_text("rules:\n  - id: x\n    match: {team: z}\n    set: {priority: batch}\n", "p.yaml").decide(
        P(team="a"), RequestAttrs(model="m"))
    assert (d.share, d.share_scope, d.long_ttft_slo_ms) == (1.0, "tenant", None)
    ev = d.to_evidence()
    assert ev["share"] == 1.0 and ev["share_scope"] == "tenant" and ev["long_ttft_slo_ms"] is None


@pytest.mark.parametrize("key,value", [("share", 0), ("share", -1), ("share", "big"), ("long_ttft_slo_ms", 0),
                                       ("long_ttft_target_ms", -5)])
def test_the_schema_rejects_non_positive_values(key, value):
    with pytest.raises(PolicyError) as ei:
        compile_text(f"rules:\n  - id: a\n    match: {{team: x}}\n    set:\n      {key}: {value}\n", "p.yaml")
    assert ei.value.errors[0].startswith(f"p.yaml:5: rules[0].set.{key}:"), ei.value.errors


def test_different_shares_under_an_identical_match_are_a_contradiction():
    with pytest.raises(PolicyError) as ei:
        compile_text("rules:\n  - id: a\n    match: {team: x}\n    set: {share: 1}\n"
                     "  - id: b\n    match: {team: x}\n    set: {share: 2}\n", "p.yaml")
    assert any("sets share=2.0" in e for e in ei.value.errors), ei.value.errors


def test_policy_tests_can_expect_the_share():
    pol = compile_text(POLICY + """
tests:
  - name: team a
    given: {tenant: acme, team: a, model: m}
    expect: {share: 5, share_scope: team, long_ttft_slo_ms: 8000}
""", "p.yaml")
    from gateway.policy.testing import run_tests

    assert [r.failures for r in run_tests(pol)] == [()]


@pytest.mark.parametrize("field,value,ok", [
    ("share", 3, 3.0), ("share", 0, None), ("share", "3", None), ("share", True, None),
    ("long_ttft_slo_ms", 9000, 9000.0), ("long_ttft_slo_ms", -1, None),
    ("share_scope", "team", "team"), ("share_scope", "org", None)])
def test_opa_can_set_share_and_long_ttft(field, value, ok):
    d = merge_result(None, {"allow": True, field: value}, True)
    if ok is None:
        assert not d.allow and d.deny_rule == "opa" and f"'{field}'" in (d.reason or "")
    else:
        assert d.allow and getattr(d, field) == ok


def test_opa_merge_keeps_the_local_share_unless_it_answers_one():
    local = Decision(share=5.0, share_scope="team", long_ttft_slo_ms=8000.0)
    d = merge_result(local, {"allow": True}, True)
    assert (d.share, d.share_scope, d.long_ttft_slo_ms) == (5.0, "team", 8000.0)
    d = merge_result(local, {"allow": True, "share": 2}, True)
    assert (d.share, d.share_scope) == (2.0, "team")


def test_explain_lists_the_share_and_its_flow(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text(POLICY)
    assert main(["policy", "explain", str(f), "-m", "m", "--tenant", "acme", "--team", "a"]) == 0
    out = capsys.readouterr().out
    assert "share: 5 (flow: team, acme/a)" in out and "long_ttft_slo_ms: 8000.0" in out
