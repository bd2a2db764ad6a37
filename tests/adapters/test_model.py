"""The pure adapter decisions: owner scope, granted source prefixes, what of a chain and catalog a caller sees."""
from __future__ import annotations

from gateway.adapters.catalog import visible_catalog
from gateway.adapters.model import Adapter, owns, source_allowed, visible_chain
from gateway.types import Principal

A = Adapter(name="acme-support", base_model="base", source="/w/acme/support", tenant="acme")
TEAM = Adapter(name="acme-core", base_model="base", source="/w/acme/core", tenant="acme", team="core")
PROJ = Adapter(name="acme-p1", base_model="base", source="/w/acme/p1", tenant="acme", team="core", project="p1")
REG = {a.name: a for a in (A, TEAM, PROJ)}


def who(tenant: str, team: str | None = None, project: str | None = None) -> Principal:
    return Principal(id="k", kind="api_key", tenant=tenant, team=team, project=project)


def test_owner_scope_narrows_with_team_and_project() -> None:
    assert owns(who("acme"), A) and owns(who("acme", "other"), A)
    assert not owns(who("beta"), A)
    assert owns(who("acme", "core"), TEAM) and not owns(who("acme", "ops"), TEAM) and not owns(who("acme"), TEAM)
    assert owns(who("acme", "core", "p1"), PROJ)
    assert not owns(who("acme", "core", "p2"), PROJ) and not owns(who("acme", "core"), PROJ)


def test_source_prefix_matches_at_a_path_boundary_only() -> None:
    assert source_allowed("/w/acme/x", ["/w/acme"])
    assert source_allowed("/w/acme/x", ["/w/acme/"])
    assert source_allowed("/w/acme", ["/w/acme/"])
    assert not source_allowed("/w/acme-evil/x", ["/w/acme"])
    assert not source_allowed("/w/beta/x", ["/w/acme"])
    assert source_allowed("s3://bucket/acme/a1", ["s3://bucket/acme/"])
    assert not source_allowed("s3://bucket/acmeX/a1", ["s3://bucket/acme"])
    assert not source_allowed("/w/acme/x", [])


def test_source_cannot_climb_out_of_its_prefix() -> None:
    assert not source_allowed("/w/acme/../beta/x", ["/w/acme"])
    assert not source_allowed("/w/acme/./x", ["/w/acme"])
    assert not source_allowed("s3://b/acme/../beta", ["s3://b/acme"])
    assert not source_allowed("/w/acme/x\\..\\y", ["/w/acme"])
    assert not source_allowed("/w/acme/x\n", ["/w/acme"])


def test_chain_keeps_unregistered_models_and_owned_adapters_only() -> None:
    chain = ("acme-support", "base", "acme-core")
    assert visible_chain(who("acme", "core"), chain, REG) == chain
    assert visible_chain(who("acme", "ops"), chain, REG) == ("acme-support", "base")
    assert visible_chain(who("beta"), chain, REG) == ("base",)
    assert visible_chain(who("beta"), ("acme-support",), REG) == ()


def test_catalog_hides_others_adapters_and_names_the_owner() -> None:
    entries = [{"id": "base", "owned_by": "gateway"}, {"id": "acme-support", "owned_by": "gateway"},
               {"id": "support", "alias_of": ["acme-support", "base"]}, {"id": "only-acme", "alias_of": ["acme-support"]}]
    beta = visible_catalog(who("beta"), entries, REG)
    assert [e["id"] for e in beta] == ["base", "support"]
    assert beta[1]["alias_of"] == ["base"]
    acme = visible_catalog(who("acme"), entries, REG)
    assert [e["id"] for e in acme] == ["base", "acme-support", "support", "only-acme"]
    assert acme[1]["owned_by"] == "acme" and acme[1]["adapter"]["base_model"] == "base"
