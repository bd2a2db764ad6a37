"""The compiled form of policy rules: plain frozen data plus precompiled predicates, built once per snapshot.

`RequestAttrs` is what a rule can see of a request besides the principal. `Rule` holds one compiled rule:
its conditions (small predicates over principal + request), its effects, and its precedence key.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Pattern

from gateway.types import BudgetSpec, Principal

Predicate = Callable[[Principal, "RequestAttrs"], bool]


@dataclass(frozen=True, slots=True)
class RequestAttrs:
    """The request-side facts a policy may match on. `headers` keys are lower-case."""

    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    max_tokens: int | None = None
    stream: bool = False
    now: float = field(default_factory=time.time)  # unix seconds

    def to_evidence(self) -> dict[str, Any]:
        return {"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream, "now": self.now}


@dataclass(frozen=True, slots=True)
class Condition:
    """One test of a rule's `match`: `name` as written in YAML, `describe` for explain output."""

    name: str
    describe: str
    test: Predicate
    # For exact-valued conditions the index can serve: the dimension ("tenant", "label:tier", "model", ...)
    # and the accepted values. A rule found in that index bucket needs no further test of this condition.
    dim: str | None = None
    exact: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled rule. `order` is its global position (files in the given order, rules in file order)."""

    id: str
    order: int
    source: str  # "file:line"
    conditions: tuple[Condition, ...]
    specificity: tuple[int, int]  # (principal level, number of conditions); higher = more specific
    allow: bool = False  # explicit allow (matters when the default is deny)
    deny: bool = False  # deny every matching request
    deny_models: tuple[str, ...] = ()
    deny_models_re: Pattern[str] | None = None
    allowed_models: tuple[str, ...] = ()
    allowed_models_re: Pattern[str] | None = None
    countries: frozenset[str] | None = None
    jurisdiction: str | None = None
    retention_zero: bool = False
    sets: Mapping[str, Any] = field(default_factory=dict)  # priority, ttft_slo_ms, max_tokens_cap, ...
    cache_isolation: bool = False
    budgets: tuple[BudgetSpec, ...] = ()
    reason: str | None = None
    match_key: str = ""  # canonical form of `match`, to find rules with identical conditions

    @property
    def rank(self) -> tuple[int, int, int]:
        """Precedence: more specific first, then earlier order (ties by order)."""
        return (self.specificity[0], self.specificity[1], -self.order)

    def matches(self, principal: Principal, req: RequestAttrs) -> bool:
        for c in self.conditions:
            if not c.test(principal, req):
                return False
        return True
