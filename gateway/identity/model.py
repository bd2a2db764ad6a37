"""Identity records as stored: tenant -> team -> project -> API key, plus partners. Plain frozen data."""
from __future__ import annotations

from typing import Any

import msgspec


class Tenant(msgspec.Struct, frozen=True):
    id: str
    name: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float = 0.0


class Team(msgspec.Struct, frozen=True):
    tenant: str
    id: str
    name: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float = 0.0


class Project(msgspec.Struct, frozen=True):
    tenant: str
    team: str
    id: str
    name: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float = 0.0


class Partner(msgspec.Struct, frozen=True):
    """An aggregator calling on behalf of its own end users; its traffic is charged to `tenant`."""

    id: str
    tenant: str
    name: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float = 0.0


class ApiKey(msgspec.Struct, frozen=True):
    """A stored key. `purpose` "data" keys call the model API; "admin" keys are tenant-admin credentials."""

    id: str
    tenant: str
    secret_hash: str
    team: str | None = None
    project: str | None = None
    partner: str | None = None
    name: str = ""
    purpose: str = "data"  # "data" | "admin"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    scopes: list[str] = msgspec.field(default_factory=list)
    models: list[str] = msgspec.field(default_factory=list)
    created_at: float = 0.0
    expires_at: float | None = None
    revoked_at: float | None = None
    rotated_from: str | None = None
    rotated_to: str | None = None

    def public(self) -> dict[str, Any]:
        """The key as the admin API shows it: everything but the hash."""
        d = msgspec.structs.asdict(self)
        d.pop("secret_hash")
        d["prefix"] = f"gw_{self.id}_"
        return d


def to_dict(rec: msgspec.Struct) -> dict[str, Any]:
    if isinstance(rec, ApiKey):
        return rec.public()
    return msgspec.structs.asdict(rec)


class Conflict(Exception):
    """An insert collided with an existing id."""


class NotFound(Exception):
    """A referenced parent (tenant, team, ...) does not exist."""


class InUse(Exception):
    """A delete was refused because other records still depend on this one; `dependents` counts them by kind
    (e.g. {"teams": 2, "active keys": 1})."""

    def __init__(self, dependents: dict[str, int]) -> None:
        super().__init__(", ".join(f"{n} {kind}" for kind, n in dependents.items()))
        self.dependents = dependents


class NotEditable(Exception):
    """An update was refused because of the record's state (a revoked key, the lifetime of a rotated key)."""
