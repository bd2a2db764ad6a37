"""Backend dialects by `kind` (gateway/proxy/dialects/base.py): one registry line per kind."""
from __future__ import annotations

from gateway.proxy.dialects.anthropic import AnthropicDialect
from gateway.proxy.dialects.base import Dialect, Exchange, StreamTranslator
from gateway.proxy.dialects.openai import OpenAIDialect
from gateway.proxy.dialects.vllm import VLLMDialect

DIALECTS: dict[str, Dialect] = {d.kind: d for d in (
    VLLMDialect("vllm"),
    VLLMDialect("sim"),
    OpenAIDialect(),
    AnthropicDialect(),
)}


def dialect_for(kind: str) -> Dialect:
    return DIALECTS[kind]


def publishes_kv_events(backend: object) -> bool:
    """Does this backend's kind publish vLLM KV-cache events and engine metrics (the router's telemetry)?"""
    d = DIALECTS.get(getattr(backend, "kind", ""))
    return d is not None and d.kv_events


__all__ = ["DIALECTS", "Dialect", "Exchange", "StreamTranslator", "dialect_for", "publishes_kv_events"]
