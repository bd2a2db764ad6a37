"""Backend dialects by `kind` (gateway/proxy/dialects/base.py): one registry line per kind.

Everything that depends on what a kind can do is read from here: config validation of `backends[].kind`
(gateway/config.py), which kinds publish KV events and metrics (the telemetry plane, the router's engine model
and its modes) and in which formats (`telemetry_form`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.proxy.dialects.anthropic import AnthropicDialect
from gateway.proxy.dialects.base import Dialect, Exchange, StreamTranslator
from gateway.proxy.dialects.openai import OpenAIDialect
from gateway.proxy.dialects.sglang import SGLangDialect
from gateway.proxy.dialects.vllm import VLLMDialect

if TYPE_CHECKING:
    from gateway.config import BackendConfig

DIALECTS: dict[str, Dialect] = {d.kind: d for d in (
    VLLMDialect("vllm"),
    VLLMDialect("sim"),
    SGLangDialect(),
    OpenAIDialect(),
    AnthropicDialect(),
)}

KINDS: tuple[str, ...] = tuple(sorted(DIALECTS))
# the kinds whose engines publish KV events and engine metrics (the router models their queue, cache and prefill)
TELEMETRY_KINDS: frozenset[str] = frozenset(k for k, d in DIALECTS.items() if d.kv_events)


def dialect_for(kind: str) -> Dialect:
    return DIALECTS[kind]


def publishes_kv_events(backend: BackendConfig) -> bool:
    """Does this backend's kind publish KV-cache events and engine metrics (the router's telemetry)?"""
    d = DIALECTS.get(backend.kind)
    return d is not None and d.kv_events


def telemetry_form(kind: str) -> str | None:
    """The formats a kind's KV events, metrics and /tokenize follow ("vllm", "sglang"), or None."""
    d = DIALECTS.get(kind)
    return d.telemetry if d is not None and d.kv_events else None


__all__ = ["DIALECTS", "Dialect", "Exchange", "KINDS", "StreamTranslator", "TELEMETRY_KINDS", "dialect_for",
           "publishes_kv_events", "telemetry_form"]
