"""SGLang's OpenAI-compatible server (kind `sglang`), a second engine platform next to vLLM.

Derived from reading SGLang 0.5.23's source (sglang/srt/entrypoints/http_server.py, entrypoints/openai/
protocol.py, serving_base.py, managers/scheduler.py; no code taken from it):

- Served natively: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/rerank
  (`query`, `documents`, `top_n`), /tokenize and /v1/messages (through /v1/chat/completions when the request
  carries a cache_salt or a priority, as for vLLM: gateway/proxy/dialects/anthropic.py MessagesOnVLLM).
  Not /v1/score: SGLang's ScoringRequest (`query`, `items`, `label_token_ids`) is another API than vLLM's.
- Request fields: `cache_salt` (ChatCompletionRequest / CompletionRequest) namespaces the radix cache, as in
  vLLM; `priority` is an int, but SGLang's scheduler (`--enable-priority-scheduling`) runs *higher* values
  first unless the engine runs `--schedule-low-priority-values-first`. The gateway's `routing.priority_values`
  are vLLM's order (lower runs first), so the value the routing stage sets is negated for such a backend
  (`backends[].priority_low_values_first: true` sends it as it is). A client's own `priority` is not touched.
- LoRA: a request selects an adapter as `model: "<base>:<adapter>"` (serving_base `_parse_model_parameter`);
  the KV events name the adapter (`lora_name`), so the KV index's key of such an upstream model is the part
  after the colon.
- Errors: SGLang answers a refused request with its legacy top-level `ErrorResponse`
  `{"object": "error", "message", "type", "param", "code": <HTTP status>}`, a /generate failure with
  `{"error": {"message"}}` and a stream error as `data: {"error": {...}}`; a full waiting queue, a request
  aborted by a higher-priority one and a waiting timeout are HTTP 503, tried again on the next candidate.
- Telemetry (`telemetry = "sglang"`): KV events on ZMQ with SGLang's own BlockStored fields
  (gateway/telemetry/kv_events.py), `sglang:*` metrics (gateway/telemetry/scraper.py), /tokenize without
  `add_generation_prompt` for a chat (gateway/telemetry/tokens.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.endpoints import Endpoint
from gateway.proxy.dialects.anthropic import MessagesOnVLLM
from gateway.proxy.dialects.base import Dialect, Exchange

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext
    from gateway.routing.plan import Candidate


class SGLangDialect(Dialect):
    kind = "sglang"
    provider = "sglang"
    kv_events = True
    telemetry = "sglang"
    tokenize_path = "tokenize"
    native = frozenset({"chat", "completions", "embeddings", "responses", "rerank", "tokenize", "messages"})
    retryable_statuses = frozenset({503})  # queue full, aborted by a higher priority, waiting timeout

    def adjust(self, ctx: RequestContext | None, cand: Candidate, body: dict[str, Any]) -> None:
        super().adjust(ctx, cand, body)
        over = ctx.body_overrides if ctx is not None else {}
        p = body.get("priority")
        if "priority" in over and isinstance(p, int) and not isinstance(p, bool) \
                and not cand.backend.priority_low_values_first:
            body["priority"] = -p  # the gateway's values run lower first; SGLang's default runs higher first

    def exchange(self, ep: Endpoint) -> Exchange | None:
        if ep.name == "messages":
            return MessagesOnVLLM(self, ep)
        return super().exchange(ep)

    def lora_key(self, upstream_model: str) -> str:
        _, sep, adapter = upstream_model.partition(":")
        return adapter.strip() if sep and adapter.strip() else upstream_model

    def error_fields(self, body: bytes) -> dict[str, Any]:
        """SGLang's top-level ErrorResponse (`{"object": "error", ...}`), else an OpenAI `error` object."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {}
        if isinstance(obj, dict) and obj.get("object") == "error" and isinstance(obj.get("message"), str):
            return {k: obj[k] for k in ("message", "type", "param", "code") if k in obj}
        return super().error_fields(body)
