"""vLLM's OpenAI-compatible server (and the simulator, which serves the same shapes): every endpoint the
gateway has is served natively (/v1/messages through /v1/chat/completions when it carries a cache_salt or a
priority, which vLLM's /v1/messages drops: gateway/proxy/dialects/anthropic.py MessagesOnVLLM); engines
publish KV-cache events and Prometheus metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.api.endpoints import BY_NAME, Endpoint
from gateway.proxy.dialects.anthropic import MessagesOnVLLM
from gateway.proxy.dialects.base import Dialect, Exchange

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext
    from gateway.routing.plan import Candidate


class VLLMDialect(Dialect):
    provider = "vllm"
    kv_events = True
    telemetry = "vllm"
    kv_report_full = True
    tokenize_path = "tokenize"

    def __init__(self, kind: str = "vllm") -> None:
        self.kind = kind
        self.native = frozenset(BY_NAME)

    def adjust(self, ctx: RequestContext | None, cand: Candidate, body: dict[str, Any]) -> None:
        super().adjust(ctx, cand, body)
        if cand.backend.kv_cache_report_mode == "full":
            # vLLM 0.32: vllm_xargs becomes SamplingParams.extra_args, read by v1/request.py as the request's
            # kv_cache_report_mode; the client's own vllm_xargs are kept
            xa = body.get("vllm_xargs")
            body["vllm_xargs"] = {**(xa if isinstance(xa, dict) else {}), "kv_cache_report_mode": "full"}

    def exchange(self, ep: Endpoint) -> Exchange | None:
        if ep.name == "messages":
            return MessagesOnVLLM(self, ep)
        return super().exchange(ep)
