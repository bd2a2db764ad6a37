"""The rollout part of an alias's config: weighted targets, what keeps a user on one arm, rollback thresholds."""
from __future__ import annotations

from typing import Any

import msgspec


class ShadowConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A shadow target gets a sampled copy of the alias's requests; its answer is discarded (docs/rollouts.md)."""

    budget_scope: str  # the tenant whose budgets and ledger the copies are charged to (its policy rules apply)
    sample: float = 0.1  # the share of the alias's answered requests copied, in (0, 1]
    max_inflight: int = 32  # copies in flight per process at most; past it a copy is skipped, never queued


class AliasTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One arm of a weighted alias: `{model: support-v2, weight: 5}`, or a shadow: `{model, shadow: {...}}`."""

    model: str
    weight: float = 0.0  # the arm's share is weight / sum(weights) (live weights: /admin/aliases)
    stable: bool = False  # the arm the others are compared against; none marked: the highest weight
    shadow: ShadowConfig | None = None  # a shadow target: never chosen, never a fallback, never answers a client


class StickyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a request is hashed by to pick its arm, first present wins: the conversation header, the partner's
    end-user id (identity.end_user_header), the OpenAI `user` field, else the API key (so one key stays put)."""

    header: str | None = "x-conversation-id"  # null: no conversation header


class RollbackConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When an arm is rolled back (weight 0) against the stable arm over a sliding window."""

    enabled: bool = True
    window_s: float = 60.0  # outcomes older than this are forgotten
    min_requests: int = 20  # an arm (and the stable arm) needs this many in the window before it is judged
    error_rate_ratio: float = 3.0  # rolled back when its error rate > ratio x the stable arm's ...
    error_rate_margin: float = 0.05  # ... and more than the stable arm's + this absolute margin
    ttft_p90_ratio: float = 2.0  # rolled back when its TTFT p90 > ratio x the stable arm's ...
    ttft_p90_margin_s: float = 0.1  # ... and more than the stable arm's + this many seconds


def is_weighted(targets: list[Any]) -> bool:
    return any(isinstance(t, AliasTarget) for t in targets)


def _shadow_error(t: AliasTarget) -> tuple[str, str] | None:
    sh = t.shadow
    assert sh is not None
    if t.weight != 0 or t.stable:
        return "shadow", "a shadow target has no weight and is never the stable arm"
    if not 0 < sh.sample <= 1:
        return "shadow.sample", "must be in (0, 1]"
    if not sh.budget_scope.strip():
        return "shadow.budget_scope", "must name the tenant the copies are charged to"
    if sh.max_inflight < 1:
        return "shadow.max_inflight", "must be >= 1"
    return None


def alias_error(alias: Any) -> tuple[str, str] | None:
    """(key path within the alias, problem) for a rollout setting that cannot be used, else None."""
    ts = alias.targets
    if is_weighted(ts):
        for j, t in enumerate(ts):
            if not isinstance(t, AliasTarget):
                return f"targets[{j}]", "a weighted alias needs {model, weight} for every target"
            if t.weight < 0 or t.weight != t.weight or t.weight == float("inf"):
                return f"targets[{j}].weight", "must be a finite number >= 0"
        for j, t in enumerate(ts):
            if t.shadow is not None:
                bad = _shadow_error(t)
                if bad is not None:
                    return f"targets[{j}].{bad[0]}", bad[1]
        if sum(t.weight for t in ts if t.shadow is None) <= 0:
            return "targets", "a weighted alias needs at least one weight > 0"
        if sum(1 for t in ts if t.stable) > 1:
            return "targets", "at most one target may be marked stable"
        if len({t.model for t in ts}) != len(ts):
            return "targets", "each model may be one arm only"
    rb = alias.rollback
    if rb.window_s <= 0:
        return "rollback.window_s", "must be > 0 (seconds)"
    if rb.min_requests < 1:
        return "rollback.min_requests", "must be >= 1"
    if rb.error_rate_ratio < 1 or rb.ttft_p90_ratio < 1:
        return "rollback", "ratios must be >= 1"
    if rb.error_rate_margin < 0 or rb.ttft_p90_margin_s < 0:
        return "rollback", "margins must be >= 0"
    return None
