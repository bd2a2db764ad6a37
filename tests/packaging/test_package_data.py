"""Package data has one source: what policies/ holds for editors and `gateway policy check policies/` is the files
the package ships (gateway/policy/): the schema as a link to it, the demo policy as a byte-for-byte copy."""
from __future__ import annotations

from importlib import resources

from tests.support.procs import ROOT


def test_policies_schema_json_is_the_packaged_schema():
    link = ROOT / "policies" / "schema.json"
    assert link.is_symlink() and link.resolve() == (ROOT / "gateway" / "policy" / "schema.json").resolve(), \
        "policies/schema.json is a link to gateway/policy/schema.json (the one schema), not a copy"
    packaged = (resources.files("gateway.policy") / "schema.json").read_bytes()
    assert link.read_bytes() == packaged


def test_the_demo_policy_is_policies_tenants_yaml():
    packaged = (resources.files("gateway.policy") / "example_policy.yaml").read_bytes()
    assert (ROOT / "policies" / "tenants.yaml").read_bytes() == packaged, \
        "edit policies/tenants.yaml and copy it to gateway/policy/example_policy.yaml"


def test_the_runtime_reads_package_data_not_repository_paths():
    from gateway.budget import store
    from gateway.observability import dashboard
    from gateway.policy import compiler

    assert "redis.call" in store.LUA
    assert b"<html" in dashboard.PAGE.read_bytes().lower()
    assert compiler.load_schema()["type"] == "object"
    assert not hasattr(compiler, "SCHEMA_PATH")
