"""The wire of OpenAI's `POST /v1/audio/transcriptions` as vLLM serves it.

vLLM reports a transcription's tokens only in its stream (a final `usage` chunk {prompt_tokens, completion_tokens,
total_tokens} when `stream_include_usage` is set; prompt tokens include the audio's, Whisper's at 100 per
second); its JSON answer has `usage: {type: "duration", seconds}` and its verbose_json none. So for json and text
the gateway asks the engine for that stream (`prepare`) and folds it into OpenAI's JSON transcription
(`from_upstream`): `{"text", "usage": {"type": "tokens", "input_tokens", "output_tokens", "total_tokens"}}`,
whose tokens budgets charge. verbose_json cannot stream in vLLM: it goes as asked, and its usage is the
segments' token ids (output tokens; timestamp tokens are not in them). The client is never streamed to.

For `text` OpenAI sends the transcript alone as `text/plain`: `client_body` gives it to the JSON answer path
(gateway/api/ingress.py), after the usage was read from the folded JSON.
"""
from __future__ import annotations

from typing import Any

import orjson

from gateway.api.parse_audio import response_format
from gateway.api.wire.base import ClientWire
from gateway.errors import GatewayError
from gateway.proxy import sse
from gateway.types import Usage

FOLDED = ("json", "text")  # the formats asked of the engine as a stream and folded into one JSON answer


_Json = dict[str, Any]  # a JSON object of an answer


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _broken(what: str) -> GatewayError:
    return GatewayError(502, f"The engine's transcription {what}.", code="upstream_error")


def fold(raw: bytes) -> bytes:
    """vLLM's transcription stream (`transcription.chunk` events, the usage chunk, [DONE]) as OpenAI's JSON
    transcription; a 502 when it carries an error or ends without [DONE]."""
    text: list[str] = []
    usage: _Json | None = None
    done = False
    for ev in sse.split_events(raw.replace(b"\r\n", b"\n") + b"\n\n"):
        data = sse.event_data(ev)
        if data is None:
            continue
        if data == sse.DONE:
            done = True
            break
        chunk = sse.parse_chunk(data)
        if chunk is None:
            raise _broken("stream carried an event that is not JSON")
        if "error" in chunk:
            raise _broken("failed")
        for c in chunk.get("choices") or ():
            d = c.get("delta") if isinstance(c, dict) else None
            content = d.get("content") if isinstance(d, dict) else None
            if isinstance(content, str):
                text.append(content)
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
    if not done:
        raise _broken("stream ended early")
    out: _Json = {"text": "".join(text)}
    p = _count((usage or {}).get("prompt_tokens"))
    c = _count((usage or {}).get("completion_tokens"))
    if p is not None and c is not None:
        out["usage"] = {"type": "tokens", "input_tokens": p, "output_tokens": c, "total_tokens": p + c}
    return orjson.dumps(out)


def usage_from(obj: _Json) -> Usage | None:
    """Tokens of a transcription: OpenAI's `usage: {type: "tokens", ...}`; else a verbose_json's segment
    tokens; None for a duration (no tokens known)."""
    u = obj.get("usage")
    if isinstance(u, dict) and u.get("type") == "tokens":
        p, c = _count(u.get("input_tokens")), _count(u.get("output_tokens"))
        if p is not None and c is not None:
            return Usage(prompt_tokens=p, completion_tokens=c)
        return None
    segs = obj.get("segments")
    if u is None and isinstance(segs, list):
        toks = [s.get("tokens") for s in segs if isinstance(s, dict)]
        return Usage(prompt_tokens=0, completion_tokens=sum(len(t) for t in toks if isinstance(t, list)))
    return None


class TranscriptionWire(ClientWire):
    name = "transcription"
    rewrites_upstream = True

    def usage(self, obj: object) -> Usage | None:
        return usage_from(obj) if isinstance(obj, dict) else None

    def prepare(self, ctx: Any, body: _Json) -> None:
        if response_format(ctx.body) in FOLDED:
            body["response_format"] = "json"
            body["stream"] = True
            body["stream_include_usage"] = True

    def from_upstream(self, raw: bytes) -> bytes:
        return fold(raw) if raw.lstrip()[:5] == b"data:" else raw

    def client_body(self, ctx: Any, obj: object, body: bytes) -> tuple[bytes, bytes]:
        if response_format(ctx.body) == "text" and isinstance(obj, dict) and isinstance(obj.get("text"), str):
            return obj["text"].encode(), b"text/plain; charset=utf-8"
        return body, b"application/json"

    def is_first_token(self, event: bytes) -> bool:
        return True  # never streamed to the client (the parser refuses `stream`)


TRANSCRIPTION = TranscriptionWire()
