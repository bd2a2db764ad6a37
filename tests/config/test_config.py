"""Config loading: every validation error names file:line: key, and a valid file becomes an immutable snapshot."""
from __future__ import annotations

import dataclasses

import pytest

from gateway.config import ConfigError, load_config, parse_config

BASE = """server: {host: 127.0.0.1, port: 18090}
backends:
  - name: local
    kind: openai
    url: http://127.0.0.1:18000/v1
    api_key_env: UPSTREAM_KEY
    models: [mock-model]
    location: {country: DE}
    retention: zero
keys:
  - key_env: GATEWAY_KEY
    tenant: demo
admin:
  key_env: GATEWAY_ADMIN_KEY
"""
ENV = {"UPSTREAM_KEY": "u", "GATEWAY_KEY": "g", "GATEWAY_ADMIN_KEY": "a"}


def err(text: str, env=ENV) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(text, "gw.yaml", env=env)
    return str(e.value)


def test_contract_file_is_accepted_and_frozen():
    cfg = parse_config(BASE, "gw.yaml", env=ENV)
    assert cfg.models == {"mock-model": ("local",)}
    b = cfg.backend("local")
    assert b.location.country == "DE" and b.retention_days == 0 and b.server_root == "http://127.0.0.1:18000"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.generation = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        b.url = "x"  # type: ignore[misc]


@pytest.mark.parametrize("mutate,expect", [
    (lambda t: t.replace("port: 18090", "port: nope"), "gw.yaml:1: server.port: Expected `int`"),
    (lambda t: t.replace("port: 18090", "port: 99999"), "gw.yaml:1: server.port: must be between"),
    (lambda t: t.replace("    retention: zero", "    retention: forever"), "gw.yaml:9: backends[0].retention"),
    (lambda t: t.replace("url: http://127.0.0.1:18000/v1", "url: ftp://x"), "gw.yaml:5: backends[0].url"),
    (lambda t: t.replace("{country: DE}", "{country: Germany}"), "backends[0].location.country: must be an ISO"),
    (lambda t: t.replace("{country: DE}", "{country: XX}"), "location.country: 'XX' is not an assigned ISO 3166"),
    (lambda t: t.replace("{country: DE}", "{country: UK}"), "'UK' is not an assigned ISO 3166-1 alpha-2 country code (use GB)"),
    (lambda t: t.replace("models: [mock-model]", "models: []"), "gw.yaml:7: backends[0].models"),
    (lambda t: t.replace("    kind: openai", "    kind: magic"), "gw.yaml:4: backends[0].kind"),
    (lambda t: t.replace("    kind: openai", "    kind: openai\n    colour: red"), "gw.yaml:5: backends[0].colour: unknown key"),
    (lambda t: t + "surprise: 1\n", "gw.yaml:15: surprise: unknown key"),
    (lambda t: t.replace("    tenant: demo", "    tenant: demo\n    tenant: other"), "duplicate key"),
    (lambda t: t + "aliases:\n  - {name: fast, targets: [missing]}\n", "aliases[0].targets[0]: no backend serves"),
    (lambda t: t + "budgets: {store: etcd}\n", "budgets.store"),
    (lambda t: t.replace("port: 18090}", "port: 18090, gc_threshold: [0, 10, 10]}"), "gw.yaml:1: server.gc_threshold: thresholds must be positive"),
    (lambda t: t.replace("port: 18090}", "port: 18090, gc_threshold: [700]}"), "server.gc_threshold"),
    (lambda t: "server: [1, 2", "invalid YAML"),
    (lambda t: "- a\n- b\n", "must be a mapping"),
])
def test_validation_errors_name_file_line_and_key(mutate, expect):
    assert expect in err(mutate(BASE))


def test_missing_env_vars_are_named():
    assert "GATEWAY_KEY is not set" in err(BASE, env={"UPSTREAM_KEY": "u", "GATEWAY_ADMIN_KEY": "a"})
    assert "keys[0].key_env" in err(BASE, env={"UPSTREAM_KEY": "u", "GATEWAY_ADMIN_KEY": "a"})
    assert "backends[0].api_key_env" in err(BASE, env={"GATEWAY_KEY": "g", "GATEWAY_ADMIN_KEY": "a"})


def test_aliases_resolve_to_chains(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text(BASE + "aliases:\n  - {name: fast, targets: [mock-model]}\n")
    cfg = load_config(p, env=ENV)
    assert cfg.resolve_model("fast") == ("mock-model",)
    assert cfg.resolve_model("mock-model") == ("mock-model",)
    assert cfg.resolve_model("nope") == ()
    assert cfg.base_dir == tmp_path


def test_missing_file():
    with pytest.raises(ConfigError, match="file not found"):
        load_config("/nonexistent/gw.yaml")


def test_config_check_cli(tmp_path, monkeypatch, capsys):
    from gateway.cli import main

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    good = tmp_path / "good.yaml"
    good.write_text(BASE)
    assert main(["config", "check", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("port: 18090", "port: x"))
    assert main(["config", "check", str(bad)]) == 1
    assert "bad.yaml:1: server.port" in capsys.readouterr().err


def test_gc_tuning_freezes_startup_objects_and_sets_the_configured_thresholds():
    """`gateway serve` calls tune_gc once started (gateway/cli.py): startup objects are frozen out of the cyclic
    GC (full collections scanned them: GC ~15% -> ~9.5% of CPU at saturation); thresholds only when configured."""
    import gc

    from gateway.cli import tune_gc

    assert parse_config(BASE, "gw.yaml", env=ENV).server.gc_threshold is None  # Python's thresholds by default
    cfg = parse_config(BASE.replace("port: 18090}", "port: 18090, gc_threshold: [20000, 10, 10]}"), env=ENV)
    assert cfg.server.gc_threshold == (20000, 10, 10)
    before = gc.get_threshold()
    try:
        tune_gc(cfg.server.gc_threshold)
        assert gc.get_threshold() == (20000, 10, 10) and gc.get_freeze_count() > 0
        gc.unfreeze()
        tune_gc(None)  # null: thresholds untouched, startup objects still frozen
        assert gc.get_threshold() == (20000, 10, 10) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_backend_lookup_by_name_survives_a_copy_and_refuses_unknown_names():
    """Config.backend is a dict lookup built with the snapshot (the reload path rebuilds the snapshot with
    Config(...), which must carry its own map)."""
    cfg = parse_config(BASE, "gw.yaml", env=ENV)
    assert cfg.backend("local") is cfg.raw.backends[0]
    with pytest.raises(KeyError):
        cfg.backend("nope")
    again = type(cfg)(raw=cfg.raw, path=cfg.path, base_dir=cfg.base_dir, models=cfg.models, aliases=cfg.aliases,
                      generation=cfg.generation + 1)
    assert again.backend("local") is cfg.raw.backends[0]
    assert dataclasses.replace(cfg, generation=9).backend("local") is cfg.raw.backends[0]
