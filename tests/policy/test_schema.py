"""The policy schema's `budget` object comes from the budget dimensions' table (gateway/budget/dimensions.py):
policies are validated with the table's object, and the file editors read (gateway/policy/schema.json, linked
as policies/schema.json) holds the same object, rewritten by `gateway policy schema --write`."""
from __future__ import annotations

import json

import pytest

from gateway.budget.dimensions import DIMENSIONS
from gateway.policy.cli import main as cli
from gateway.policy.compiler import SCHEMA_RESOURCE, PolicyError, budget_schema, load_schema, parse_documents, write_schema


def test_the_schema_files_budget_object_is_the_tables():
    on_disk = json.loads(SCHEMA_RESOURCE.read_text(encoding="utf-8"))
    assert on_disk["$defs"]["budget"] == budget_schema(), \
        "gateway/policy/schema.json is behind the budget dimensions' table: run `gateway policy schema --write`"
    assert load_schema()["$defs"]["budget"] == budget_schema()
    # every policy key of every dimension, and nothing else besides window, scope and currency
    keys = {k for d in DIMENSIONS for k in d.schema}
    assert set(budget_schema()["properties"]) == keys | {"window", "scope", "currency"}
    assert {"requests", "tokens", "limit", "money", "gpu_seconds", "concurrency"} <= keys


def test_write_schema_rewrites_the_budget_object_and_nothing_else(tmp_path):
    original = SCHEMA_RESOURCE.read_text(encoding="utf-8")
    path = tmp_path / "schema.json"
    # a budget object out of step; the rest of the file keeps its own layout: only the budget object is replaced
    text = original.replace('"tokens": {', '"tokens_gone": {', 1)
    assert text != original
    path.write_text(text, encoding="utf-8")
    assert write_schema(path) is True
    assert path.read_text(encoding="utf-8") == original
    assert write_schema(path) is False  # in step: untouched


def test_a_budget_key_no_dimension_declares_is_refused_and_every_declared_one_compiles():
    with pytest.raises(PolicyError) as e:
        parse_documents([("p.yaml", "rules:\n  - id: a\n    budgets: [{window: day, tokenz: 5}]\n")])
    assert "p.yaml:3" in str(e.value) and "tokenz" in str(e.value)
    values = {"limit": "5 USD", "money": 5, "gpu_seconds": 1.5}
    for d in DIMENSIONS:
        for key in d.schema:
            text = f"rules:\n  - id: a\n    budgets: [{{window: day, {key}: {json.dumps(values.get(key, 5))}}}]\n"
            rules, _, _ = parse_documents([("p.yaml", text)])
            (spec,) = rules[0].budgets
            assert spec.limit(d.name) is not None and [n for n, _ in spec.limits] == [d.name], key


def test_the_cli_prints_the_schema_policies_are_validated_with(capsys):
    assert cli(["policy", "schema"]) == 0
    assert json.loads(capsys.readouterr().out)["$defs"]["budget"] == budget_schema()
