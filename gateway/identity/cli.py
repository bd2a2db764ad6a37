"""`gateway keys create|list|revoke|rotate`: key management straight on the configured identity store."""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from typing import Any

import orjson

from gateway.errors import GatewayError

_DUR = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


def parse_duration(s: str) -> float:
    """'90' / '90s' / '15m' / '12h' / '30d' -> seconds."""
    m = _DUR.match(s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {s!r} (use e.g. 90s, 15m, 12h, 30d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _labels(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"label must be key=value, got {it!r}")
        out[k] = v
    return out


def add_keys_commands(subparsers: Any) -> None:
    """Register `keys` with its sub-commands on the top-level `gateway` parser's subparsers."""
    keys = subparsers.add_parser("keys", help="manage API keys in the identity store")
    sub = keys.add_subparsers(dest="keys_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="gateway config file (selects the identity store)")
        p.add_argument("--json", action="store_true", help="print JSON")

    c = sub.add_parser("create", help="create a key; prints the secret once")
    common(c)
    c.add_argument("--tenant", required=True)
    c.add_argument("--team")
    c.add_argument("--project")
    c.add_argument("--partner")
    c.add_argument("--name", default="")
    c.add_argument("--admin", action="store_true", help="a tenant-admin key for the admin API")
    c.add_argument("--label", action="append", help="key=value (repeatable)")
    c.add_argument("--scope", action="append")
    c.add_argument("--model", action="append", help="allowed model glob (repeatable)")
    c.add_argument("--expires-in", type=parse_duration)
    c.add_argument("--create-missing", action="store_true", help="create tenant/team/project/partner if missing")

    ls = sub.add_parser("list", help="list keys (never secrets)")
    common(ls)
    ls.add_argument("--tenant")

    r = sub.add_parser("revoke", help="revoke a key by id")
    common(r)
    r.add_argument("key_id")

    ro = sub.add_parser("rotate", help="issue a successor; the old key keeps working for --overlap")
    common(ro)
    ro.add_argument("key_id")
    ro.add_argument("--overlap", type=parse_duration, help="e.g. 1h (default identity.rotation_overlap_s)")

    keys.set_defaults(func=run_keys_command)


def run_keys_command(args: argparse.Namespace) -> int:
    """Entry used by gateway/cli.py: runs the selected `keys` sub-command, returns the exit code."""
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_config
    from gateway.identity.service import IdentityService

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    svc = IdentityService(config)
    try:  # the policy's restriction labels hold for keys made here too (residency/retention always do)
        from gateway.policy.cli import load_for_config

        svc.set_policy(load_for_config(config))
    except Exception as e:  # a broken policy file: the gateway would not start either; keep the fixed set
        print(f"warning: policy not loaded ({e}); only residency/retention are treated as restrictions",
              file=sys.stderr)
    try:
        await svc.start()
        fn = {"create": _create, "list": _list, "revoke": _revoke, "rotate": _rotate}[args.keys_cmd]
        return await fn(svc.directory, args)
    except GatewayError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    finally:
        await svc.close()


def _show(args: argparse.Namespace, data: Any, text: str) -> None:
    print(orjson.dumps(data).decode() if args.json else text)


async def _create(svc: Any, args: argparse.Namespace) -> int:
    if args.create_missing:
        if await svc.get_tenant(args.tenant) is None:
            await svc.create_tenant(args.tenant)
        if args.team and not any(t.id == args.team for t in await svc.list_teams(args.tenant)):
            await svc.create_team(args.tenant, args.team)
        if args.team and args.project and not any(
                p.id == args.project for p in await svc.list_projects(args.tenant, args.team)):
            await svc.create_project(args.tenant, args.team, args.project)
        if args.partner and all(p.id != args.partner for p in await svc.list_partners()):
            await svc.create_partner(args.partner, args.tenant)
    k, secret = await svc.create_key(
        args.tenant, team=args.team, project=args.project, partner=args.partner, name=args.name,
        purpose="admin" if args.admin else "data", labels=_labels(args.label), scopes=args.scope,
        models=args.model, expires_at=(time.time() + args.expires_in) if args.expires_in else None)
    _show(args, {**k.public(), "key": secret},
          f"created key {k.id} for tenant {k.tenant}\n{secret}\n(store it now: it is not shown again)")
    return 0


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


async def _list(svc: Any, args: argparse.Namespace) -> int:
    ks = await svc.list_keys(args.tenant)
    now = time.time()
    rows = []
    for k in ks:
        state = "revoked" if k.revoked_at and k.revoked_at <= now else \
            "expired" if k.expires_at and k.expires_at <= now else "active"
        rows.append(f"{k.id}  {k.tenant:<16} {k.team or '-':<12} {k.purpose:<5} {state:<8} "
                    f"expires {_fmt_time(k.expires_at)}  {k.name}")
    _show(args, [k.public() for k in ks], "\n".join(rows) if rows else "(no keys)")
    return 0


async def _revoke(svc: Any, args: argparse.Namespace) -> int:
    k = await svc.revoke_key(args.key_id)
    if k is None:
        print(f"error: key {args.key_id} not found", file=sys.stderr)
        return 1
    _show(args, k.public(), f"revoked key {k.id}")
    return 0


async def _rotate(svc: Any, args: argparse.Namespace) -> int:
    res = await svc.rotate_key(args.key_id, args.overlap)
    if res is None:
        print(f"error: key {args.key_id} not found, revoked or already rotated", file=sys.stderr)
        return 1
    k, secret = res
    _show(args, {**k.public(), "key": secret},
          f"rotated {args.key_id} -> {k.id}\n{secret}\n(store it now: it is not shown again)")
    return 0
