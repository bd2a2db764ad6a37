"""Request -> token ids for KV-index matching: local tokenizer, else the engine's /tokenize, else approximate.

The approximate source hashes the rendered text in fixed-size character chunks into pseudo token ids, so two
requests sharing a text prefix share leading pseudo blocks; it can rank engines by overlap but its counts are
not the engine's tokens (evidence says which source was used).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import httpx
import orjson
import xxhash

from gateway.telemetry.local_tokenizer import LocalTokenizer

APPROX_CHARS_PER_TOKEN = 4


def render_messages_plain(messages: list[dict[str, Any]]) -> str:
    """A stable ChatML-like text rendering (for the approximate source and as a last-resort template)."""
    parts = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{c or ''}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def approx_tokens(text: str) -> list[int]:
    """Pseudo token ids: one per 4-char chunk, hashed (stable across processes)."""
    n = APPROX_CHARS_PER_TOKEN
    return [xxhash.xxh32_intdigest(text[i:i + n].encode("utf-8")) for i in range(0, len(text), n)]


class TokenSource:
    """Resolves a request body to (token ids, source); caches by (model, rendered request) in an LRU.

    Cached token ids decode back to the prompt, so a request under zero retention passes `retain=False`:
    it is tokenized, used and dropped, and neither reads nor writes the cache (counted in `uncached`).
    """

    def __init__(self, mode: str = "auto", client: httpx.AsyncClient | None = None, cache_size: int = 4096,
                 timeout_s: float = 0.5) -> None:
        self.mode = mode  # auto | engine | approx | <path to tokenizer.json or its folder>
        self._client = client
        self._own_client = client is None
        self.timeout_s = timeout_s
        self._local: LocalTokenizer | None = None
        self.local_error: str | None = None
        if mode not in ("auto", "engine", "approx"):
            try:
                self._local = LocalTokenizer(mode)
            except Exception as e:  # missing lib/file: fall back, and say so in stats
                self.local_error = f"{type(e).__name__}: {e}"
        self._cache: OrderedDict[bytes, tuple[list[int], str]] = OrderedDict()
        self._cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self.uncached = 0  # resolved with retain=False (zero retention): never looked up nor stored
        self.by_source: dict[str, int] = {}

    async def close(self) -> None:
        if self._own_client and self._client is not None:
            await self._client.aclose()

    def _key(self, endpoint: str | None, body: dict[str, Any]) -> bytes:
        sub = {k: body.get(k) for k in ("model", "messages", "prompt", "tools", "chat_template_kwargs")}
        return xxhash.xxh3_128_digest(orjson.dumps(sub, option=orjson.OPT_SORT_KEYS, default=str)) + \
            (endpoint or "").encode()

    async def tokens(self, endpoint: str | None, body: dict[str, Any], retain: bool = True
                     ) -> tuple[list[int], str]:
        """Token ids for the request's prompt and the source that produced them ("local"/"engine"/"approx").

        retain=False (zero retention): resolve without touching the cache, so nothing of the prompt outlives
        the call here."""
        if not retain:
            self.uncached += 1
            res = await self._resolve(endpoint, body)
            self.by_source[res[1]] = self.by_source.get(res[1], 0) + 1
            return res
        key = self._key(endpoint if self._local is None else None, body)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        res = await self._resolve(endpoint, body)
        self._cache[key] = res
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        self.by_source[res[1]] = self.by_source.get(res[1], 0) + 1
        return res

    async def _resolve(self, endpoint: str | None, body: dict[str, Any]) -> tuple[list[int], str]:
        if self._local is not None:
            try:
                return self._local.encode_body(body), "local"
            except Exception:
                pass
        if self.mode in ("auto", "engine") or self._local is None and self.mode != "approx":
            if endpoint:
                ids = await self._engine_tokenize(endpoint, body)
                if ids is not None:
                    return ids, "engine"
        if "messages" in body:
            text = render_messages_plain(body["messages"])
        else:
            p = body.get("prompt", "")
            text = p if isinstance(p, str) else "".join(map(str, p))
        return approx_tokens(text), "approx"

    async def _engine_tokenize(self, server_root: str, body: dict[str, Any]) -> list[int] | None:
        """vLLM's POST /tokenize: {model, messages, add_generation_prompt} or {model, prompt}."""
        if self._client is None:
            self._client = httpx.AsyncClient()
        req: dict[str, Any] = {"model": body.get("model")}
        if "messages" in body:
            req.update(messages=body["messages"], add_generation_prompt=True)
            if body.get("tools"):
                req["tools"] = body["tools"]
        else:
            p = body.get("prompt", "")
            req["prompt"] = p if isinstance(p, str) else "".join(map(str, p))
        try:
            r = await self._client.post(server_root.rstrip("/") + "/tokenize", json=req, timeout=self.timeout_s)
            if r.status_code != 200:
                return None
            toks = r.json().get("tokens")
            return list(toks) if isinstance(toks, list) else None
        except (httpx.HTTPError, ValueError):
            return None
