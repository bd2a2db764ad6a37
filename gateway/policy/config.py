"""Config section `policy:` (owned by the policy engine)."""
from __future__ import annotations

import msgspec


class OPAConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Delegate the decision to Open Policy Agent's REST data API (POST /v1/data/<path>). Fail-closed."""

    url: str  # e.g. http://127.0.0.1:8181
    path: str = "gateway/decision"
    timeout_ms: float = 50.0
    cache_ttl_s: float = 5.0
    cache_size: int = 10000
    # "merge": the YAML policy decides first and OPA can only add restrictions / set values;
    # "replace": OPA alone decides (the YAML policy is not consulted).
    mode: str = "merge"
    token_env: str | None = None  # bearer token for OPA's authentication, from this env var


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    files: list[str] = msgspec.field(default_factory=list)  # paths or globs, relative to the config file
    default_allow: bool = True
    opa: OPAConfig | None = None
    audit_path: str = "var/audit.jsonl"  # "-": JSON lines to stdout (a container's log collector ships them)
    # Before a write would take the file past audit_max_bytes it is renamed to <path>.1 (.1 to .2, ...; the
    # oldest beyond audit_backups is removed); the batch starts the new file whole.
    audit_max_bytes: int = 0  # rotate the audit file by size (bytes); 0 = never
    audit_backups: int = 5  # rotated files kept (>= 1 when audit_max_bytes is set)
    # Optional second audit store: table audit_decisions in Postgres (${VAR} in the DSN is expanded, so the
    # password can come from a Secret). The JSON-lines file stays the primary record; rows the database could
    # not take are retried until it is back (bounded backlog: audit_postgres_backlog records).
    audit_postgres_dsn: str | None = None
    audit_postgres_backlog: int = 100000
