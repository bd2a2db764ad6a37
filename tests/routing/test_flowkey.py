"""flow_id / flow_weight: the fair-queue flow of a request from its principal and the policy's share scope."""
from __future__ import annotations

import pytest

from gateway.routing.flowkey import flow_id, flow_weight
from gateway.types import Decision, Principal

FULL = Principal(id="key:k1", kind="api_key", tenant="acme", team="ml", project="chat", key_id="k1",
                 partner="opper")
BARE = Principal(id="key:k2", kind="api_key", tenant="acme")


@pytest.mark.parametrize("scope,want", [
    ("tenant", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat"), ("key", "key:k1"),
    ("partner", "partner:opper")])
def test_each_scope_names_its_flow(scope, want):
    assert flow_id(FULL, Decision(share=2.0, share_scope=scope)) == want


@pytest.mark.parametrize("scope", ["tenant", "team", "project", "key", "partner", "unknown"])
def test_a_level_the_principal_lacks_is_the_tenant(scope):
    assert flow_id(BARE, Decision(share_scope=scope)) == "acme"


def test_the_default_is_the_tenant_and_missing_inputs():
    assert flow_id(FULL, Decision()) == "acme"
    assert flow_id(FULL, None) == "acme"
    assert flow_id(None, Decision(share_scope="key")) == "anonymous"
    assert flow_id(None, None) == "anonymous"


def test_team_and_project_flows_are_named_like_their_budget_scopes():
    scopes = dict(FULL.budget_scopes())
    assert flow_id(FULL, Decision(share_scope="team")) == scopes["team"]
    assert flow_id(FULL, Decision(share_scope="project")) == scopes["project"]


def test_flow_weight():
    assert flow_weight(None) == 1.0
    assert flow_weight(Decision()) == 1.0
    assert flow_weight(Decision(share=0.25)) == 0.25
