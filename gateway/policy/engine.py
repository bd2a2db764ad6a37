"""Evaluate compiled rules for one request: a pure function from (Principal, RequestAttrs) to a Decision.

Precedence (docs/policy.md): deny wins over allow; restrictions compose (jurisdictions intersect, zero
retention sticks, allowed-model lists all apply, cache isolation sticks, budgets add up); for values that
can only have one setting (priority, TTFT target, max_tokens cap, max context) the most specific matching
rule wins and ties go to the earlier rule. Rules are bucketed by their most selective exact match key so a
request only tests the rules that could match it.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Iterable

from gateway.policy.eea import EEA_COUNTRIES, EU_COUNTRIES
from gateway.policy.model import Condition, RequestAttrs, Rule
from gateway.types import BudgetSpec, Decision, Principal

__all__ = ["CompiledPolicy", "RequestAttrs"]  # load_policies and PolicyError live in gateway.policy.compiler


def _jurisdiction_label(countries: frozenset[str]) -> str:
    if countries == EEA_COUNTRIES:
        return "EEA"
    if countries == EU_COUNTRIES:
        return "EU"
    return ",".join(sorted(countries)) if countries else "(none)"


class CompiledPolicy:
    """An immutable compiled policy snapshot; `decide` is pure and allocation-light."""

    def __init__(self, rules: list[Rule], default_allow: bool = True,
                 tests: list[tuple[str, int, dict[str, Any]]] | None = None, sources: tuple[str, ...] = ()) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.default_allow = default_allow
        self.tests = list(tests or [])
        self.sources = sources
        self._by_id = {r.id: r for r in rules}
        self._build_index(rules)
        self._combined: dict[tuple[Any, ...], Decision] = {}

    # Each rule is filed under its "signature": the exact-valued dimensions it matches on (e.g. tenant+team),
    # keyed by the value combination. A request looks up each signature once with its own values, so it only
    # sees rules whose exact conditions already hold; only the rest of their conditions are tested.
    _MAX_COMBOS = 64

    def _build_index(self, rules: list[Rule]) -> None:
        sigs: dict[tuple[str, ...], dict[Any, list[tuple[int, Rule, tuple[Any, ...]]]]] = {}
        wild: list[tuple[int, Rule, tuple[Any, ...]]] = []
        for r in rules:
            idx = [c for c in r.conditions if c.dim is not None and c.exact is not None]
            idx.sort(key=lambda c: c.dim or "")
            combos = 1
            chosen: list[Condition] = []
            for c in idx:
                if combos * len(c.exact or ()) <= self._MAX_COMBOS and all(c.dim != x.dim for x in chosen):
                    chosen.append(c)
                    combos *= len(c.exact or ())
            residual = tuple(c.test for c in r.conditions if c not in chosen)
            if not chosen:
                wild.append((r.order, r, residual))
                continue
            sig = tuple(c.dim or "" for c in chosen)
            keys: list[tuple[str, ...]] = [()]
            for c in chosen:
                keys = [k + (v,) for k in keys for v in sorted(c.exact or ())]
            table = sigs.setdefault(sig, {})
            for k in keys:
                table.setdefault(k[0] if len(k) == 1 else k, []).append((r.order, r, residual))
        self._wild = tuple(wild)
        self._sigs = tuple((sig, _getter(sig), {k: tuple(v) for k, v in t.items()}) for sig, t in sigs.items())

    def rule(self, rule_id: str) -> Rule:
        return self._by_id[rule_id]

    def setting_rule(self, decision: Decision, key: str) -> str | None:
        """The id of the rule that gave `decision` its single value `key` (a Decision field set by `set`, e.g.
        "max_context"): the most specific matched rule that sets it, ties by order, as `_combine` chose it.
        None when no matched rule of this snapshot sets it. Only called on rare paths (a refusal naming it)."""
        best: Rule | None = None
        for rid in decision.matched_rules:
            r = self._by_id.get(rid)
            if r is not None and key in r.sets and (best is None or r.rank > best.rank):
                best = r
        return best.id if best is not None else None

    # ------------------------------------------------------------------------------------------- evaluation

    def _entries(self, p: Principal, req: RequestAttrs) -> list[tuple[int, Rule, tuple[Any, ...]]]:
        got = list(self._wild)
        lists = 1 if got else 0
        for _sig, get, table in self._sigs:
            lst = table.get(get(p, req))
            if lst:
                got.extend(lst)
                lists += 1
        if lists > 1:
            got.sort(key=_first)
        return got

    def candidates(self, p: Principal, req: RequestAttrs) -> list[Rule]:
        """Rules whose indexed conditions hold (plus unindexed rules), in rule order."""
        return [e[1] for e in self._entries(p, req)]

    def matched(self, p: Principal, req: RequestAttrs) -> list[Rule]:
        out = []
        for _o, rule, residual in self._entries(p, req):
            for t in residual:
                if not t(p, req):
                    break
            else:
                out.append(rule)
        return out

    def decide(self, principal: Principal, request: RequestAttrs) -> Decision:
        """The decision for one request. Pure: same inputs, same Decision (combinations are memoized)."""
        matched = self.matched(principal, request)
        key = (tuple(r.order for r in matched), request.model)
        d = self._combined.get(key)
        if d is None:
            d = self._combine(matched, request.model)
            if len(self._combined) >= 65536:
                self._combined.clear()
            self._combined[key] = d
        return d

    def _combine(self, matched: list[Rule], model: str) -> Decision:
        deny: Rule | None = None
        deny_reason: str | None = None
        explicit_allow = False
        countries: frozenset[str] | None = None
        residency_rules: list[str] = []
        retention_rule: str | None = None
        allowed: list[str] = []  # the most specific restricting rule's list (every list is enforced above)
        allowed_rank: tuple[int, int, int] | None = None
        denied: list[str] = []
        cache_iso = False
        best: dict[str, tuple[tuple[int, int, int], Any]] = {}
        budgets: list[BudgetSpec] = []
        for r in matched:
            reason = None
            if r.deny:
                reason = r.reason or f"denied by rule {r.id}"
            elif r.deny_models_re is not None and r.deny_models_re.match(model):
                reason = r.reason or f"model {model} is denied by rule {r.id}"
            elif r.allowed_models_re is not None and not r.allowed_models_re.match(model):
                reason = r.reason or f"model {model} is not among the models rule {r.id} allows"
            if reason is not None and (deny is None or r.rank > deny.rank):
                deny, deny_reason = r, reason
            if r.allow:
                explicit_allow = True
            if r.countries is not None:
                countries = r.countries if countries is None else countries & r.countries
                residency_rules.append(r.id)
            if r.retention_zero and retention_rule is None:
                retention_rule = r.id
            if r.allowed_models and (allowed_rank is None or r.rank > allowed_rank):
                allowed, allowed_rank = list(r.allowed_models), r.rank
            if r.deny_models:
                denied.extend(r.deny_models)
            if r.cache_isolation:
                cache_iso = True
            if r.sets:
                rank = r.rank
                for k, v in r.sets.items():
                    cur = best.get(k)
                    if cur is None or rank > cur[0]:
                        best[k] = (rank, v)
            if r.budgets:
                budgets.extend(r.budgets)
        if countries is not None and not countries and deny is None:
            deny = self._by_id[residency_rules[-1]]
            deny_reason = (f"contradictory residency: rules {', '.join(residency_rules)} together allow no country")
        ids = tuple(r.id for r in matched)
        allow = deny is None
        deny_rule = deny.id if deny is not None else None
        if allow and not self.default_allow and not explicit_allow:
            allow, deny_rule = False, "(default)"
            deny_reason = "no rule allows this request and the policy default is deny"
        kw: dict[str, Any] = {k: v[1] for k, v in best.items()}
        return Decision(
            allow=allow, reason=deny_reason, deny_rule=deny_rule, matched_rules=ids,
            allowed_countries=countries,
            jurisdiction=_jurisdiction_label(countries) if countries is not None else None,
            residency_rule=",".join(residency_rules) if residency_rules else None,
            retention="zero" if retention_rule else None, retention_rule=retention_rule,
            cache_isolation=cache_iso, budgets=tuple(budgets), allowed_models=tuple(allowed),
            denied_models=tuple(denied), **kw,
        )

    # ------------------------------------------------------------------------------------------- explain

    def explain(self, principal: Principal, request: RequestAttrs) -> dict[str, Any]:
        """Why this principal gets this decision for this model: every rule, matched or not, and why."""
        trace: list[dict[str, Any]] = []
        matched: list[Rule] = []
        for r in self.rules:
            failed = [c.describe for c in r.conditions if not c.test(principal, request)]
            if not failed:
                matched.append(r)
            trace.append({"rule": r.id, "source": r.source, "matched": not failed, "failed": failed,
                          "specificity": list(r.specificity)})
        d = self._combine(matched, request.model)
        return {"principal": principal.to_evidence(), "request": request.to_evidence(),
                "decision": d.to_evidence(), "rules": trace,
                "precedence": "deny wins; restrictions intersect; single values from the most specific rule, "
                              "ties by order"}


def _first(e: tuple[int, Any, Any]) -> int:
    return e[0]


def _getter(sig: tuple[str, ...]) -> Any:
    """A function (principal, request) -> the bucket key for a signature (a value, or a tuple of values)."""
    def one(dim: str) -> Any:
        if dim == "model":
            return lambda p, r: r.model
        if dim.startswith("label:"):
            k = dim[6:]
            return lambda p, r: p.labels.get(k)
        attr = {"key": "key_id"}.get(dim, dim)
        return lambda p, r: getattr(p, attr)

    gs = [one(d) for d in sig]
    if len(gs) == 1:
        return gs[0]
    if len(gs) == 2:
        g0, g1 = gs
        return lambda p, r: (g0(p, r), g1(p, r))
    return lambda p, r: tuple(g(p, r) for g in gs)


def model_permitted(decision: Decision, model: str) -> bool:
    """Whether a concrete model (e.g. an alias fallback target) is within the decision's model limits."""
    if decision.denied_models and any(fnmatch.fnmatchcase(model, g) for g in decision.denied_models):
        return False
    if decision.allowed_models and not any(fnmatch.fnmatchcase(model, g) for g in decision.allowed_models):
        return False
    return True


def principal_models_permit(patterns: Iterable[str], model: str) -> bool:
    """A key's own `allowed_models` globs (empty = unrestricted)."""
    pats = tuple(patterns)
    return not pats or any(fnmatch.fnmatchcase(model, g) for g in pats)
