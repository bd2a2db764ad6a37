"""OpenAI-compatible partner routes (an aggregator, a hosted API): OpenAI's own endpoints only, and none of
vLLM's request extensions (`cache_salt`; `priority` unless the backend says it schedules by priority)."""
from __future__ import annotations

from gateway.proxy.dialects.base import Dialect


class OpenAIDialect(Dialect):
    kind = "openai"
    provider = "openai"
    native = frozenset({"chat", "completions", "embeddings"})
    drop_fields = ("cache_salt",)
