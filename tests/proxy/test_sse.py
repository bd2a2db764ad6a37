"""SSE framing and usage handling, pure: events split across arbitrary chunk boundaries, usage-only chunks."""
from __future__ import annotations

import orjson
from hypothesis import given, strategies as st

from gateway.proxy import sse


def _events(n: int) -> list[bytes]:
    return [b"data: " + orjson.dumps({"choices": [{"delta": {"content": f"t{i}"}}]}) for i in range(n)] + [b"data: [DONE]"]


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30), st.booleans())
def test_splitter_reassembles_events_whatever_the_chunking(cuts, crlf):
    evs = _events(5)
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    raw = b"".join(e + sep for e in evs)
    sp = sse.EventSplitter()
    out: list[bytes] = []
    i = 0
    for c in cuts * 50:
        if i >= len(raw):
            break
        out += sp.feed(raw[i:i + c])
        i += c
    if i < len(raw):
        out += sp.feed(raw[i:])
    assert out == evs
    assert sp.rest() == b""


def test_event_data_and_comments():
    assert sse.event_data(b": ping") is None
    assert sse.event_data(b"event: x\ndata: {\"a\":1}") == b'{"a":1}'
    assert sse.event_data(b"data:[DONE]") == b"[DONE]"


def test_usage_detection_and_usage_only_chunk():
    assert not sse.has_usage(b'{"choices":[],"usage":null}')
    assert not sse.has_usage(b'{"choices":[{"delta":{}}], "usage": null}')
    assert sse.has_usage(b'{"choices":[],"usage":{"prompt_tokens":1}}')
    assert sse.is_usage_only({"choices": [], "usage": {"prompt_tokens": 1}})
    assert not sse.is_usage_only({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 1}})


def test_token_detection():
    assert not sse.has_token(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert sse.has_token(b'{"choices":[{"delta":{"content":"hi"}}]}')
    assert sse.has_token(b'{"choices":[{"text":"hi"}]}')
    assert sse.has_token(b'{"choices":[{"delta":{"tool_calls":[{"id":"x"}]}}]}')
    assert not sse.has_token(b"[DONE]")
    assert not sse.has_token(b"not json")
