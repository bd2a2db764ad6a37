"""The backend dialect seam: what differs between backend kinds (vLLM, the simulator, OpenAI-compatible
partners, Anthropic-native partners), behind one base class, httpx-transport style.

A `Dialect` answers, for one backend kind:
- `exchange(ep)`: how a request to endpoint `ep` is carried to this kind of backend: a `Passthrough` when the
  backend speaks the client's API natively, a translator (gateway/proxy/dialects/<kind>.py) when it speaks
  another one, None when it cannot serve that endpoint at all (the dispatcher skips it);
- `adjust(ctx, cand, body)`: fields this kind does not accept removed from the upstream body;
- `auth_headers(token)`: how the gateway's credential for the backend is sent;
- `error_message(status, body)`: the human message of an upstream error body;
- `lora_key(upstream_model)`: the name this kind's KV events give the LoRA adapter an upstream model selects;
- capabilities: `kv_events` (publishes KV-cache events and Prometheus metrics the router reads), `telemetry`
  (whose formats those are: "vllm" or "sglang"; gateway/telemetry reads each), `kv_report_full` (takes vLLM's
  kv_cache_report_mode), `tokenize_path`, `provider` (OpenTelemetry gen_ai.provider.name).

The registry (gateway/proxy/dialects/__init__.py) maps a backend `kind` to its dialect: a new backend kind is
one file plus one registry line.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import orjson

from gateway.api.endpoints import Endpoint

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext
    from gateway.routing.plan import Candidate


class StreamTranslator:
    """Turns one upstream SSE event (bytes between blank lines) into zero or more events of the client's API."""

    def feed(self, event: bytes) -> list[bytes]:
        raise NotImplementedError

    def end(self) -> list[bytes]:
        """Events owed to the client when the upstream stream ended cleanly."""
        return []


class Exchange:
    """One (client API, backend dialect) pair: the upstream path, the upstream body (in the endpoint's media
    type: JSON or a multipart form) with its content type, and the response back in the client's API. This base
    class is the native case (the backend speaks the client's API; the endpoint's wire may still ask it for
    another shape and turn it back: `ClientWire.from_upstream`)."""

    translates = False  # `response` must see every 200 body

    def __init__(self, dialect: "Dialect", ep: Endpoint) -> None:
        self.dialect = dialect
        self.ep = ep
        self.path = ep.upstream_path
        if ep.wire.rewrites_upstream:
            self.translates = True

    def body(self, ctx: Any, cand: Any) -> bytes:
        """The client's body with the upstream model name, the wire's own additions (stream usage), policy and
        budget caps and the routing stage's overrides (cache_salt, priority); never the client's `provider`
        preferences; then what this backend kind does not accept removed."""
        body = dict(ctx.body)
        body["model"] = cand.backend.upstream_model(cand.model)
        body.pop("provider", None)  # the client's provider preferences are ours (gateway/policy/provider_prefs.py)
        self.ep.wire.prepare(ctx, body)
        if ctx.max_tokens is not None and self.ep.max_tokens_key is not None:
            body[self.ep.max_tokens_key(body)] = ctx.max_tokens
        if ctx.body_overrides:
            body.update(ctx.body_overrides)
        self.dialect.adjust(ctx, cand, body)
        return self.ep.media.encode(body)

    def content_type(self, body: bytes) -> str:
        """The Content-Type of a body `body` produced."""
        return self.ep.media.content_type(body)

    def response(self, raw: bytes) -> bytes:
        """A 200 JSON body, in the client's API."""
        return self.ep.wire.from_upstream(raw)

    def stream(self) -> StreamTranslator | None:
        """None: the upstream's events are already the client's."""
        return None


class Dialect:
    kind = "base"
    provider = ""  # OpenTelemetry gen_ai.provider.name
    kv_events = False  # publishes KV-cache events (ZMQ) and engine metrics the router reads
    telemetry: str | None = None  # the formats of those events, metrics and /tokenize: "vllm" | "sglang"
    kv_report_full = False  # takes vLLM's kv_cache_report_mode="full" (backends[].kv_cache_report_mode)
    tokenize_path: str | None = None
    native: frozenset[str] = frozenset()  # endpoint names served as they are (empty: see `translated`)
    drop_fields: tuple[str, ...] = ()  # body fields this kind refuses (vLLM-only extensions)
    retryable_statuses: frozenset[int] = frozenset()  # upstream 5xx of this kind tried again on the next candidate

    def exchange(self, ep: Endpoint) -> Exchange | None:
        if ep.name in self.native:
            return Exchange(self, ep)
        return None

    def serves(self, ep: Endpoint) -> bool:
        return self.exchange(ep) is not None

    def adjust(self, ctx: RequestContext | None, cand: Candidate, body: dict[str, Any]) -> None:
        for f in self.drop_fields:
            body.pop(f, None)
        if not cand.backend.priority_scheduling:
            body.pop("priority", None)

    def lora_key(self, upstream_model: str) -> str:
        """The adapter name this kind's KV events carry for an upstream model that is a LoRA adapter."""
        return upstream_model

    def auth_headers(self, bearer: str | None) -> dict[str, str]:
        return {"authorization": bearer} if bearer else {}

    def error_message(self, status: int, body: bytes) -> str:
        """The message of an OpenAI-style (or bare `message`) error body, whole: the upstream's own text, which
        reaches a client only through gateway/proxy/scrub.py (which also bounds it, after scrubbing)."""
        try:
            obj = orjson.loads(body)
            err = obj.get("error")
            msg = err.get("message") if isinstance(err, dict) else obj.get("message")
            if isinstance(msg, str):
                return msg
        except (orjson.JSONDecodeError, AttributeError):
            pass
        return f"upstream answered HTTP {status}"

    def error_fields(self, body: bytes) -> dict[str, Any]:
        """The upstream error object's own fields (code, param, type) where it has them."""
        try:
            obj = orjson.loads(body)
            if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                return obj["error"]
        except orjson.JSONDecodeError:
            pass
        return {}


def names(dialects: Iterable[Dialect]) -> list[str]:
    return sorted(d.kind for d in dialects)
