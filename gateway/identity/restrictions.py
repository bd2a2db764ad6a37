"""Restriction labels: labels a higher scope sets that lower scopes may tighten but never loosen.

Labels are merged tenant -> partner -> team -> project -> key (or the JWT's labels claim). For ordinary labels
the lower level wins. A *restriction* label is one whose value limits where or how a request may be served:

* always `residency` and `retention`;
* every label the loaded policy matches on (`match: {labels.X: ...}`) in a rule that restricts: `require`
  (jurisdiction, retention), `deny` (all or some models), an allowed-model list (`set.models`) or budgets.

For those the merge keeps the higher scope's value unless the lower one is at least as tight, so no record
below (created by whoever, already in the database, or a token claim) can lift what the tenant set. A lower
value is at least as tight as a higher one when both hold:

1. the label's own order allows it:
   - `retention`: `zero` (also `0`, `0d`) < `<N>d` (N days, smaller is tighter) < `none` (no limit);
   - `residency`: a region set, `eea` (EEA countries), `eu` (EU countries), ISO country codes, or a comma list
     of them; narrower is tighter (a subset), `none`/`any` is every country;
   - values outside these forms, and every other restriction label: only the same value;
2. every restricting policy rule whose condition on that label accepts the higher value also accepts the lower
   one (restrictions compose, so the lower value keeps every restriction the higher one triggered). With the
   example policy `residency: eea -> EEA + zero retention` and `residency: de -> DE`, `de` below `eea` is refused:
   it would drop the zero-retention requirement.

Absent at the higher scope, a restriction may be set freely below (it adds restrictions). The admin API and the
CLI refuse a lower record that would loosen (403 `restriction_loosened`, naming the label); the merge enforces
the same order at decision time.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

from gateway.policy.eea import EEA_COUNTRIES, EU_COUNTRIES, ISO_3166_ALPHA2
from gateway.types import Principal

ALWAYS = ("residency", "retention")
_DAYS = re.compile(r"^([0-9]{1,6})d$")
_ANY = ("none", "any", "")
_PROBE = Principal(id="restriction-probe", kind="api_key", tenant="-")


def retention_days(value: str) -> float | None:
    """zero -> 0, '<N>d' -> N, none/any -> inf; None for a value outside the order."""
    v = value.strip().lower()
    if v in ("zero", "0", "0d"):
        return 0.0
    if v in _ANY:
        return math.inf
    m = _DAYS.match(v)
    return float(m.group(1)) if m else None


def residency_countries(value: str) -> frozenset[str] | None:
    """The countries a residency value allows (all of ISO 3166 for none/any); None outside the order."""
    v = value.strip().lower()
    if v in _ANY:
        return ISO_3166_ALPHA2
    out: set[str] = set()
    for part in v.split(","):
        p = part.strip()
        if p == "eea":
            out |= EEA_COUNTRIES
        elif p == "eu":
            out |= EU_COUNTRIES
        elif p.upper() in ISO_3166_ALPHA2 and len(p) == 2:
            out.add(p.upper())
        else:
            return None
    return frozenset(out)


def _order_allows(label: str, lower: str, higher: str) -> bool:
    if lower == higher:
        return True
    if label == "retention":
        lo, hi = retention_days(lower), retention_days(higher)
        return lo is not None and hi is not None and lo <= hi
    if label == "residency":
        lo_c, hi_c = residency_countries(lower), residency_countries(higher)
        return lo_c is not None and hi_c is not None and lo_c <= hi_c
    return False


def _restricting(rule: Any) -> bool:
    return bool(rule.countries is not None or rule.retention_zero or rule.deny or rule.deny_models
                or rule.allowed_models or rule.budgets)


class Restrictions:
    """The restriction labels of one policy snapshot and their tightening order. Immutable."""

    def __init__(self, policy: Any = None) -> None:
        conds: dict[str, list[tuple[str, Any]]] = {}
        for rule in policy.rules if policy is not None else ():
            if not _restricting(rule):
                continue
            for c in rule.conditions:
                name = c.name
                if name.startswith("labels."):
                    conds.setdefault(name[len("labels."):], []).append((rule.id, c))
        self._conds = conds
        self.labels: frozenset[str] = frozenset(ALWAYS) | frozenset(conds)

    def _fired(self, label: str, value: str) -> frozenset[str]:
        probe = Principal(id=_PROBE.id, kind=_PROBE.kind, tenant=_PROBE.tenant, labels={label: value})
        return frozenset(rid for rid, c in self._conds.get(label, ()) if c.test(probe, None))

    def at_least_as_tight(self, label: str, lower: str, higher: str) -> bool:
        """Whether `lower` (set below) keeps every restriction `higher` (set above) imposes."""
        if lower == higher:
            return True
        return _order_allows(label, lower, higher) and self._fired(label, higher) <= self._fired(label, lower)

    def merge(self, *levels: Mapping[str, str] | None) -> dict[str, str]:
        """Labels merged top (tenant) to bottom (key): later levels win, except that a restriction label keeps
        the value above it unless the lower one is at least as tight."""
        out: dict[str, str] = {}
        for lv in levels:
            if not lv:
                continue
            for k, v in lv.items():
                cur = out.get(k)
                if cur is None or k not in self.labels or self.at_least_as_tight(k, v, cur):
                    out[k] = v
        return out

    def loosened(self, above: Mapping[str, str], labels: Mapping[str, str] | None) -> str | None:
        """The first restriction label of `labels` that would loosen what `above` (the merged parents) sets."""
        for k, v in sorted((labels or {}).items()):
            cur = above.get(k)
            if cur is not None and k in self.labels and not self.at_least_as_tight(k, v, cur):
                return k
        return None

    def describe(self) -> Iterable[str]:
        return sorted(self.labels)


DEFAULT = Restrictions()
