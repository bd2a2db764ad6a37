"""Capture a served response as one completion object, and answer a hit from it: as JSON, or as an SSE stream
in the endpoint's shape (chat.completion.chunk / text_completion), ending with usage when asked and [DONE]."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable

import orjson


class Capture:
    """Collects what the client received: a JSON body, or the SSE events of a stream (folded into one object).
    `ok` turns False on anything it cannot reproduce exactly (tool-call deltas, logprobs, an error event)."""

    def __init__(self, endpoint: str, limit: int) -> None:
        self.endpoint = endpoint
        self.limit = limit
        self.obj: dict[str, Any] | None = None
        self.ok = True
        self._size = 0
        self._buf = b""
        self._choices: dict[int, dict[str, Any]] = {}
        self._head: dict[str, Any] = {}
        self._usage: dict[str, Any] | None = None

    def json(self, obj: Any) -> None:
        if not isinstance(obj, dict) or not obj.get("choices"):
            self.ok = False
            return
        self.obj = obj

    def chunk(self, data: bytes) -> None:
        if not self.ok:
            return
        self._size += len(data)
        if self._size > self.limit:
            self.ok = False
            return
        self._buf += data
        while b"\n\n" in self._buf:
            ev, self._buf = self._buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip())

    def _event(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            return
        try:
            ev = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.ok = False
            return
        if not isinstance(ev, dict) or "error" in ev:
            self.ok = False
            return
        if isinstance(ev.get("usage"), dict):
            self._usage = ev["usage"]
        for k in ("id", "created", "model", "system_fingerprint"):
            if k in ev and k not in self._head:
                self._head[k] = ev[k]
        for c in ev.get("choices") or []:
            i = c.get("index", 0)
            acc = self._choices.setdefault(i, {"index": i, "text": "", "role": "assistant", "finish_reason": None})
            if c.get("logprobs"):
                self.ok = False
            d = c.get("delta") if self.endpoint == "chat" else None
            if d is not None:
                if d.get("tool_calls") or d.get("function_call"):
                    self.ok = False
                acc["role"] = d.get("role") or acc["role"]
                acc["text"] += d.get("content") or ""
            elif self.endpoint != "chat":
                acc["text"] += c.get("text") or ""
            if c.get("finish_reason"):
                acc["finish_reason"] = c["finish_reason"]

    def result(self, usage: Any) -> dict[str, Any] | None:
        if not self.ok:
            return None
        if self.obj is not None:
            return self.obj
        if not self._choices or any(c["finish_reason"] is None for c in self._choices.values()):
            return None
        u = ({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
              "total_tokens": usage.total_tokens} if usage is not None else None)
        u = self._usage or u
        chat = self.endpoint == "chat"
        choices = [({"index": c["index"], "message": {"role": c["role"], "content": c["text"]},
                     "finish_reason": c["finish_reason"]} if chat else
                    {"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"], "logprobs": None})
                   for c in sorted(self._choices.values(), key=lambda c: c["index"])]
        return {**self._head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": u}


@dataclass(slots=True)
class CachedStream:
    """A hit for a streaming request: the dispatch step replays it instead of opening an upstream."""

    obj: dict[str, Any]
    endpoint: str

    async def replay(self, ctx: Any, on_end: Callable[[], Awaitable[None]]) -> AsyncGenerator[bytes, None]:
        try:
            yield sse_events(self.obj, self.endpoint, ctx.client_wants_usage)
        finally:
            await on_end()


def sse_events(obj: dict[str, Any], endpoint: str, with_usage: bool) -> bytes:
    chat = endpoint == "chat"
    head = {"id": obj.get("id") or "cached", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": obj.get("created") or 0, "model": obj.get("model") or ""}
    out: list[bytes] = []

    def ev(choices: list[dict[str, Any]], **extra: Any) -> None:
        out.append(b"data: " + orjson.dumps({**head, "choices": choices, **extra}) + b"\n\n")

    for c in obj.get("choices") or []:
        i = c.get("index", 0)
        if chat:
            m = c.get("message") or {}
            delta: dict[str, Any] = {"role": m.get("role") or "assistant", "content": m.get("content") or ""}
            if m.get("tool_calls"):
                delta["tool_calls"] = [{**tc, "index": j} for j, tc in enumerate(m["tool_calls"])]
            if m.get("refusal") is not None:
                delta["refusal"] = m["refusal"]
            ev([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            ev([{"index": i, "delta": {}, "logprobs": None, "finish_reason": c.get("finish_reason") or "stop"}])
        else:
            ev([{"index": i, "text": c.get("text") or "", "logprobs": None,
                 "finish_reason": c.get("finish_reason") or "stop"}])
    if with_usage and obj.get("usage"):
        ev([], usage=obj["usage"])
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)
