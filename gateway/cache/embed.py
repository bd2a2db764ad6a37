"""Embedders of the semantic tier: one async `embed(ctx, text) -> vector | None` interface.

`LexicalEmbedder` is the built-in default: hashed word and character-trigram features (no model, no download,
deterministic); it catches rewordings that keep the content words (politeness, order, punctuation, filler),
not synonyms. `BackendEmbedder` asks a model served at /v1/embeddings by one of the gateway's own backends,
chosen like any request for the model and refused where the request's residency does not allow it; any
failure or timeout is `None`, i.e. a miss, never an error for the client.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import re
from typing import Any, Callable

import numpy as np

DIMS = 512
_STOP = frozenset("a an the please kindly could would can you me i we us tell let know like to do does is are be "
                  "of for in on at and or so just hey hi hello thanks thank quick question about what whats "
                  "explain give show help want need wondering curious". split())
_TOKEN = re.compile(r"[a-z0-9']+")


def _slot(feat: str) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(feat.encode(), digest_size=8).digest(), "little")
    return h % DIMS, (1.0 if (h >> 40) & 1 else -1.0)


class LexicalEmbedder:
    name = "lexical"

    def vector(self, text: str) -> np.ndarray:
        v = np.zeros(DIMS, dtype=np.float32)
        words = [w.replace("'", "") for w in _TOKEN.findall(text.lower())]
        content = [w for w in words if w not in _STOP] or words
        for w in content:
            i, s = _slot("w:" + w)
            v[i] += 2.0 * s
            pw = f"#{w}#"
            for k in range(len(pw) - 2):
                i, s = _slot("c:" + pw[k:k + 3])
                v[i] += 0.5 * s
        n = float(np.linalg.norm(v))
        return v / n if n else v

    async def embed(self, ctx: Any, text: str) -> np.ndarray | None:
        return self.vector(text)


class BackendEmbedder:
    """Embeddings from the gateway's own backends (residency-checked against the request's decision)."""

    name = "backend"

    def __init__(self, model: str, config: Callable[[], Any], upstreams: Callable[[], Any], timeout_s: float) -> None:
        self.model = model
        self.config = config
        self.upstreams = upstreams
        self.timeout_s = timeout_s

    def _backend(self, ctx: Any) -> Any:
        from gateway.routing.stage import residency_reason

        for b in self.config().raw.backends:
            if self.model in (b.models or []) and residency_reason(ctx.decision, b) is None:
                return b
        return None

    async def embed(self, ctx: Any, text: str) -> np.ndarray | None:
        b = self._backend(ctx)
        if b is None:
            return None
        import httpx

        try:
            async with httpx.AsyncClient(trust_env=False, timeout=self.timeout_s) as client:
                auth = self.upstreams().auth(b.name)
                headers = {"authorization": auth} if auth else {}
                r = await asyncio.wait_for(client.post(b.url.rstrip("/") + "/embeddings", headers=headers,
                                                       json={"model": self.model, "input": text}), self.timeout_s)
            if r.status_code != 200:
                return None
            v = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)
        except Exception:
            return None
        n = float(np.linalg.norm(v))
        return v / n if n and math.isfinite(n) else None
