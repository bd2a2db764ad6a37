"""`gateway policy check|test|explain|schema`: validate policies, run their tests, explain one decision, print
(or rewrite) the policy schema."""
from __future__ import annotations

import argparse
import glob
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from gateway.budget.dimensions import DIMENSIONS
from gateway.policy.compiler import SCHEMA_RESOURCE, PolicyError, load_policies, load_schema, write_schema
from gateway.policy.model import RequestAttrs
from gateway.routing.flowkey import flow_id
from gateway.types import Decision, Principal


def policy_paths(config: Any) -> list[Path]:
    """The policy files a config snapshot names (`policy.files`, globs relative to the config file)."""
    out: list[Path] = []
    for pat in config.raw.policy.files:
        full = str(config.resolve_path(pat))
        hits = sorted(glob.glob(full)) if any(c in pat for c in "*?[") else [full]
        out.extend(Path(h) for h in hits)
    return out


def load_for_config(config: Any):  # -> CompiledPolicy
    """Compile the policies of a config snapshot (call on every config reload and swap the result).

    A budget dimension the config cannot enforce (its `needs` in gateway/budget/dimensions.py: GPU-seconds need
    the cost meter, which measures what they are settled with) makes a rule limiting it an error at load (and
    reload), never a limit that silently never binds."""
    pol = load_policies(policy_paths(config), default_allow=config.raw.policy.default_allow)
    unmet = [(d.name, why) for d in DIMENSIONS if d.needs is not None and (why := d.needs(config)) is not None]
    bad = [f"{r.source}: rule {r.id!r}: budgets: {name} {why}"
           for r in pol.rules for name, why in unmet if any(b.limit(name) is not None for b in r.budgets)]
    if bad:
        raise PolicyError(bad)
    return pol


def _paths(args: argparse.Namespace) -> list[Path]:
    if args.paths:
        return [Path(p) for p in args.paths]
    if args.config:
        from gateway.config import load_config

        return policy_paths(load_config(args.config))
    return [Path("policies")]


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        pol = load_policies(_paths(args))
    except PolicyError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        print(f"{len(e.errors)} error(s)", file=sys.stderr)
        return 1
    print(f"ok: {len(pol.rules)} rules, {len(pol.tests)} tests in {len(pol.sources)} file(s)")
    return 0


def _cmd_test(args: argparse.Namespace) -> int:
    from gateway.policy.testing import run_tests

    try:
        pol = load_policies(_paths(args))
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    results = run_tests(pol)
    failed = [r for r in results if not r.ok]
    for r in results:
        if not r.ok or args.verbose:
            print(f"{'PASS' if r.ok else 'FAIL'}: {r.where}: {r.name}")
            for f in r.failures:
                print(f"    {f}")
    print(f"{len(results) - len(failed)}/{len(results)} policy tests passed")
    return 1 if failed else 0


def _principal_from_args(args: argparse.Namespace) -> Principal:
    tenant, team, project, key_id, partner = args.tenant, args.team, args.project, args.key_id, args.partner
    labels: dict[str, str] = dict(kv.split("=", 1) for kv in args.label)
    scopes = list(args.scope)
    models: tuple[str, ...] = ()
    if args.key and args.config:  # a static key from the gateway config, by name
        from gateway.config import load_config

        cfg = load_config(args.config)
        for i, sk in enumerate(cfg.raw.keys):
            if args.key in (sk.name, f"keys[{i}]"):
                tenant, team = tenant or sk.tenant, team or sk.team
                project, partner = project or sk.project, partner or sk.partner
                labels = {**sk.labels, **labels}
                scopes = scopes or list(sk.scopes)
                models = tuple(sk.models)
                key_id = key_id or sk.name
                break
        else:
            raise SystemExit(f"no key named {args.key!r} in {args.config}")
    return Principal(id=f"key:{key_id}" if key_id else "cli", kind="partner" if partner else "api_key",
                     tenant=tenant or partner or "default", team=team, project=project, key_id=key_id,
                     partner=partner, labels=labels, scopes=tuple(scopes), allowed_models=models)


def _model_chain(args: argparse.Namespace) -> tuple[str, ...]:
    """The models `args.model` resolves to under --config (an alias's targets), else ()."""
    if not args.config:
        return ()
    from gateway.config import load_config

    return load_config(args.config).resolve_model(args.model)


def _cmd_explain(args: argparse.Namespace) -> int:
    from gateway.identity.stage import model_allowed  # the one meaning of a key's model list (the gateway's)

    try:
        pol = load_policies(_paths(args))
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    p = _principal_from_args(args)
    now = datetime.fromisoformat(args.time.replace("Z", "+00:00")).timestamp() if args.time else datetime.now().timestamp()
    req = RequestAttrs(model=args.model, headers={k.lower(): v for k, v in (h.split("=", 1) for h in args.header)},
                       max_tokens=args.max_tokens, stream=args.stream, now=now)
    out = pol.explain(p, req)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    d = out["decision"]
    print(f"decision: {'ALLOW' if d['allow'] else 'DENY'}" + (f" by {d['deny_rule']}: {d['reason']}" if not d["allow"] else ""))
    if p.allowed_models and not model_allowed(p, args.model, _model_chain(args)):
        print(f"  but the key's own model list {list(p.allowed_models)} excludes {args.model} (403 model_not_allowed)")
    for k in ("jurisdiction", "retention", "priority", "ttft_slo_ms", "long_ttft_slo_ms", "max_tokens_cap",
              "max_context", "cache_isolation"):
        if d.get(k) not in (None, False):
            print(f"  {k}: {d[k]}")
    if d.get("share", 1.0) != 1.0 or d.get("share_scope", "tenant") != "tenant":
        print(f"  share: {d['share']:g} (flow: {d['share_scope']}, {flow_id(p, Decision(share_scope=d['share_scope']))})")
    for b in d["budgets"]:
        print(f"  budget: {b}")
    print("rules (precedence: " + out["precedence"] + "):")
    for r in out["rules"]:
        if r["matched"]:
            print(f"  MATCH {r['rule']} ({r['source']}, specificity {r['specificity']})")
        elif args.all:
            print(f"  skip  {r['rule']} ({r['source']}): not {'; not '.join(r['failed'])}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    if args.write:
        changed = write_schema()
        print(f"{SCHEMA_RESOURCE}: {'budget object rewritten' if changed else 'already in step'}")
        return 0
    print(json.dumps(load_schema(), indent=2, ensure_ascii=False))
    return 0


def add_policy_commands(subparsers: Any) -> None:
    """Register `policy check|test|explain` on the gateway CLI's subparsers."""
    pp = subparsers.add_parser("policy", help="check, test and explain policies")
    sub = pp.add_subparsers(dest="policy_cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("paths", nargs="*", help="policy files or directories (default: policy.files of --config, else policies/)")
        p.add_argument("--config", "-c", help="gateway config file")

    c = sub.add_parser("check", help="schema + semantic errors with file:line")
    common(c)
    c.set_defaults(func=_cmd_check)
    t = sub.add_parser("test", help="run the tests: sections of the policy files")
    common(t)
    t.add_argument("-v", "--verbose", action="store_true")
    t.set_defaults(func=_cmd_test)
    e = sub.add_parser("explain", help="why would this principal get this decision for this model")
    common(e)
    e.add_argument("--model", "-m", required=True)
    e.add_argument("--key", help="static key name from --config")
    e.add_argument("--key-id")
    e.add_argument("--tenant")
    e.add_argument("--team")
    e.add_argument("--project")
    e.add_argument("--partner")
    e.add_argument("--label", action="append", default=[], help="k=v")
    e.add_argument("--scope", action="append", default=[])
    e.add_argument("--header", action="append", default=[], help="name=value")
    e.add_argument("--max-tokens", type=int)
    e.add_argument("--stream", action="store_true")
    e.add_argument("--time", help="ISO 8601 time of the request (default now)")
    e.add_argument("--all", action="store_true", help="also list rules that did not match, and why")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_explain)
    s = sub.add_parser("schema", help="print the policy schema (its budget object from the budget dimensions)")
    s.add_argument("--write", action="store_true",
                   help="rewrite the budget object of gateway/policy/schema.json from the budget dimensions' table")
    s.set_defaults(func=_cmd_schema)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gateway")
    add_policy_commands(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
