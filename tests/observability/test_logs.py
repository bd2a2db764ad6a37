"""Log lines never carry a credential: gateway keys, Bearer tokens and JWTs by shape; the config's own
secrets (static client keys, the admin key, upstream credentials) by value, nested fields included."""
from __future__ import annotations

import io
import logging

import orjson
import yaml

from gateway.config import parse_config, read_secret
from gateway.identity.service import IdentityService
from gateway.observability.logs import configure_logging, redact


def _log_line(fn) -> str:
    buf = io.StringIO()
    h = configure_logging("info", json_logs=True, stream=buf)
    try:
        fn(logging.getLogger("gateway.test"))
    finally:
        logging.getLogger().removeHandler(h)
    return buf.getvalue()


def test_patterns_are_masked():
    for secret in ("gw_ab12cd34ef56_" + "x" * 40, "Bearer sk-proj-abcdefgh12345678",
                   "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"):
        assert secret not in redact(f"auth failed for {secret} today") and "[REDACTED]" in redact(secret)


def test_config_secrets_are_masked_by_value_in_message_and_nested_fields(tmp_path, monkeypatch):
    static, admin, upstream = "acme-prod-static-7f3a9c1e", "admin-value-55b2e0d1aa", "sk-partner-q9w8e7r6t5"
    monkeypatch.setenv("T_STATIC", static)
    monkeypatch.setenv("T_ADMIN", admin)
    monkeypatch.setenv("T_UP", upstream)
    cfg = parse_config(yaml.safe_dump({
        "backends": [{"name": "p", "kind": "openai", "url": "http://127.0.0.1:9/v1", "models": ["m"],
                      "api_key_env": "T_UP"}],
        "keys": [{"key_env": "T_STATIC", "tenant": "acme"}], "admin": {"key_env": "T_ADMIN"},
        "identity": {"sqlite_path": str(tmp_path / "id.db")}}))
    IdentityService(cfg)  # loads the static keys and the admin key, as the running gateway does
    assert read_secret("T_UP", None, tmp_path) == upstream

    def emit(log: logging.Logger) -> None:
        log.warning("upstream said api_key=%s, client sent %s", upstream, static,
                    extra={"fields": {"req": {"headers": [f"x-admin: {admin}"], "key": static}}})

    line = _log_line(emit)
    for s in (static, admin, upstream):
        assert s not in line, line
    rec = orjson.loads(line)
    assert rec["msg"].count("[REDACTED]") == 2 and rec["req"]["key"] == "[REDACTED]"
    assert rec["req"]["headers"] == ["x-admin: [REDACTED]"]
