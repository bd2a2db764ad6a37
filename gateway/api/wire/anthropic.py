"""Anthropic's Messages wire API (`POST /v1/messages`): `{"usage": {input_tokens, output_tokens,
cache_read_input_tokens, cache_creation_input_tokens}}` bodies, typed SSE events (`event: <type>` +
`data: {"type": <type>, ...}`), errors as `{"type": "error", "error": {"type", "message"}}`.

Usage, as Anthropic defines it: `input_tokens` are the prompt tokens not read from the cache, so the prompt the
budget is charged for is input + cache_read + cache_creation, of which cache_read are cached (vLLM reports the
whole prompt as input_tokens and the cache fields as null: the same sum, cached unknown). In a stream,
`message_start` carries the input usage, `message_delta` the output tokens (cumulative, and, from vLLM and
newer Anthropic versions, the input ones again), `message_stop` ends it. The first generated token is the
first non-empty `content_block_delta`; its text counts against the budget allowance, and a stream cut there
ends with an `event: error` (Anthropic's own mid-stream error event)."""
from __future__ import annotations

from typing import Any

import orjson

from gateway.api.wire.base import ClientWire, StreamState
from gateway.errors import GatewayError
from gateway.types import Usage
from gateway.proxy import sse

# Anthropic's error `type` per HTTP status (docs.anthropic.com, Errors); other 4xx are invalid requests,
# other 5xx api errors. 503 (no backend, draining) and 529 are Anthropic's "overloaded".
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_object(err: GatewayError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def usage_from(u: Any) -> Usage | None:
    """A Usage from an Anthropic usage object (None when there is none)."""
    if not isinstance(u, dict):
        return None

    def n(key: str) -> int:
        v = u.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    cached = n("cache_read_input_tokens")
    reported = isinstance(u.get("cache_read_input_tokens"), int)  # vLLM sends null: cached tokens unknown
    return Usage(prompt_tokens=n("input_tokens") + cached + n("cache_creation_input_tokens"),
                 completion_tokens=n("output_tokens"), cached_tokens=cached if reported else None)


def response_facts(ctx: Any, obj: Any) -> None:
    """The message id and stop reason of a Messages body (or of a stream's message_start / message_delta)."""
    if not isinstance(obj, dict):
        return
    msg = obj.get("message") if obj.get("type") == "message_start" else obj
    if not isinstance(msg, dict):
        return
    rid = msg.get("id")
    if isinstance(rid, str) and ctx.response_id is None:
        ctx.response_id = rid[:128]
    delta = obj.get("delta") if obj.get("type") == "message_delta" else msg
    reason = delta.get("stop_reason") if isinstance(delta, dict) else None
    if isinstance(reason, str):
        ctx.finish_reasons = ctx.finish_reasons + (reason,)


def event_type(data: bytes) -> tuple[str | None, dict[str, Any] | None]:
    obj = sse.parse_chunk(data)
    if obj is None:
        return None, None
    t = obj.get("type")
    return (t if isinstance(t, str) else None), obj


def delta_text_len(obj: dict[str, Any]) -> int:
    """Characters of generated output in a content_block_delta (text, tool input JSON, thinking)."""
    d = obj.get("delta")
    if not isinstance(d, dict):
        return 0
    n = 0
    for key in ("text", "partial_json", "thinking"):
        v = d.get(key)
        if isinstance(v, str):
            n += len(v)
    return n


_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta",'
_LOOK = (b"event: m", b"event: content_block_s", b"event: e", b"event: p")  # message_*, block start/stop, ...


class AnthropicWire(ClientWire):
    name = "anthropic"

    def usage(self, obj: Any) -> Usage | None:
        return usage_from(obj.get("usage")) if isinstance(obj, dict) else None

    def facts(self, ctx: Any, obj: Any) -> None:
        response_facts(ctx, obj)

    def is_first_token(self, event: bytes) -> bool:
        data = sse.event_data(event)
        if data is None:
            return False
        t, obj = event_type(data)
        if t == "content_block_delta":
            return obj is not None and delta_text_len(obj) > 0
        return t in ("message_delta", "message_stop", "error")

    def relay(self, ctx: Any, st: StreamState, region: bytes) -> int:
        """The leading run of content_block_delta events of a region relays as it came, each counting one
        delivered token (as in `process`) when no budget allowance needs their text: every event exactly the
        two lines `event: content_block_delta` and `data: {"type":"content_block_delta",...`. The region is
        cut before the first other event the wire looks at (message_*, content_block_start/stop, ping, error);
        a prefix that is not such a run after all is left whole."""
        if ctx.completion_token_allowance is not None:
            return 0
        end = len(region)
        for marker in _LOOK:
            i = region.find(marker, 0, end)
            if i >= 0:
                end = i
        if end < len(region):
            region = region[:end]
        n = region.count(b"\n\n")
        if (not n or not region.startswith(_DELTA) or region.count(b"\n") != 3 * n
                or region.count(b"\n\n" + _DELTA) != n - 1):
            return 0
        st.delivered_tokens += n
        ctx.delivered_completion_tokens = st.delivered_tokens
        return end

    def process(self, ctx: Any, st: StreamState, ev: bytes) -> bytes | None:
        data = sse.event_data(ev)
        if data is None:
            return ev + b"\n\n"
        t, obj = event_type(data)
        if obj is None:
            return ev + b"\n\n"
        if t == "content_block_delta":
            if ctx.completion_token_allowance is None:
                st.delivered_tokens += 1
                ctx.delivered_completion_tokens = st.delivered_tokens
            else:
                cut = self.budget_cut(ctx, st, ev, delta_text_len(obj))
                if cut is not None:
                    return cut
        elif t == "message_start":
            response_facts(ctx, obj)
            msg = obj.get("message")
            u = usage_from(msg.get("usage")) if isinstance(msg, dict) else None
            if u is not None:
                st.extra["input"] = u
                ctx.usage = u
        elif t == "message_delta":
            response_facts(ctx, obj)
            u = obj.get("usage")
            if isinstance(u, dict):
                start: Usage | None = st.extra.get("input")
                later = usage_from(u)
                assert later is not None
                has_input = any(k in u for k in ("input_tokens", "cache_read_input_tokens"))
                prompt = later.prompt_tokens if has_input or start is None else start.prompt_tokens
                cached = later.cached_tokens if has_input or start is None else start.cached_tokens
                ctx.usage = Usage(prompt_tokens=prompt, completion_tokens=later.completion_tokens,
                                  cached_tokens=cached)
        elif t in ("message_stop", "error"):
            st.done = True
        return ev + b"\n\n"

    def error_body(self, err: GatewayError) -> bytes:
        return orjson.dumps(error_object(err))

    def error_event(self, err: GatewayError) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(error_object(err)) + b"\n\n"


ANTHROPIC = AnthropicWire()
