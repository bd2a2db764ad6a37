"""Config section `policy:` (owned by the policy engine)."""
from __future__ import annotations

import msgspec


class OPAConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str
    path: str = "gateway/decision"
    timeout_ms: float = 50.0
    cache_ttl_s: float = 5.0


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    files: list[str] = msgspec.field(default_factory=list)  # paths or globs, relative to the config file
    default_allow: bool = True
    opa: OPAConfig | None = None
    audit_path: str = "var/audit.jsonl"
