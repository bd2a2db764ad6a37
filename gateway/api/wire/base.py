"""The contract of a client wire API, one implementation per API (openai.py, ...).

A wire is stateless; per-stream state lives in `StreamState`. The dispatcher and the ingress call it for:
- `usage(obj)`: the token usage of a JSON response body (None when it carries none);
- `facts(ctx, obj)`: the response id and finish reasons of a body or stream event (traces, audit);
- `prepare(ctx, body)`: wire-specific fields of the upstream body (e.g. OpenAI's stream usage request);
- `from_upstream(raw)`: a 200 upstream body as this API's JSON answer, where `prepare` asked the engine for
  another shape (`rewrites_upstream`; the transcription wire folds the stream it asks vLLM for);
- `client_body(ctx, obj, body)`: the bytes and content type of a JSON answer as the client asked for it (the
  body as it is unless the API has other formats: a transcription's `text`);
- `is_first_token(event)`: does this SSE event carry the first generated output (TTFT is measured there);
- `process(ctx, st, event)`: one upstream event on its way to the client: capture usage, count delivered
  tokens, strip what the client did not ask for, cut at the budget allowance; returns the bytes to send;
- `relay(ctx, st, region)`: the same for the leading run of a region's events that carry only generated output,
  in one pass over their bytes (returns how many bytes; the rest needs `process` per event);
- `error_body(err)` / `error_event(err)`: a refusal as a response body / as the last events of a stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError


@dataclass(slots=True)
class StreamState:
    done: bool = False
    delivered_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class ClientWire:
    """Base class: OpenAI-shaped errors; subclasses override what their API does differently."""

    name = "base"
    rewrites_upstream = False  # `from_upstream` is not the identity (the exchange calls it on every 200 body)

    def usage(self, obj: Any) -> Any:
        raise NotImplementedError

    def facts(self, ctx: Any, obj: Any) -> None:
        return None

    def prepare(self, ctx: Any, body: dict[str, Any]) -> None:
        return None

    def from_upstream(self, raw: bytes) -> bytes:
        return raw

    def client_body(self, ctx: Any, obj: Any, body: bytes) -> tuple[bytes, bytes]:
        return body, b"application/json"

    def is_first_token(self, event: bytes) -> bool:
        raise NotImplementedError

    def process(self, ctx: Any, st: StreamState, event: bytes) -> bytes | None:
        raise NotImplementedError

    def relay(self, ctx: Any, st: StreamState, region: bytes) -> int:
        """How many leading bytes of a region of complete upstream events (gateway/proxy/sse.py `feed_region`)
        can be sent as they came because none of those events needs a look of its own (no usage, finish
        reason, end, budget to count): their accounting done in one pass over the bytes. The rest of the
        region goes through `process` event by event; 0: all of it."""
        return 0

    def error_body(self, err: GatewayError) -> bytes:
        return err.to_bytes()

    def error_event(self, err: GatewayError) -> bytes:
        return err.sse_event()

    def budget_cut(self, ctx: Any, st: StreamState, event: bytes, text_chars: int) -> bytes | None:
        """Count `text_chars` of generated text as delivered tokens (4 chars per token, at least one) and, when
        the request's completion allowance is reached, end the stream here with the wire's error event."""
        if not text_chars:
            return None
        st.delivered_tokens += max(1, (text_chars + 3) // 4)
        ctx.delivered_completion_tokens = st.delivered_tokens
        if st.delivered_tokens >= ctx.completion_token_allowance:
            ctx.cut_by_budget = True
            ctx.error = "insufficient_quota"
            return event + b"\n\n" + self.error_event(GatewayError(
                429, "Budget exhausted: the stream was stopped at the remaining budget.", code="insufficient_quota"))
        return None
