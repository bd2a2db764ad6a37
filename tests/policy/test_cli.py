"""`gateway policy check|test|explain` through the gateway CLI parser."""
from pathlib import Path

from gateway.policy.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_check_ok_and_errors(tmp_path, capsys):
    assert main(["policy", "check", str(ROOT / "policies")]) == 0
    assert "ok: " in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - id: a\n    match: {team: x}\n    require: {jurisdiction: [ZZZ]}\n")
    assert main(["policy", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:4: rules[0].require.jurisdiction" in err and "1 error(s)" in err


def test_test_command_fails_on_wrong_expectation(tmp_path, capsys):
    assert main(["policy", "test", str(ROOT / "policies")]) == 0
    f = tmp_path / "p.yaml"
    f.write_text("rules:\n  - id: d\n    match: {team: x}\n    deny: true\n"
                 "tests:\n  - name: wrong\n    given: {team: x, model: m}\n    expect: {allow: true}\n")
    assert main(["policy", "test", str(f)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL: {f}:6: wrong" in out and "0/1 policy tests passed" in out


def test_explain(capsys):
    assert main(["policy", "explain", str(ROOT / "policies"), "-m", "kimi-k3", "--tenant", "acme", "--scope", "intern",
                 "--all"]) == 0
    out = capsys.readouterr().out
    assert "DENY by interns-no-frontier" in out and "MATCH interns-no-frontier" in out
    assert "skip  opper-partner-contract" in out and "not partner is opper" in out


def test_explain_uses_the_gateways_meaning_of_a_key_model_list(tmp_path, capsys):
    """A key allowed `qwen*` may call an alias whose every target matches (what the gateway serves); explain said
    the key's list excluded it (it matched the alias name only)."""
    import yaml

    pol = tmp_path / "p.yaml"
    pol.write_text("rules: []\n")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({
        "backends": [{"name": "b", "url": "http://127.0.0.1:1/v1", "models": ["qwen3-a", "qwen3-b", "llama-x"]}],
        "aliases": [{"name": "fast", "targets": ["qwen3-a", "qwen3-b"]},
                    {"name": "mixed", "targets": ["qwen3-a", "llama-x"]}],
        "keys": [{"name": "q", "key": "k" * 24, "tenant": "acme", "models": ["qwen*"]}],
        "policy": {"files": [str(pol)]}}))
    for model, excluded in (("fast", False), ("mixed", True), ("llama-x", True), ("qwen3-a", False)):
        assert main(["policy", "explain", str(pol), "-c", str(cfg), "--key", "q", "-m", model]) == 0
        assert ("excludes" in capsys.readouterr().out) is excluded, model
