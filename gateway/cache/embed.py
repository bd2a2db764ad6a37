"""Embedders of the semantic tier: one async `embed(ctx, text) -> vector | None` interface.

`WordLlamaEmbedder` is the default (`cache.embedder: wordllama`): the `wordllama` package's bundled model
(l2_supercat, 256 dims, 16 MB of token embeddings averaged over the lower-cased text's tokens), loaded from the installed
package's own files with downloads disabled, so it never reaches the network; it knows synonyms. Loaded once
per process, off the event loop, at the first semantic lookup. `LexicalEmbedder`: hashed word and
character-trigram features (no model, deterministic); it catches rewordings that keep the content words
(politeness, order, punctuation, filler), not synonyms. `BackendEmbedder` asks a model served at /v1/embeddings
by one of the gateway's own backends, chosen like any request for the model and refused where the request's
residency does not allow it; any failure or timeout is `None`, i.e. a miss, never an error for the client.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import logging
import math
import re
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

log = logging.getLogger("gateway.cache")
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


class EmbedderUnavailable(RuntimeError):
    """The configured embedder cannot run here (its package or bundled files are missing)."""


WORDLLAMA_CONFIG, WORDLLAMA_DIMS = "l2_supercat", 256
_WL_FILES = (f"weights/{WORDLLAMA_CONFIG}_{WORDLLAMA_DIMS}.safetensors",
             f"tokenizers/{WORDLLAMA_CONFIG}_tokenizer_config.json")
_wl_lock = threading.Lock()
_wl_model: Any = None


def wordllama_dir() -> Path:
    """The installed `wordllama` package's directory, checked to hold the bundled weights and tokenizer (found
    without importing it: a missing package is a config error at start, not a failed first request)."""
    spec = importlib.util.find_spec("wordllama")
    if spec is None or not spec.origin:
        raise EmbedderUnavailable("the wordllama package is not installed (pip install wordllama; it is a runtime "
                                  "dependency of the gateway) - or set cache.embedder: lexical")
    d = Path(spec.origin).parent
    missing = [f for f in _WL_FILES if not (d / f).is_file()]
    if missing:
        raise EmbedderUnavailable(f"the wordllama package at {d} lacks its bundled {', '.join(missing)}")
    return d


def load_wordllama() -> Any:
    """The process's one WordLlama model (loaded on first call; later calls return it)."""
    global _wl_model
    with _wl_lock:
        if _wl_model is None:
            d = wordllama_dir()
            root = logging.getLogger()
            guard = None
            if not root.handlers:  # wordllama.inference calls logging.basicConfig() on import: keep it a no-op
                guard = logging.NullHandler()
                root.addHandler(guard)
            try:
                from wordllama import WordLlama
            finally:
                if guard is not None:
                    root.removeHandler(guard)
            # cache_dir = the package dir: the weights are found in <pkg>/weights and the tokenizer in
            # <pkg>/tokenizers (its default lookup of the tokenizer misses the bundled file and would download
            # it); disable_download: a missing file raises instead of reaching the network.
            _wl_model = WordLlama.load(config=WORDLLAMA_CONFIG, dim=WORDLLAMA_DIMS, cache_dir=d,
                                       disable_download=True)
        return _wl_model


class WordLlamaEmbedder:
    """The bundled wordllama model; `wordllama_dir()` is checked at construction (config check at start and
    reload), the model itself loaded once per process on first use, in a thread (its load time:
    docs/benchmarks.md, "Response cache")."""

    name = "wordllama"
    dims = WORDLLAMA_DIMS

    def __init__(self) -> None:
        wordllama_dir()

    def vector(self, text: str) -> np.ndarray | None:
        # lower-cased: the model's tokenizer is case-sensitive ("orion" and "Orion" are different tokens), and
        # case carries no intent here (the entity guard compares names itself)
        v = np.asarray(load_wordllama().embed([text.lower()])[0], dtype=np.float32)
        n = float(np.linalg.norm(v))
        return v / n if n and math.isfinite(n) else None  # no known token (e.g. empty text): a miss

    async def embed(self, ctx: Any, text: str) -> np.ndarray | None:
        try:
            if _wl_model is None:
                await asyncio.to_thread(load_wordllama)
            return self.vector(text)
        except Exception as e:  # a model that fails to load or embed is a miss, never an error for the client
            log.warning("cache embedder wordllama failed: %s", e)
            return None


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
