"""Run the `tests:` sections of policy files (like `opa test`): given principal + request, expect a decision."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.policy.engine import CompiledPolicy
from gateway.policy.model import RequestAttrs
from gateway.types import Decision, Principal


@dataclass(frozen=True, slots=True)
class PolicyTestResult:
    name: str
    where: str  # file:line
    ok: bool
    failures: tuple[str, ...]
    decision: Decision


def given_to_inputs(given: dict[str, Any]) -> tuple[Principal, RequestAttrs]:
    """A test's `given` as the principal and request the engine sees."""
    partner = given.get("partner")
    tenant = given.get("tenant") or partner or "default"
    key = given.get("key")
    p = Principal(id=f"key:{key}" if key else f"test:{tenant}", kind=given.get("kind", "partner" if partner else "api_key"),
                  tenant=tenant, team=given.get("team"), project=given.get("project"), key_id=key, partner=partner,
                  labels=dict(given.get("labels") or {}), scopes=tuple(given.get("scopes") or ()))
    now = datetime.fromisoformat(given["time"].replace("Z", "+00:00")).timestamp() if given.get("time") else 1.7e9
    req = RequestAttrs(model=given["model"], headers={k.lower(): v for k, v in (given.get("headers") or {}).items()},
                       max_tokens=given.get("max_tokens"), stream=bool(given.get("stream", False)), now=now)
    return p, req


def check_expectation(d: Decision, expect: dict[str, Any]) -> list[str]:
    fails: list[str] = []
    for k, want in expect.items():
        if k == "matched_rules":
            missing = [r for r in want if r not in d.matched_rules]
            if missing:
                fails.append(f"expected rules {missing} to match; matched {list(d.matched_rules)}")
        elif k == "not_matched_rules":
            extra = [r for r in want if r in d.matched_rules]
            if extra:
                fails.append(f"expected rules {extra} not to match")
        elif k == "budget_rules":
            got = sorted({b.rule_id for b in d.budgets if b.rule_id})
            if got != sorted(want):
                fails.append(f"budget_rules: expected {sorted(want)}, got {got}")
        else:
            got = getattr(d, k)
            if got != want:
                why = f" (reason: {d.reason})" if k == "allow" and d.reason else ""
                fails.append(f"{k}: expected {want!r}, got {got!r}{why}")
    return fails


def run_tests(policy: CompiledPolicy) -> list[PolicyTestResult]:
    out: list[PolicyTestResult] = []
    for i, (source, line, t) in enumerate(policy.tests):
        p, req = given_to_inputs(t["given"])
        d = policy.decide(p, req)
        fails = check_expectation(d, t["expect"])
        out.append(PolicyTestResult(t.get("name") or f"test #{i + 1}", f"{source}:{line}", not fails, tuple(fails), d))
    return out
