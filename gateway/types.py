"""Shared value types of the request pipeline: who is calling (Principal), what policy decided (Decision), and
what a response used (Usage).

These are the contracts between stages: identity produces a Principal, policy turns a Principal and a
request into a Decision, budgets/routing/admission read the Decision; the wire translators fill a Usage that
budgets, cost and evidence read. All are plain data (Principal and Decision frozen) so decision functions stay pure
and tests can build them directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

from gateway.budget.dimensions import NAMES as DIMENSION_NAMES

PrincipalKind = Literal["static_key", "api_key", "jwt", "partner", "anonymous"]
Priority = Literal["realtime", "standard", "batch"]


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller. `labels` are merged tenant -> team -> project -> key (later levels win, but a
    restriction label set above is only ever tightened below: gateway/identity/restrictions.py)."""

    id: str  # stable id used in evidence and budgets, e.g. "key:ab12cd" or "jwt:issuer|sub"
    kind: PrincipalKind
    tenant: str
    team: str | None = None
    project: str | None = None
    key_id: str | None = None
    partner: str | None = None  # set when a partner (e.g. Opper) calls in on behalf of its end users
    end_user: str | None = None  # the partner's end-user id, from a header; recorded, never trusted for authz
    labels: Mapping[str, str] = field(default_factory=dict)
    scopes: tuple[str, ...] = ()
    allowed_models: tuple[str, ...] = ()  # glob patterns; empty = no key-level restriction
    roles: tuple[str, ...] = ()  # admin-plane roles, e.g. ("admin",) or ("tenant_admin",)

    def budget_scopes(self) -> list[tuple[str, str]]:
        """The hierarchy budgets are charged over, most specific first: key, project, team, tenant, partner."""
        out: list[tuple[str, str]] = []
        if self.key_id:
            out.append(("key", self.key_id))
        if self.project:
            out.append(("project", f"{self.tenant}/{self.team}/{self.project}"))
        if self.team:
            out.append(("team", f"{self.tenant}/{self.team}"))
        out.append(("tenant", self.tenant))
        if self.partner:
            out.append(("partner", self.partner))
        return out

    def to_evidence(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "tenant": self.tenant,
            "team": self.team,
            "project": self.project,
            "key_id": self.key_id,
            "partner": self.partner,
            "end_user": self.end_user,
            "labels": dict(self.labels),
        }


@dataclass(frozen=True, slots=True, init=False)
class BudgetSpec:
    """One budget a policy applies to a scope over a window: a limit in each budget dimension it names (requests,
    tokens, money in `currency`, gpu_seconds, concurrency: the table in gateway/budget/dimensions.py).

    `BudgetSpec(window="day", scope="team", tokens=10_000, money=5.0)`: the limits by dimension name (None: no
    limit); or `limits=` as (name, limit) pairs."""

    window: str  # "minute" | "hour" | "day" | "month" | "lifetime"
    scope: str  # "key" | "project" | "team" | "tenant" | "partner"
    limits: tuple[tuple[str, float], ...]  # (dimension, limit in its policy unit), in the table's order
    currency: str  # of a money limit
    rule_id: str | None

    def __init__(self, window: str, scope: str = "tenant", currency: str = "EUR", rule_id: str | None = None,
                 limits: Iterable[tuple[str, float]] = (), **by_name: float | None) -> None:
        pairs = (*limits, *by_name.items())
        unknown = {k for k, _ in pairs if k not in DIMENSION_NAMES}
        if unknown:
            raise TypeError(f"BudgetSpec: unknown budget dimension(s) {sorted(unknown)}; "
                            f"one of {', '.join(DIMENSION_NAMES)}")
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "scope", scope)
        given = {k: v for k, v in pairs if v is not None}
        object.__setattr__(self, "limits", tuple((n, given[n]) for n in DIMENSION_NAMES if n in given))
        object.__setattr__(self, "currency", currency)
        object.__setattr__(self, "rule_id", rule_id)

    def limit(self, dimension: str) -> float | None:
        """The limit in `dimension` (None: this budget does not limit it)."""
        for n, v in self.limits:
            if n == dimension:
                return v
        return None

    def to_evidence(self) -> dict[str, Any]:
        return {"window": self.window, "scope": self.scope, **{n: self.limit(n) for n in DIMENSION_NAMES},
                "currency": self.currency, "rule_id": self.rule_id}


@dataclass(frozen=True, slots=True)
class Decision:
    """What policy decided for one request. Residency fields are filters every later stage must obey."""

    allow: bool = True
    reason: str | None = None
    deny_rule: str | None = None
    matched_rules: tuple[str, ...] = ()
    # Residency: None = anywhere; otherwise the set of ISO-3166 alpha-2 countries allowed for inference
    # (and storage). "EEA" in policy is expanded to the EEA country set at compile time.
    allowed_countries: frozenset[str] | None = None
    jurisdiction: str | None = None  # human label for evidence, e.g. "EEA" or "DE,FR"
    residency_rule: str | None = None
    retention: Literal["zero"] | None = None  # "zero": only zero-retention backends; no content anywhere
    retention_rule: str | None = None
    max_tokens_cap: int | None = None
    max_context: int | None = None
    priority: Priority = "standard"
    ttft_slo_ms: float | None = None
    long_ttft_slo_ms: float | None = None  # TTFT target of a prompt the prefill guard counts as long; None: ttft_slo_ms
    # Fair queueing (docs/flow_control.md): the request's weight in its flow, and which principal level the flow is
    # (the scope of the most specific rule that set `share`: key, project, team, tenant or partner); see
    # gateway/routing/flowkey.py
    share: float = 1.0
    share_scope: str = "tenant"
    budgets: tuple[BudgetSpec, ...] = ()
    cache_isolation: bool = False
    spill_to_partner: bool = False
    cache: Any = None  # gateway.cache.spec.CacheSpec of the most specific rule that sets `cache`; None: off
    # Model restrictions from policy (globs): routing must not fall back to a model outside these.
    allowed_models: tuple[str, ...] = ()  # empty = no policy restriction
    denied_models: tuple[str, ...] = ()
    # The request's own provider preferences (gateway/policy/provider_prefs.py), tighten-only hard filters:
    providers_only: frozenset[str] | None = None  # backend names or operators the request accepts; None: any
    providers_ignored: frozenset[str] = frozenset()  # backend names or operators the request refuses
    no_fallbacks: bool = False  # one attempt only: a failed backend is not retried on another
    providers_order: tuple[str, ...] = ()  # backend names or operators to try first, in this order
    deny_status: int = 403  # 503 when the decision could not be made (e.g. OPA unreachable, fail-closed)

    def to_evidence(self) -> dict[str, Any]:
        return {
            "allow": self.allow,
            "reason": self.reason,
            "deny_rule": self.deny_rule,
            "matched_rules": list(self.matched_rules),
            "jurisdiction": self.jurisdiction,
            "allowed_countries": sorted(self.allowed_countries) if self.allowed_countries is not None else None,
            "residency_rule": self.residency_rule,
            "retention": self.retention,
            "priority": self.priority,
            "ttft_slo_ms": self.ttft_slo_ms,
            "long_ttft_slo_ms": self.long_ttft_slo_ms,
            "share": self.share,
            "share_scope": self.share_scope,
            "max_tokens_cap": self.max_tokens_cap,
            "cache_isolation": self.cache_isolation,
            "spill_to_partner": self.spill_to_partner,
            "max_context": self.max_context,
            "allowed_models": list(self.allowed_models),
            "denied_models": list(self.denied_models),
            "providers_only": sorted(self.providers_only) if self.providers_only is not None else None,
            "providers_ignored": sorted(self.providers_ignored),
            "no_fallbacks": self.no_fallbacks,
            "providers_order": list(self.providers_order),
            "budgets": [b.to_evidence() for b in self.budgets],
        }


@dataclass(slots=True)
class Usage:
    """Token counts of one response, as the upstream (or the gateway's estimate) reported them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
