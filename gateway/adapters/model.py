"""Adapter records and the pure decisions about them: whose an adapter is, which sources a tenant may register,
which names of a model chain a caller may use. No I/O here; the store and the stage call these."""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import msgspec

from gateway.types import Principal

# an adapter name is a model name clients send: no spaces, no control characters, nothing a URL path splits oddly
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
SOURCE_MAX = 2048
DESCRIPTION_MAX = 1024
RANK_MAX = 1024


class Adapter(msgspec.Struct, frozen=True):
    """A registered LoRA adapter: `name` is what clients send as `model`; the owner scope is tenant, and
    optionally team and project (narrower scopes own less)."""

    name: str
    base_model: str
    source: str
    tenant: str
    team: str | None = None
    project: str | None = None
    rank: int | None = None
    description: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0

    def public(self) -> dict[str, Any]:
        return {"object": "adapter", "id": self.name, "name": self.name, "base_model": self.base_model,
                "source": self.source,
                "owner": {"tenant": self.tenant, "team": self.team, "project": self.project},
                "rank": self.rank, "description": self.description, "created_at": self.created_at,
                "updated_at": self.updated_at}


def owns(p: Principal, a: Adapter) -> bool:
    """Is the caller inside the adapter's owner scope? Same tenant, and the owner's team/project when set."""
    if p.tenant != a.tenant:
        return False
    if a.team is not None and p.team != a.team:
        return False
    return a.project is None or p.project == a.project


def _segments_safe(source: str) -> bool:
    """No '.' or '..' path segment (a path under a prefix must stay under it once the engine resolves it) and
    no backslash or control character."""
    if "\\" in source or any(ord(c) < 32 or ord(c) == 127 for c in source):
        return False
    rest = source.split("://", 1)[-1]
    return not any(seg in (".", "..") for seg in rest.split("/"))


def source_allowed(source: str, prefixes: Iterable[str]) -> bool:
    """Is `source` under one of the granted prefixes? A prefix matches at a path boundary only: grant
    `/models/acme` covers `/models/acme/x` but not `/models/acme-evil/x` (a prefix ending in '/' is a boundary
    itself)."""
    if not source or not _segments_safe(source):
        return False
    for pre in prefixes:
        if not pre:
            continue
        if source == pre.rstrip("/") or (source.startswith(pre) and (pre.endswith("/") or source[len(pre)] == "/")):
            return True
    return False


def visible_chain(p: Principal, chain: tuple[str, ...], registry: Mapping[str, Adapter]) -> tuple[str, ...]:
    """The models of a chain this caller may use: every registered adapter outside its owner scope is dropped
    (as if it did not exist: the caller then gets the same 404 as for an unknown model)."""
    return tuple(m for m in chain if m not in registry or owns(p, registry[m]))
