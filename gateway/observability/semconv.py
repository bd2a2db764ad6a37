"""OpenTelemetry GenAI semantic-convention names the gateway uses in both spans and metrics (one source, so a
span's `gen_ai.operation.name` and a metric's `gen_ai_operation_name` label never disagree)."""
from __future__ import annotations

# endpoint -> gen_ai.operation.name
OPERATION = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}
# backend kind -> gen_ai.provider.name
PROVIDER = {"vllm": "vllm", "sim": "vllm", "openai": "openai"}


def operation_name(endpoint: str) -> str:
    return OPERATION.get(endpoint, endpoint)


def provider_name(kind: str | None) -> str:
    """The provider of a backend kind; "" when no backend served (a refusal before dispatch)."""
    return PROVIDER.get(kind, kind) if kind else ""
