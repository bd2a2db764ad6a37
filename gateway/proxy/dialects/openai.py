"""OpenAI-compatible partner routes (an aggregator, a hosted API): OpenAI's own endpoints only (chat, completions,
embeddings, responses; not vLLM's rerank, score or tokenize), and none of
vLLM's request extensions (`cache_salt`; `priority` unless the backend says it schedules by priority)."""
from __future__ import annotations

from gateway.proxy.dialects.base import Dialect


class OpenAIDialect(Dialect):
    kind = "openai"
    provider = "openai"
    native = frozenset({"chat", "completions", "embeddings", "responses"})  # OpenAI serves /v1/responses too
    drop_fields = ("cache_salt",)
