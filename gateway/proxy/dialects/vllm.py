"""vLLM's OpenAI-compatible server (and the simulator, which serves the same shapes): every endpoint the
gateway has is served natively; engines publish KV-cache events and Prometheus metrics."""
from __future__ import annotations

from gateway.api.endpoints import BY_NAME
from gateway.proxy.dialects.base import Dialect


class VLLMDialect(Dialect):
    provider = "vllm"
    kv_events = True
    tokenize_path = "tokenize"

    def __init__(self, kind: str = "vllm") -> None:
        self.kind = kind
        self.native = frozenset(BY_NAME)
