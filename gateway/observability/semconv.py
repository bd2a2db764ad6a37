"""OpenTelemetry GenAI semantic-convention names the gateway uses in both spans and metrics (one source, so a
span's `gen_ai.operation.name` and a metric's `gen_ai_operation_name` label never disagree). The names come
from the endpoint table (gateway/api/endpoints.py: `operation`) and the backend dialects
(gateway/proxy/dialects: `provider`)."""
from __future__ import annotations

from typing import Any

_TABLES: dict[str, Any] = {}  # the endpoint table and the dialect registry, imported on first use (both import
# modules that import this one); not a function-level import, which would run on every call


def _table(name: str) -> dict[str, Any]:
    t = _TABLES.get(name)
    if t is not None:
        return t
    if name == "endpoints":
        from gateway.api.endpoints import BY_NAME

        t = _TABLES[name] = BY_NAME
    else:
        from gateway.proxy.dialects import DIALECTS

        t = _TABLES[name] = DIALECTS
    return t


def operation_name(endpoint: str) -> str:
    ep = _table("endpoints").get(endpoint)
    return ep.operation if ep is not None else endpoint


def provider_name(kind: str | None) -> str:
    """The provider of a backend kind; "" when no backend served (a refusal before dispatch)."""
    if not kind:
        return ""
    d = _table("dialects").get(kind)
    return d.provider if d is not None else kind
