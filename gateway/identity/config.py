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
    jwks_min_refresh_s: float = 10.0  # an unknown kid triggers at most one JWKS refetch per this interval
    kind: str = "jwt"  # "jwt" or "partner" (then partner_claim or `partner` names the partner)
    partner: str | None = None


class IdentityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    store: str = "sqlite"  # sqlite | postgres
    sqlite_path: str = "var/gateway.db"
    postgres_dsn: str | None = None
    postgres_dsn_env: str | None = None
    cache_ttl_s: float = 5.0  # bound on how long a revoked key can still be accepted on a replica
    jwt: list[JWTIssuerConfig] = msgspec.field(default_factory=list)
    end_user_header: str = "x-end-user-id"
    auth_fail_limit_per_minute: int = 30
    postgres_schema: str | None = None  # search_path for the identity tables (tests use one schema per test)
    notify_channel: str = "gateway_identity"  # Postgres LISTEN/NOTIFY channel for revocations and edits
    rotation_overlap_s: float = 3600.0  # default time a rotated key keeps working next to its successor
    jwt_cache_max: int = 10000  # verified-token cache entries (per replica)
