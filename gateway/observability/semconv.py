"""OpenTelemetry GenAI semantic-convention names the gateway uses in both spans and metrics (one source, so a
span's `gen_ai.operation.name` and a metric's `gen_ai_operation_name` label never disagree). The names come
from the endpoint table (gateway/api/endpoints.py: `operation`) and the backend dialects
(gateway/proxy/dialects: `provider`)."""
from __future__ import annotations

from gateway.api.endpoints import BY_NAME
from gateway.proxy.dialects import DIALECTS


def operation_name(endpoint: str) -> str:
    ep = BY_NAME.get(endpoint)
    return ep.operation if ep is not None else endpoint


def provider_name(kind: str | None) -> str:
    """The provider of a backend kind; "" when no backend served (a refusal before dispatch)."""
    if not kind:
        return ""
    d = DIALECTS.get(kind)
    return d.provider if d is not None else kind
