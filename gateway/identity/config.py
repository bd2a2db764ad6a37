"""Config section `identity:` (owned by the identity layer)."""
from __future__ import annotations

import msgspec


class JWTIssuerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    issuer: str
    jwks_url: str
    audience: str | list[str] | None = None
    algorithms: list[str] = msgspec.field(default_factory=lambda: ["RS256", "ES256"])
    leeway_s: float = 30.0
    tenant_claim: str = "tenant"
    team_claim: str | None = "team"
    project_claim: str | None = None
    labels_claim: str | None = "labels"
    partner_claim: str | None = None
    default_tenant: str | None = None
    jwks_cache_s: float = 300.0


class IdentityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    store: str = "sqlite"  # sqlite | postgres
    sqlite_path: str = "var/gateway.db"
    postgres_dsn: str | None = None
    postgres_dsn_env: str | None = None
    cache_ttl_s: float = 5.0  # bound on how long a revoked key can still be accepted on a replica
    jwt: list[JWTIssuerConfig] = msgspec.field(default_factory=list)
    end_user_header: str = "x-end-user-id"
    auth_fail_limit_per_minute: int = 30
