"""Server-sent-event handling for OpenAI streams: framing, usage capture, usage-chunk stripping.

Pure functions and a small incremental splitter, so the streaming path can be tested without a network.
The proxy forwards whole events as soon as they are complete; it never waits for the end of the stream.
"""
from __future__ import annotations

from typing import Any

import orjson

DONE = b"[DONE]"


class EventSplitter:
    """Accumulates raw bytes and yields complete SSE events (the bytes between blank lines, without them)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:  # normalise CRLF framing (allowed by the SSE spec)
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        return [e for e in events if e.strip()]

    def feed_region(self, chunk: bytes) -> bytes:
        """The complete events in the bytes so far as one region (CRLF normalised, ending with the blank line
        after its last event; empty when no event is complete yet), for a caller that relays a region whole
        and splits it (`split_events`) only when it must look at each event."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        i = buf.rfind(b"\n\n")
        if i < 0:
            self._buf = buf
            return b""
        self._buf = buf[i + 2:]
        return buf if i + 2 == len(buf) else buf[:i + 2]

    def rest(self) -> bytes:
        """Whatever was left without a terminating blank line (a torn stream)."""
        out, self._buf = self._buf, b""
        return out


def split_events(region: bytes) -> list[bytes]:
    """The events of a `feed_region` region (without their blank lines; empty ones dropped)."""
    events = region.split(b"\n\n")
    events.pop()
    return [e for e in events if e.strip()]


def event_data(event: bytes) -> bytes | None:
    """The concatenated `data:` payload of one event, or None when it has no data lines (comments, pings)."""
    parts = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            parts.append(line[5:].lstrip(b" ") if len(line) > 5 else b"")
    if not parts:
        return None
    return b"\n".join(parts)


def parse_chunk(data: bytes) -> dict[str, Any] | None:
    """The JSON object of a data payload, None for [DONE] or anything that is not a JSON object."""
    if data == DONE:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def has_usage(data: bytes) -> bool:
    """Cheap pre-check before parsing: does this payload carry a non-null usage object?"""
    i = data.find(b'"usage"')
    if i < 0:
        return False
    rest = data[i + 7 : i + 16].lstrip(b" :")
    return not rest.startswith(b"null")


def is_usage_only(chunk: dict[str, Any]) -> bool:
    """The extra final chunk that `stream_options.include_usage` adds: empty choices, usage set."""
    return not chunk.get("choices") and isinstance(chunk.get("usage"), dict)


def chunk_text_len(chunk: dict[str, Any]) -> int:
    """Characters of generated text in a chunk (chat delta content or completion text)."""
    n = 0
    for c in chunk.get("choices") or ():
        if not isinstance(c, dict):
            continue
        d = c.get("delta")
        if isinstance(d, dict):
            content = d.get("content")
            if isinstance(content, str):
                n += len(content)
            rc = d.get("reasoning_content")
            if isinstance(rc, str):
                n += len(rc)
            if d.get("tool_calls"):
                n += 1
        t = c.get("text")
        if isinstance(t, str):
            n += len(t)
    return n


def has_token(data: bytes) -> bool:
    """Does this payload carry generated output (a token), as opposed to a role-only or usage chunk?"""
    if data == DONE:
        return False
    chunk = parse_chunk(data)
    return chunk is not None and chunk_text_len(chunk) > 0


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
