"""Package data has one source: the copies under policies/ (for editors and `gateway policy check policies/`)
are the files the package ships (gateway/policy/), byte for byte."""
from __future__ import annotations

from importlib import resources

from tests.support.procs import ROOT


def test_policies_schema_json_is_the_packaged_schema():
    packaged = (resources.files("gateway.policy") / "schema.json").read_bytes()
    assert (ROOT / "policies" / "schema.json").read_bytes() == packaged, \
        "edit gateway/policy/schema.json and copy it to policies/schema.json"


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
