"""OpenAI's wire API (chat completions, completions, embeddings): `{"usage": {prompt_tokens, ...}}` bodies,
`data:` chunks ending with `data: [DONE]`, usage in a final usage-only chunk when
`stream_options.include_usage` is set (the gateway always asks for it, and strips it when the client did not),
errors as `{"error": {message, type, param, code}}`."""
from __future__ import annotations

from typing import Any

from gateway.api.wire.base import ClientWire, StreamState
from gateway.types import Usage
from gateway.proxy import sse


def usage_from(obj: dict[str, Any]) -> Usage | None:
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt_tokens=int(u.get("prompt_tokens") or 0), completion_tokens=int(u.get("completion_tokens") or 0),
                 cached_tokens=int(cached) if isinstance(cached, int) else None)


def response_facts(ctx: Any, obj: Any) -> None:
    """The completion id and the finish reasons of a response body or of a stream chunk (for traces and the
    audit record; finish reasons are what tells a length cut from a natural stop)."""
    if not isinstance(obj, dict):
        return
    rid = obj.get("id")
    if isinstance(rid, str) and ctx.response_id is None:
        ctx.response_id = rid[:128]
    choices = obj.get("choices")
    if isinstance(choices, list):
        reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)]
        found = tuple(r for r in reasons if isinstance(r, str))
        if found:
            ctx.finish_reasons = ctx.finish_reasons + found


def _plain_events(region: bytes) -> int:
    """How many events a region of plain content chunks holds (0: not all plain; see `OpenAIWire.relay`)."""
    n = region.count(b"\n\n")
    if (region[:5] != b"data:" or region.count(b"\n") != 2 * n
            or (n > 1 and region.count(b"\n\ndata:") != n - 1) or sse.DONE in region
            or (b'"usage"' in region and region.count(b'"usage"') != region.count(b'"usage":null'))
            or region.count(b'"finish_reason"') != region.count(b'"finish_reason":null')):
        return 0
    return n


class OpenAIWire(ClientWire):
    name = "openai"

    def usage(self, obj: Any) -> Usage | None:
        return usage_from(obj) if isinstance(obj, dict) else None

    def facts(self, ctx: Any, obj: Any) -> None:
        response_facts(ctx, obj)

    def prepare(self, ctx: Any, body: dict[str, Any]) -> None:
        if ctx.stream:  # usage always requested upstream; stripped again when the client did not ask for it
            so = dict(body.get("stream_options") or {})
            so["include_usage"] = True
            body["stream_options"] = so

    def is_first_token(self, event: bytes) -> bool:
        data = sse.event_data(event)
        if data is None:
            return False
        return data == sse.DONE or sse.has_usage(data) or sse.has_token(data)

    def relay(self, ctx: Any, st: StreamState, region: bytes) -> int:
        """The leading plain content chunks of a region relay as they came: each event one `data:` line, none
        the end, none with a usage object or a finish reason (present ones null), the response id already
        known and no budget allowance to count against; each counts one delivered token, as in `process`.
        A region that is not all plain is cut before the first event that may need a look (`"usage":{`,
        `"finish_reason":"`, `[DONE]`); a prefix that is not plain after all (spaces after a colon, other
        fields) is left whole. A few C scans of the bytes, cheapest first: a paced stream pays them per event."""
        if ctx.completion_token_allowance is not None or ctx.response_id is None:
            return 0
        n = _plain_events(region)
        if not n:
            end = len(region)
            for marker in (b'"usage":{', b'"finish_reason":"', sse.DONE):
                i = region.find(marker, 0, end)
                if i >= 0:
                    end = i
            end = region.rfind(b"\n\n", 0, end) + 2
            if end < 2 or end >= len(region):
                return 0
            region = region[:end]
            n = _plain_events(region)
            if not n:
                return 0
        st.delivered_tokens += n
        ctx.delivered_completion_tokens = st.delivered_tokens
        return len(region)

    def process(self, ctx: Any, st: StreamState, ev: bytes) -> bytes | None:
        data = sse.event_data(ev)
        if data is None:
            return ev + b"\n\n"
        if data == sse.DONE:
            st.done = True
            return ev + b"\n\n"
        if ((b'"finish_reason"' in data and b'"finish_reason":null' not in data)
                or (ctx.response_id is None and b'"id"' in data)):
            response_facts(ctx, sse.parse_chunk(data))  # the first chunk (id) and the last of each choice only
        if sse.has_usage(data):
            chunk = sse.parse_chunk(data)
            if chunk is not None:
                u = usage_from(chunk)
                if u is not None:
                    ctx.usage = u
                if sse.is_usage_only(chunk) and not ctx.client_wants_usage:
                    return None
        if ctx.completion_token_allowance is None:  # cheap lower bound (one token per content event)
            st.delivered_tokens += 1
            ctx.delivered_completion_tokens = st.delivered_tokens
        else:
            chunk = sse.parse_chunk(data)
            cut = self.budget_cut(ctx, st, ev, sse.chunk_text_len(chunk) if chunk else 0)
            if cut is not None:
                return cut
        return ev + b"\n\n"


OPENAI = OpenAIWire()
