"""Batch input files: JSONL validation (errors name the line) and the prefix key lines are grouped by."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from gateway.api.parse import check_nesting
from gateway.errors import GatewayError

log = logging.getLogger("gateway.batch")

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


def _realtime_parser(url: str) -> Callable[[dict[str, Any]], Any]:
    """The parser the realtime endpoint at `url` validates a body with (gateway/api/endpoints.py)."""
    from gateway.api.endpoints import BY_NAME

    return BY_NAME[ENDPOINTS[url]].parse


class LineChecker:
    """Checks the lines of one batch input file one at a time (1-based numbers, blank lines skipped but
    counted, so the number matches the client's editor). A line's body is validated exactly as the realtime
    endpoint its url names validates the same body: the same nesting limit (`check_nesting`, 64 levels: orjson
    reads 1,024 but writes 255, so a deeper body could be stored but never saved or sent) and the same parser
    (fields, types, sizes). The first bad line raises a 400 naming it."""

    __slots__ = ("max_lines", "max_line_bytes", "seen", "count")

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes
        self.seen: dict[str, int] = {}  # custom_id -> its line
        self.count = 0  # request lines so far

    def check(self, i: int, raw: bytes) -> InputLine | None:
        """Line `i` (`raw`, without its newline): its request, None for a blank line, or 400 naming it."""
        if not raw.strip():
            return None
        if len(raw) > self.max_line_bytes:
            raise _bad(i, f"the line is {len(raw)} bytes, over the limit of {self.max_line_bytes} bytes.",
                       "line_too_large")
        if self.count >= self.max_lines:
            raise _bad(i, f"the file has more than {self.max_lines} request lines, the limit per batch.",
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
        if cid in self.seen:
            raise _bad(i, f"custom_id {cid[:64]!r} is used again (first on line {self.seen[cid]}); each must be "
                          "unique.", "duplicate_custom_id")
        if obj.get("method") != "POST":
            raise _bad(i, "method must be \"POST\".")
        url = obj.get("url")
        if not isinstance(url, str) or url not in ENDPOINTS:
            raise _bad(i, f"url must be one of {', '.join(ENDPOINTS)}.")
        extra = set(obj) - {"custom_id", "method", "url", "body"}
        if extra:
            raise _bad(i, f"unknown field {sorted(extra)[0][:64]!r}; a line has custom_id, method, url and body.")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _bad(i, "body must be a JSON object (the request you would send to the url).")
        try:  # exactly what the realtime endpoint refuses of the same body, in its words
            check_nesting(body, raw)
            _realtime_parser(url)(body)
        except GatewayError as e:
            raise _bad(i, f"body: {e.message}") from None
        except Exception:  # a body the realtime parser trips on is still the client's bad input, never a 500
            log.exception("batch line %d: the realtime parser failed on its body", i)
            raise _bad(i, "body could not be validated as a request to the url.") from None
        if body.get("stream"):
            raise _bad(i, "body.stream must be false or absent: batch results are written to the output file.")
        self.seen[cid] = i
        self.count += 1
        return InputLine(i, cid, url, body)


def parse_input(data: bytes, max_lines: int, max_line_bytes: int) -> list[InputLine]:
    """Every request line of a batch input file held in memory, or 400 naming the first bad line (1-based).
    Uploads are scanned from disk instead (gateway/batch/upload.py) with the same `LineChecker`; this reads files
    stored before that (their content kept as one blob)."""
    if not data.strip():
        raise GatewayError(400, "The file is empty; a batch input file has one JSON request per line.",
                           code="invalid_batch_file", param="file")
    checker = LineChecker(max_lines, max_line_bytes)
    out = [ln for i, raw in enumerate(data.split(b"\n"), start=1) if (ln := checker.check(i, raw)) is not None]
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
