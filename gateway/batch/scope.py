"""Who owns batch files and batches.

**Ownership** is the full principal scope that policy tells apart: tenant, team, project, partner and the
restriction labels of the principal (`residency`, `retention` and every label a restricting rule of the loaded
policy matches on: gateway/identity/restrictions.py). Two principals share files and batches only when all of
these are equal: a partner and its tenant, two partners of one tenant, or two keys of one project whose
restriction labels differ, each see only their own. `owner_of` writes the scope as one string; a principal with
no partner and no restriction label gets `tenant/team/project`, the form every row was written with before the
partner and labels were part of it, so such rows stay with exactly that scope.
"""
from __future__ import annotations

from typing import Iterable
from urllib.parse import quote

from gateway.types import Principal

ALWAYS_RESTRICTED = ("residency", "retention")


def _q(v: str) -> str:
    """One scope component, escaped so that no id or label can forge another scope's string ("-" alone means
    "none" in the legacy form, so a component that is literally "-" is escaped too)."""
    return "%2D" if v == "-" else quote(v, safe="")


def owner_of(p: Principal, restricted: Iterable[str] = ALWAYS_RESTRICTED) -> str:
    """The owner scope of what `p` creates: `tenant/team/project`, then `;partner=<id>` for a partner and
    `;labels=k=v,...` (sorted) for the restriction labels it carries."""
    out = f"{_q(p.tenant)}/{_q(p.team) if p.team else '-'}/{_q(p.project) if p.project else '-'}"
    if p.partner:
        out += f";partner={_q(p.partner)}"
    names = set(restricted)
    labels = sorted((k, v) for k, v in p.labels.items() if k in names)
    if labels:
        out += ";labels=" + ",".join(f"{_q(k)}={_q(v)}" for k, v in labels)
    return out
