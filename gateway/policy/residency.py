"""THE residency/retention filter: whether a backend may receive a request under a decision.

Routing, retries and fallbacks all call `backend_allowed`; it is a filter, never a weight. A backend with no
declared location never satisfies a residency requirement; zero retention needs a backend that declares
`retention: zero`. Both the inference country and the storage country must be in the allowed set.
"""
from __future__ import annotations

from typing import Iterable

from gateway.config import BackendConfig
from gateway.types import Decision


def backend_allowed(decision: Decision, backend: BackendConfig) -> str | None:
    """None when `backend` satisfies the decision's residency and retention, else a short reason."""
    allowed = decision.allowed_countries
    if allowed is not None:
        loc = backend.location
        if loc is None:
            return f"residency: backend declares no location; {_required(decision)}"
        if loc.country not in allowed:
            return f"residency: inference in {loc.country}, {_required(decision)}"
        if loc.storage not in allowed:
            return f"residency: storage in {loc.storage}, {_required(decision)}"
    if decision.retention == "zero" and backend.retention != "zero":
        rule = f" (rule {decision.retention_rule})" if decision.retention_rule else ""
        return f"retention: backend keeps data ({backend.retention}), zero retention required{rule}"
    only, ignored = decision.providers_only, decision.providers_ignored
    if only is not None and backend.name not in only and (backend.operator or "") not in only:
        return f"provider preferences: {backend.name} is not in the request's provider.only"
    if ignored and (backend.name in ignored or (backend.operator or "") in ignored):
        return f"provider preferences: {backend.name} is in the request's provider.ignore"
    return None


def _required(decision: Decision) -> str:
    """What a residency refusal says is required: the jurisdiction (or the allowed countries) and the rule.
    Built only for a refusal: an allowed backend costs no sorted list and no text."""
    where = decision.jurisdiction or ",".join(sorted(decision.allowed_countries or ()))
    rule = f" (rule {decision.residency_rule})" if decision.residency_rule else ""
    return f"{where} required{rule}"


def filter_backends(decision: Decision, backends: Iterable[BackendConfig],
                    ) -> tuple[list[BackendConfig], dict[str, str]]:
    """Split backends into (allowed, {name: why dropped}) under a decision."""
    ok: list[BackendConfig] = []
    dropped: dict[str, str] = {}
    for b in backends:
        why = backend_allowed(decision, b)
        if why is None:
            ok.append(b)
        else:
            dropped[b.name] = why
    return ok, dropped
