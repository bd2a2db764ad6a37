"""A rule's `set: {cache: {...}}`, compiled: which tier, how long, how similar, how widely shared."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("off", "exact", "semantic")
SCOPES = ("tenant", "team", "project")


@dataclass(frozen=True, slots=True)
class CacheSpec:
    mode: str = "off"  # "off" | "exact" | "semantic" (semantic also looks up the exact key first)
    ttl_s: float | None = None  # None: cache.default_ttl_s
    similarity: float | None = None  # semantic threshold; None: cache.default_similarity
    scope: str = "tenant"  # entries are shared within the tenant, or only within the team / project

    def to_evidence(self) -> dict[str, Any]:
        return {"mode": self.mode, "ttl_s": self.ttl_s, "similarity": self.similarity, "scope": self.scope}


def compile_spec(raw: Any) -> tuple[CacheSpec | None, str | None]:
    """(spec, None) or (None, why the value is wrong)."""
    if raw is False or raw is None:
        return CacheSpec(), None
    if not isinstance(raw, dict):
        return None, "must be a mapping {mode: exact|semantic, ttl_s, similarity, scope}"
    unknown = sorted(set(raw) - {"mode", "ttl_s", "similarity", "scope"})
    if unknown:
        return None, f"unknown key(s) {', '.join(unknown)} (mode, ttl_s, similarity, scope)"
    mode = raw.get("mode", "exact")
    if mode not in MODES:
        return None, f"mode must be one of {', '.join(MODES)}, not {mode!r}"
    ttl = raw.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0):
        return None, "ttl_s must be a number of seconds > 0"
    sim = raw.get("similarity")
    if sim is not None and (isinstance(sim, bool) or not isinstance(sim, (int, float)) or not 0.0 < sim <= 1.0):
        return None, "similarity must be a number in (0, 1]"
    if sim is not None and mode != "semantic":
        return None, "similarity applies only to mode: semantic"
    scope = raw.get("scope", "tenant")
    if scope not in SCOPES:
        return None, f"scope must be one of {', '.join(SCOPES)}"
    return CacheSpec(mode=mode, ttl_s=float(ttl) if ttl is not None else None,
                     similarity=float(sim) if sim is not None else None, scope=scope), None
