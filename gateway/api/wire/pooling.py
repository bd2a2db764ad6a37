"""The wire of vLLM's pooling and tokenizer APIs (`/v1/rerank`, `/v1/score`, `/tokenize`): JSON only (their
parsers refuse `stream`), errors OpenAI-shaped, no completion tokens. Usage is input tokens only:
`usage.prompt_tokens` (score, newer rerank), else `usage.total_tokens` (rerank's `{"total_tokens"}` usage),
else, for /tokenize, which has no usage, the `count` of tokens it returns."""
from __future__ import annotations

from typing import Any

from gateway.api.wire.base import ClientWire
from gateway.types import Usage


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_from(obj: dict[str, Any]) -> Usage | None:
    u = obj.get("usage")
    if isinstance(u, dict):
        n = _int(u.get("prompt_tokens"))
        n = n if n is not None else _int(u.get("total_tokens"))
        if n is not None:
            return Usage(prompt_tokens=n, completion_tokens=0)
    n = _int(obj.get("count"))
    return Usage(prompt_tokens=n, completion_tokens=0) if n is not None else None


class PoolingWire(ClientWire):
    name = "pooling"

    def usage(self, obj: Any) -> Usage | None:
        return usage_from(obj) if isinstance(obj, dict) else None

    def facts(self, ctx: Any, obj: Any) -> None:
        rid = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(rid, str) and ctx.response_id is None:
            ctx.response_id = rid[:128]

    def is_first_token(self, event: bytes) -> bool:
        return True  # never streamed (the parsers refuse `stream`)


POOLING = PoolingWire()
