"""Batch input files: JSONL validation (errors name the line) and the prefix key lines are grouped by."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import GatewayError

# the endpoints a batch may target (OpenAI's url field) -> the gateway's endpoint name
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
CUSTOM_ID_MAX = 512


@dataclass(slots=True)
class InputLine:
    line_no: int  # 1-based line of the file
    custom_id: str
    url: str
    body: dict[str, Any]


def _bad(line: int, message: str, code: str = "invalid_batch_line") -> GatewayError:
    return GatewayError(400, f"Line {line}: {message}", code=code, param="file", extra={"line": line})


def parse_input(data: bytes, max_lines: int, max_line_bytes: int) -> list[InputLine]:
    """Every request line of a batch input file, or 400 naming the first bad line (1-based). Blank lines are
    skipped (they still count for numbering, so the number matches the client's editor)."""
    if not data.strip():
        raise GatewayError(400, "The file is empty; a batch input file has one JSON request per line.",
                           code="invalid_batch_file", param="file")
    out: list[InputLine] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            raise _bad(i, f"the line is {len(raw)} bytes, over the limit of {max_line_bytes} bytes.",
                       "line_too_large")
        if len(out) >= max_lines:
            raise _bad(i, f"the file has more than {max_lines} request lines, the limit per batch.",
                       "too_many_lines")
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise _bad(i, f"not valid JSON ({str(e).split(':')[0]}).") from None
        if not isinstance(obj, dict):
            raise _bad(i, "each line must be a JSON object with custom_id, method, url and body.")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not 0 < len(cid) <= CUSTOM_ID_MAX:
            raise _bad(i, f"custom_id must be a string of 1-{CUSTOM_ID_MAX} characters.")
        if cid in seen:
            raise _bad(i, f"custom_id {cid[:64]!r} is used again (first on line {seen[cid]}); each must be unique.",
                       "duplicate_custom_id")
        seen[cid] = i
        if obj.get("method") != "POST":
            raise _bad(i, "method must be \"POST\".")
        url = obj.get("url")
        if url not in ENDPOINTS:
            raise _bad(i, f"url must be one of {', '.join(ENDPOINTS)}.")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _bad(i, "body must be a JSON object (the request you would send to the url).")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _bad(i, "body.model must be a non-empty string.")
        if body.get("stream"):
            raise _bad(i, "body.stream must be false or absent: batch results are written to the output file.")
        extra = set(obj) - {"custom_id", "method", "url", "body"}
        if extra:
            raise _bad(i, f"unknown field {sorted(extra)[0][:64]!r}; a line has custom_id, method, url and body.")
        out.append(InputLine(i, cid, url, body))
    if not out:
        raise GatewayError(400, "The file has no request lines.", code="invalid_batch_file", param="file")
    return out


def prompt_prefix(body: dict[str, Any], chars: int) -> str:
    """A key shared by lines whose prompt starts the same (the first `chars` characters of the prompt text):
    the scheduler dispatches them together, so the engine's prefix cache serves the shared part."""
    parts: list[str] = []
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts.extend(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    for k in ("prompt", "input"):
        v = body.get(k)
        if isinstance(v, str):
            parts.append(v)
        elif isinstance(v, list) and v and isinstance(v[0], str):
            parts.append(v[0])
    text = "\x1e".join(parts)[:chars]
    return hashlib.blake2b(f"{body.get('model')}\x1f{text}".encode(), digest_size=8).hexdigest()
