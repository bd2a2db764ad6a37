"""The OpenAI Responses API's wire (`POST /v1/responses`): usage as `{input_tokens, output_tokens,
input_tokens_details.cached_tokens}`; streams of typed events (`event: response.output_text.delta` +
`data: {"type": ..., "sequence_number": ...}`) that end with `response.completed`, `response.incomplete` or
`response.failed` (which carry the final response object and its usage) - there is no `[DONE]`; errors on the
JSON path OpenAI-shaped (`{"error": {message, type, param, code}}`), in a stream an `error` event followed by
`response.failed` (when the stream's response object is known), as OpenAI sends them.

The gateway is stateless: `prepare` sends `store: false` upstream whatever the client left out (the parser
refuses `store: true`), so the response object an engine returns says `"store": false`.
"""
from __future__ import annotations

from typing import Any

import orjson

from gateway.api.wire.base import ClientWire, StreamState
from gateway.errors import GatewayError
from gateway.types import Usage
from gateway.proxy import sse

TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def usage_from(obj: dict[str, Any]) -> Usage | None:
    """The usage of a response object (`{"usage": {input_tokens, output_tokens, ...}}`), None without one."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt_tokens=_count(u.get("input_tokens")) or 0, completion_tokens=_count(u.get("output_tokens")) or 0,
                 cached_tokens=cached)


def _count(v: Any) -> int | None:
    """A token count as an upstream should send it (a non-negative int), else None (never an exception)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def finish_reason(obj: dict[str, Any]) -> str | None:
    """A chat-style finish reason from a response's status: `stop` when completed, `length` when cut at
    max_output_tokens, else the incomplete reason or the status (`failed`, `content_filter`, ...)."""
    status = obj.get("status")
    if status == "completed":
        return "stop"
    if status == "incomplete":
        d = obj.get("incomplete_details")
        reason = d.get("reason") if isinstance(d, dict) else None
        return "length" if reason == "max_output_tokens" else reason if isinstance(reason, str) else "incomplete"
    return status if status in ("failed", "cancelled") else None


def response_facts(ctx: Any, obj: Any) -> None:
    if not isinstance(obj, dict):
        return
    rid = obj.get("id")
    if isinstance(rid, str) and ctx.response_id is None:
        ctx.response_id = rid[:128]
    fr = finish_reason(obj)
    if fr is not None:
        ctx.finish_reasons = ctx.finish_reasons + (fr,)


def event_type(event: bytes) -> bytes | None:
    """The type of one SSE event: its `event:` line (engines and OpenAI send one), else the data's `type`."""
    if event.startswith(b"event:"):
        end = event.find(b"\n")
        return event[6:end if end >= 0 else None].strip()
    data = sse.event_data(event)
    chunk = sse.parse_chunk(data) if data is not None else None
    t = chunk.get("type") if chunk is not None else None
    return t.encode() if isinstance(t, str) else None


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class ResponsesWire(ClientWire):
    name = "responses"

    def usage(self, obj: Any) -> Usage | None:
        return usage_from(obj) if isinstance(obj, dict) else None

    def facts(self, ctx: Any, obj: Any) -> None:
        response_facts(ctx, obj)

    def prepare(self, ctx: Any, body: dict[str, Any]) -> None:
        body["store"] = False  # stateless: never let an engine or partner keep the response

    def is_first_token(self, event: bytes) -> bool:
        t = event_type(event)
        return t is not None and (t.endswith(b".delta") or t in _TERMINAL_B or t == b"error")

    def process(self, ctx: Any, st: StreamState, ev: bytes) -> bytes | None:
        data = sse.event_data(ev)
        if data is None:
            return ev + b"\n\n"
        chunk = sse.parse_chunk(data)
        if chunk is None:
            return ev + b"\n\n"
        kind = chunk.get("type")
        seq = chunk.get("sequence_number")
        if isinstance(seq, int):
            st.extra["seq"] = seq
        if not isinstance(kind, str):
            return ev + b"\n\n"
        if kind.endswith(".delta"):
            delta = chunk.get("delta")
            if ctx.completion_token_allowance is None:
                st.delivered_tokens += 1  # cheap lower bound (one token per delta event)
                ctx.delivered_completion_tokens = st.delivered_tokens
            else:
                cut = self.budget_cut(ctx, st, ev, len(delta) if isinstance(delta, str) else 0)
                if cut is not None:
                    return cut
            return ev + b"\n\n"
        resp = chunk.get("response")
        if kind == "response.created" and isinstance(resp, dict):
            response_facts(ctx, resp)
            st.extra["response"] = resp
        elif kind in TERMINAL:
            st.done = True
            if isinstance(resp, dict):
                response_facts(ctx, resp)
                u = usage_from(resp)
                if u is not None:
                    ctx.usage = u
        elif kind == "error":
            st.done = True  # the engine gave up on this response: nothing more is coming
        return ev + b"\n\n"

    def error_event(self, err: GatewayError) -> bytes:
        return _event("error", {"type": "error", "code": err.code, "message": err.message, "param": err.param})

    def budget_cut(self, ctx: Any, st: StreamState, event: bytes, text_chars: int) -> bytes | None:
        """As for chat streams, but the stream ends in the Responses shape: an `error` event, then
        `response.failed` with the stream's response object (status failed, the error in it)."""
        if not text_chars:
            return None
        st.delivered_tokens += max(1, (text_chars + 3) // 4)
        ctx.delivered_completion_tokens = st.delivered_tokens
        if st.delivered_tokens < ctx.completion_token_allowance:
            return None
        ctx.cut_by_budget = True
        ctx.error = "insufficient_quota"
        st.done = True
        msg = "Budget exhausted: the stream was stopped at the remaining budget."
        seq = int(st.extra.get("seq", 0))
        out = event + b"\n\n" + _event("error", {"type": "error", "code": "insufficient_quota", "message": msg,
                                                 "param": None, "sequence_number": seq + 1})
        resp = st.extra.get("response")
        if isinstance(resp, dict):
            failed = {**resp, "status": "failed", "error": {"code": "insufficient_quota", "message": msg}}
            out += _event("response.failed", {"type": "response.failed", "sequence_number": seq + 2,
                                              "response": failed})
        return out


_TERMINAL_B = frozenset(t.encode() for t in TERMINAL)
RESPONSES = ResponsesWire()
