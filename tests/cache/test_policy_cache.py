"""The `cache` set key: compiled into the decision by the most specific rule, validated with file:line."""
from __future__ import annotations

import pytest

from gateway.cache.spec import CacheSpec
from gateway.policy.compiler import PolicyError, compile_text
from gateway.policy.model import RequestAttrs
from gateway.types import Principal

POLICY = """
version: 1
rules:
  - id: faq-cache
    match: {tenant: acme}
    set: {cache: {mode: semantic, ttl_s: 600, similarity: 0.93}}
  - id: faq-team-exact
    match: {tenant: acme, team: search}
    set: {cache: {mode: exact, ttl_s: 60, scope: team}}
"""


def decide(pol, **p):
    return pol.decide(Principal(id="t", kind="api_key", **p), RequestAttrs(model="m"))


def test_cache_is_off_unless_a_rule_sets_it_and_the_most_specific_wins():
    pol = compile_text(POLICY, "p.yaml")
    assert decide(pol, tenant="other").cache is None
    assert decide(pol, tenant="acme").cache == CacheSpec(mode="semantic", ttl_s=600.0, similarity=0.93)
    assert decide(pol, tenant="acme", team="search").cache == CacheSpec(mode="exact", ttl_s=60.0, scope="team")


@pytest.mark.parametrize("value", ["{mode: fuzzy}", "{mode: exact, similarity: 0.9}", "{ttl_s: -1}",
                                   "{mode: semantic, similarity: 2}", "{scope: world}", "{colour: red}"])
def test_bad_cache_values_are_refused_with_file_and_line(value):
    with pytest.raises(PolicyError) as ei:
        compile_text(f"version: 1\nrules:\n  - id: r\n    match: {{tenant: a}}\n    set: {{cache: {value}}}\n", "p.yaml")
    assert any("p.yaml" in e and "cache" in e for e in ei.value.errors), ei.value.errors
