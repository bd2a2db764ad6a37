"""Compiler: schema and semantic errors name file:line; contradictions are rejected; precedence."""
from pathlib import Path

import pytest

from gateway.policy.compiler import PolicyError, compile_text, load_policies
from gateway.policy.model import RequestAttrs
from gateway.policy.testing import run_tests
from gateway.types import Principal

ROOT = Path(__file__).resolve().parents[2]


def P(**kw):
    kw.setdefault("tenant", "acme")
    return Principal(id="t", kind="api_key", **kw)


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as ei:
        compile_text(text, source="p.yaml")
    return ei.value.errors


def test_example_policies_pass_their_tests():
    pol = load_policies([ROOT / "policies"])
    results = run_tests(pol)
    assert len(results) >= 10
    assert [r.name for r in results if not r.ok] == []


def test_example_test_fails_when_expectation_is_wrong():
    text = (ROOT / "policies/tenants.yaml").read_text().replace(
        "expect: {allow: false, deny_rule: interns-no-frontier}", "expect: {allow: true}")
    pol = compile_text(text, "t.yaml")
    bad = [r for r in run_tests(pol) if not r.ok]
    assert len(bad) == 1 and "interns" in bad[0].name and "frontier" in bad[0].failures[0]


def test_unknown_key_names_file_and_line():
    errs = errors_of("rules:\n  - id: a\n    match: {team: x}\n    sett: {priority: batch}\n")
    assert len(errs) == 1 and errs[0].startswith("p.yaml:2: rules[0]: unknown key"), errs


def test_bad_enum_value_line_points_at_the_value():
    errs = errors_of("rules:\n  - id: a\n    match: {team: x}\n    set:\n      priority: urgent\n")
    assert errs[0].startswith("p.yaml:5: rules[0].set.priority:"), errs


def test_bad_yaml_reports_line():
    errs = errors_of("rules:\n  - id: a\n    match: {team: [x\n")
    assert errs[0].startswith("p.yaml:") and "invalid YAML" in errs[0]


def test_duplicate_ids_across_files(tmp_path):
    (tmp_path / "a.yaml").write_text("rules:\n  - id: r1\n    match: {team: x}\n    deny: true\n")
    (tmp_path / "b.yaml").write_text("rules:\n  - id: other\n    match: {team: y}\n    deny: true\n  - id: r1\n    deny: true\n")
    with pytest.raises(PolicyError) as ei:
        load_policies([tmp_path])
    assert f"{tmp_path / 'b.yaml'}:5: rules[1].id: duplicate rule id 'r1' (first defined at {tmp_path / 'a.yaml'}:2)" in str(ei.value)


def test_bad_country_and_contradictory_residency_rejected():
    assert "p.yaml:4: rules[0].require.jurisdiction" in errors_of(
        "rules:\n  - id: a\n    require:\n      jurisdiction: [XX1]\n")[0]
    # well-formed but not assigned: a policy that would silently match no backend is refused
    for code, hint in (("XX", ""), ("UK", " (use GB)")):
        errs = errors_of(f"rules:\n  - id: a\n    require:\n      jurisdiction: [DE, {code}]\n")
        assert len(errs) == 1 and f"'{code}' is not an assigned ISO 3166-1 alpha-2 country code{hint}" in errs[0], errs
    pol = compile_text("rules:\n  - id: a\n    require:\n      jurisdiction: [DE, EL, GB, CH]\n", source="p.yaml")
    assert pol.rules[0].countries == frozenset({"DE", "GR", "GB", "CH"})
    errs = errors_of("rules:\n  - id: a\n    match: {team: x}\n    require: {jurisdiction: [US]}\n"
                     "  - id: b\n    match: {team: x}\n    require: {jurisdiction: EEA}\n")
    assert "p.yaml:5: rules[b]" in errs[0] and "no backend can satisfy both" in errs[0]


def test_conflicting_values_under_identical_match_rejected():
    errs = errors_of("rules:\n  - id: a\n    match: {team: x}\n    set: {priority: realtime}\n"
                     "  - id: b\n    match: {team: x}\n    set: {priority: batch}\n")
    assert "sets priority='batch' but rule 'a'" in errs[0]
    # different matches are resolved by precedence, not rejected
    compile_text("rules:\n  - id: a\n    match: {team: x}\n    set: {priority: realtime}\n"
                 "  - id: b\n    match: {tenant: acme}\n    set: {priority: batch}\n")


def test_rule_that_can_never_allow_or_match_rejected():
    assert "range is empty" in errors_of("rules:\n  - id: a\n    match: {max_tokens: {gt: 10, lt: 5}}\n    deny: true\n")[0]
    assert "every matching request would be denied" in errors_of(
        "rules:\n  - id: a\n    match: {model: m1}\n    set: {models: [m2]}\n")[0]
    assert "cannot both allow and deny" in errors_of("rules:\n  - id: a\n    allow: true\n    deny: true\n")[0]
    assert "denies every model the same rule allows" in errors_of(
        "rules:\n  - id: a\n    set: {models: [m1]}\n    deny: {models: ['m*']}\n")[0]


def test_budget_needs_a_limit_and_money_parses():
    assert "rules[0].budgets[0]" in errors_of("rules:\n  - id: a\n    budgets: [{window: month}]\n")[0]
    pol = compile_text("rules:\n  - id: a\n    match: {project: p1}\n    budgets: [{window: month, limit: 12.5 USD}]\n")
    d = pol.decide(P(project="p1"), RequestAttrs(model="m"))
    (b,) = d.budgets
    assert (b.window, b.scope, b.limit("money"), b.currency, b.rule_id) == ("month", "project", 12.5, "USD", "a")


PREC = """
rules:
  - id: tenant-batch
    match: {tenant: acme}
    set: {priority: batch, ttft_slo_ms: 9000}
  - id: team-realtime
    match: {tenant: acme, team: search}
    set: {priority: realtime}
  - id: label-standard
    match: {labels.tier: gold}
    set: {priority: standard}
  - id: equal-first
    match: {scopes: s1}
    set: {max_tokens: 100}
  - id: equal-second
    match: {labels.tier: gold}
    set: {max_tokens: 200}
  - id: eea
    match: {labels.residency: eea}
    require: {jurisdiction: EEA}
  - id: de
    match: {team: search}
    require: {jurisdiction: [DE, US]}
  - id: deny-kimi
    match: {model: "kimi*"}
    deny: true
  - id: allow-search
    match: {team: search}
    set: {models: ["kimi*", "qwen*"]}
"""


def test_precedence_more_specific_wins_ties_by_order_deny_wins():
    pol = compile_text(PREC)
    d = pol.decide(P(team="search", labels={"tier": "gold", "residency": "eea"}, scopes=("s1",)), RequestAttrs(model="qwen3"))
    assert d.allow and d.priority == "realtime"  # team (level 3) beats tenant (2) and label (1)
    assert d.ttft_slo_ms == 9000  # only the tenant rule sets it
    assert d.max_tokens_cap == 100  # equal specificity: the earlier rule wins
    assert d.allowed_countries == frozenset({"DE"}) and d.jurisdiction == "DE"  # jurisdictions intersect
    assert d.residency_rule == "eea,de"
    d = pol.decide(P(team="search"), RequestAttrs(model="kimi-k3"))
    assert not d.allow and d.deny_rule == "deny-kimi"  # deny wins over an allow-list that includes it
    d = pol.decide(P(team="search"), RequestAttrs(model="glm-5"))
    assert not d.allow and d.deny_rule == "allow-search" and "not among the models" in d.reason
    d = pol.decide(P(team="other"), RequestAttrs(model="glm-5"))
    assert d.allow and d.priority == "batch"


def test_disjoint_residency_at_runtime_is_a_deny_naming_the_rules():
    pol = compile_text("rules:\n  - id: a\n    match: {team: x}\n    require: {jurisdiction: [US]}\n"
                       "  - id: b\n    match: {labels.residency: eea}\n    require: {jurisdiction: EEA}\n")
    d = pol.decide(P(team="x", labels={"residency": "eea"}), RequestAttrs(model="m"))
    assert not d.allow and "a, b" in d.reason and d.deny_rule == "b"


def test_default_deny_needs_an_explicit_allow():
    pol = compile_text("defaults: {allow: false}\nrules:\n  - id: ok\n    match: {tenant: acme}\n    allow: true\n")
    assert pol.decide(P(), RequestAttrs(model="m")).allow
    d = pol.decide(P(tenant="other"), RequestAttrs(model="m"))
    assert not d.allow and d.deny_rule == "(default)"


def test_time_headers_stream_and_globs():
    pol = compile_text("""
rules:
  - id: office-hours-only
    match: {tenant: "ac*", time: {days: [sat, sun]}}
    deny: true
  - id: night
    match: {time: {hours: "22:00-06:00", tz: Europe/Berlin}}
    set: {priority: batch}
  - id: streams
    match: {stream: true, header.x-team: [a, b]}
    set: {ttft_slo_ms: 300}
""")
    sat = 1700870400  # 2023-11-25 00:00 UTC, a Saturday (01:00 in Berlin)
    assert not pol.decide(P(), RequestAttrs(model="m", now=sat)).allow
    d = pol.decide(P(tenant="zeta"), RequestAttrs(model="m", now=sat))
    assert d.allow and d.priority == "batch"
    d = pol.decide(P(tenant="zeta"), RequestAttrs(model="m", now=sat + 12 * 3600))
    assert d.priority == "standard"
    d = pol.decide(P(tenant="zeta"), RequestAttrs(model="m", stream=True, headers={"x-team": "b"}, now=sat + 12 * 3600))
    assert d.ttft_slo_ms == 300
    d = pol.decide(P(tenant="zeta"), RequestAttrs(model="m", stream=False, headers={"x-team": "b"}))
    assert d.ttft_slo_ms is None
