"""`gateway keys create|list|revoke|rotate` against a SQLite store named by a config file."""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import yaml

from gateway.errors import GatewayError
from gateway.identity.cli import add_keys_commands, parse_duration
from gateway.config import load_config
from gateway.identity.service import IdentityService


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="gateway")
    add_keys_commands(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_cli_lifecycle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"identity": {"sqlite_path": "var/id.db"}}))
    rc, out = run(["keys", "create", "--config", str(cfg), "--tenant", "acme", "--team", "search",
                   "--create-missing", "--label", "tier=realtime", "--model", "qwen*", "--expires-in", "30d",
                   "--json"], capsys)
    assert rc == 0
    created = json.loads(out)
    secret, kid = created["key"], created["id"]
    assert (tmp_path / "var" / "id.db").exists()  # created on first run, relative to the config file

    rc, out = run(["keys", "list", "--config", str(cfg)], capsys)
    assert rc == 0 and kid in out and "active" in out and secret not in out

    async def check(token: str) -> str:
        svc = IdentityService(load_config(cfg))
        await svc.start()
        try:
            p = await svc.authenticate({"authorization": f"Bearer {token}"}, "cli")
            return f"{p.tenant}/{p.team}/{p.labels['tier']}"
        except GatewayError as e:
            return str(e.code)
        finally:
            await svc.close()

    assert asyncio.run(check(secret)) == "acme/search/realtime"
    rc, out = run(["keys", "rotate", "--config", str(cfg), kid, "--overlap", "0s", "--json"], capsys)
    assert rc == 0
    new = json.loads(out)
    assert new["rotated_from"] == kid
    assert asyncio.run(check(secret)) == "expired_api_key"
    assert asyncio.run(check(new["key"])) == "acme/search/realtime"
    rc, out = run(["keys", "revoke", "--config", str(cfg), new["id"]], capsys)
    assert rc == 0 and "revoked" in out
    assert asyncio.run(check(new["key"])) == "revoked_api_key"
    rc, _ = run(["keys", "revoke", "--config", str(cfg), "nope"], capsys)
    assert rc == 1


def test_parse_duration() -> None:
    assert parse_duration("90") == 90 and parse_duration("15m") == 900 and parse_duration("2d") == 172800
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")
