"""/v1/models as a caller sees it: registered adapters outside its owner scope are not listed (as if they did not
exist), an alias only with the targets the caller may use, and the caller's own adapters say so."""
from __future__ import annotations

from typing import Any, Mapping

from gateway.adapters.model import Adapter, owns, visible_chain
from gateway.adapters.placement import dynamic_backends
from gateway.config import Config
from gateway.types import Principal


def visible_catalog(p: Principal, entries: list[dict[str, Any]],
                    registry: Mapping[str, Adapter], config: Config | None = None) -> list[dict[str, Any]]:
    """With `config`, the caller's adapters placed on dynamic engines (no backend serves them statically) are
    listed too, as their base model's entry (the same engines, so the same residency facts) under their name."""
    if config is not None:
        listed = {e.get("id") for e in entries}
        bases = {e.get("id"): e for e in entries}
        placed = [a for a in sorted(registry.values(), key=lambda x: x.name)
                  if a.name not in listed and a.base_model in bases and owns(p, a)
                  and dynamic_backends(config, a.base_model)]
        entries = entries + [{**bases[a.base_model], "id": a.name} for a in placed]
    out = []
    for e in entries:
        mid = e.get("id")
        a = registry.get(mid) if isinstance(mid, str) else None
        if a is not None:
            if not owns(p, a):
                continue
            e = {**e, "owned_by": a.tenant, "adapter": {"base_model": a.base_model, "rank": a.rank,
                                                       "owner": {"tenant": a.tenant, "team": a.team,
                                                                 "project": a.project}}}
        elif "alias_of" in e:
            targets = visible_chain(p, tuple(e["alias_of"]), registry)
            if not targets:
                continue
            e = {**e, "alias_of": list(targets)}
        out.append(e)
    return out
