"""Request -> token ids for KV-index matching: local tokenizer, else the engine's /tokenize, else approximate.

The approximate source hashes the rendered text in fixed-size character chunks into pseudo token ids, so two
requests sharing a text prefix share leading pseudo blocks; it can rank engines by overlap but its counts are
not the engine's tokens (evidence says which source was used).

Message prefixes (`PrefixTokenCache`): the token ids of a chat's earlier messages (system prompt and earlier
turns), keyed by a hash of exactly those messages, the model's request fields and the engine-visible cache salt
(so tenants under cache isolation never share an entry), learned off the request's path from one /tokenize of
the prefix that is checked to be a prefix of the full request's ids. The route stage's refusal before
tokenizing uses it: with the prefix's ids known, the KV index says where its chain of blocks breaks on each
engine, which bounds what can be cached there without tokenizing the request. `max_token_bytes` is learned from
the same answers (the longest token seen, in UTF-8 bytes) and bounds the tail: tokens >= bytes / that.
"""
from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from typing import Any

import orjson
import xxhash

from gateway.config import BackendConfig
from gateway.proxy.h1client import H1Transport
from gateway.proxy.transport import UpstreamBroken, UpstreamConnectError
from gateway.telemetry.local_tokenizer import LocalTokenizer
from gateway.telemetry.render import render_messages_plain

APPROX_CHARS_PER_TOKEN = 4
_MSG_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
_REQ_FIELDS = ("model", "tools", "chat_template_kwargs")


def approx_tokens(text: str) -> list[int]:
    """Pseudo token ids: one per 4-char chunk, hashed (stable across processes)."""
    n = APPROX_CHARS_PER_TOKEN
    return [xxhash.xxh32_intdigest(text[i:i + n].encode("utf-8")) for i in range(0, len(text), n)]


def prefix_keys(body: dict[str, Any], salt: str | None, scope: str = "") -> list[bytes]:
    """Key of each message prefix of a chat body: [key of messages[:1], ..., messages[:n-1]] (never the whole
    chat: its last message is the new tail). Hashed incrementally, one pass over the messages; the key covers
    the request fields that change the template's output (model, tools, chat_template_kwargs), the scope (the
    engine endpoint) and the engine-visible cache salt."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or len(msgs) < 2:
        return []
    h = xxhash.xxh3_128()
    h.update(orjson.dumps({k: body.get(k) for k in _REQ_FIELDS}, option=orjson.OPT_SORT_KEYS, default=str))
    h.update(b"\x00" + scope.encode() + b"\x00" + (salt or "").encode() + b"\x01")
    out: list[bytes] = []
    for m in msgs[:-1]:
        mm = {k: m.get(k) for k in _MSG_FIELDS} if isinstance(m, dict) else m
        h.update(orjson.dumps(mm, option=orjson.OPT_SORT_KEYS, default=str) + b"\x1e")
        out.append(h.digest())
    return out


def content_bytes(messages: list[Any]) -> int:
    """UTF-8 bytes of the messages' text content (template tokens not counted: a lower bound's input)."""
    n = 0
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        if isinstance(c, str):
            n += len(c.encode("utf-8", "surrogatepass"))
    return n


def tail_token_lower_bound(tail_bytes: int, max_token_bytes: int | None) -> int:
    """Tokens at least needed for `tail_bytes` of text when no token is longer than `max_token_bytes` bytes
    (ceil); 0 when that is not known yet. Byte-level BPE covers every byte of the text once, so the bound holds
    for any vocabulary whose longest token is that long; the value used is the longest seen, doubled."""
    if not max_token_bytes or tail_bytes <= 0:
        return 0
    b = 2 * max_token_bytes
    return -(-tail_bytes // b)


def is_prefix(short: list[int] | tuple[int, ...], full: list[int] | tuple[int, ...]) -> bool:
    return len(short) <= len(full) and tuple(full[:len(short)]) == tuple(short)


class PrefixTokenCache:
    """LRU of message-prefix key -> the prefix's token ids (see module docstring), and per scope the longest
    token seen in bytes. Bounded by entries and by tokens held (ids stored as 4-byte arrays: the default 4M
    tokens are 16 MB)."""

    def __init__(self, size: int = 1024, max_tokens: int = 4_000_000) -> None:
        self.size = size
        self.max_tokens = max_tokens
        self.tokens_held = 0
        self._ids: OrderedDict[bytes, array] = OrderedDict()
        self.max_token_bytes: dict[str, int] = {}
        self.hits = 0
        self.learned = 0
        self.mismatched = 0  # the prefix's ids were not a prefix of the full request's: not stored

    def get(self, key: bytes) -> tuple[int, ...] | None:
        v = self._ids.get(key)
        if v is None:
            return None
        self._ids.move_to_end(key)
        return tuple(v)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ids

    def longest(self, keys: list[bytes]) -> tuple[int, tuple[int, ...]] | None:
        """(number of messages, ids) of the longest cached prefix among `keys` (prefix_keys order)."""
        for k in range(len(keys), 0, -1):
            v = self.get(keys[k - 1])
            if v is not None:
                self.hits += 1
                return k, v
        return None

    def put(self, key: bytes, ids: list[int], full_ids: list[int]) -> bool:
        """Store the prefix's ids only when they are a prefix of the full request's ids (a template that renders
        earlier messages differently depending on later ones is never cached)."""
        if not ids or not is_prefix(ids, full_ids):
            self.mismatched += 1
            return False
        if len(ids) > self.max_tokens or any(not 0 <= t < 2 ** 31 for t in ids):
            return False
        old = self._ids.pop(key, None)
        if old is not None:
            self.tokens_held -= len(old)
        self._ids[key] = array("i", ids)
        self.tokens_held += len(ids)
        self.learned += 1
        while len(self._ids) > self.size or self.tokens_held > self.max_tokens:
            self.tokens_held -= len(self._ids.popitem(last=False)[1])
        return True

    def observe_token_strs(self, scope: str, strs: list[Any]) -> None:
        m = max((len(s.encode("utf-8", "surrogatepass")) for s in strs if isinstance(s, str)), default=0)
        if m > self.max_token_bytes.get(scope, 0):
            self.max_token_bytes[scope] = m


class TokenizeClient:
    """POST /tokenize to engines through the native HTTP/1.1 client (gateway/proxy/h1client.py), one keep-alive
    pool per server root. A refusal waits on this round trip when no bound decides it earlier, so it is on the
    critical path: httpx cost several times the client CPU per call and a longer round trip (docs/benchmarks.md,
    "Engine /tokenize round trip")."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pools: dict[str, H1Transport] = {}

    def _pool(self, server_root: str) -> H1Transport:
        t = self._pools.get(server_root)
        if t is None:
            t = self._pools[server_root] = H1Transport(BackendConfig(name="tokenize", url=server_root))
        return t

    async def post(self, server_root: str, req: dict[str, Any]) -> dict[str, Any] | None:
        """The engine's JSON answer, or None for anything but a 200 with a JSON object (a timeout, a refused or
        broken connection, an error status, a body that is not JSON): the caller falls back."""
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self._pool(server_root).post("/tokenize", orjson.dumps(req),
                                                          {"content-type": "application/json"})
                try:
                    data = await resp.aread()
                finally:
                    await resp.aclose()
            if resp.status != 200:
                return None
            js = orjson.loads(data)
        except (TimeoutError, OSError, UpstreamBroken, UpstreamConnectError, TypeError, ValueError):
            return None
        return js if isinstance(js, dict) else None

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for t in pools.values():
            await t.aclose()


class TokenSource:
    """Resolves a request body to (token ids, source); caches by (model, rendered request) in an LRU.

    Cached token ids decode back to the prompt, so a request under zero retention passes `retain=False`:
    it is tokenized, used and dropped, and neither reads nor writes the cache (counted in `uncached`).
    """

    def __init__(self, mode: str = "auto", cache_size: int = 4096, timeout_s: float = 0.5) -> None:
        self.mode = mode  # auto | engine | approx | <path to tokenizer.json or its folder>
        self._client = TokenizeClient(timeout_s)
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
        self.prefixes = PrefixTokenCache()

    def cached_prefix(self, endpoint: str, body: dict[str, Any], salt: str | None
                      ) -> tuple[tuple[int, ...], int] | None:
        """(ids of the longest cached message prefix, token lower bound of the rest's content) or None."""
        hit = self.prefixes.longest(prefix_keys(body, salt, endpoint))
        if hit is None:
            return None
        k, ids = hit
        tail = tail_token_lower_bound(content_bytes(body["messages"][k:]), self.prefixes.max_token_bytes.get(endpoint))
        return ids, tail

    async def learn_prefix(self, endpoint: str, body: dict[str, Any], full_ids: list[int], salt: str | None,
                           form: str = "vllm") -> bool:
        """Off the request's path: tokenize the chat's earlier messages (all but the last) on the engine and cache
        their ids when they are a prefix of `full_ids`. Never for zero-retention requests (the caller's job).
        vLLM answers `token_strs` too (the tail bound's longest token); SGLang's /tokenize has none (its
        TokenizeResponse is tokens, count, max_model_len), so an SGLang engine's prefixes give no tail bound."""
        keys = prefix_keys(body, salt, endpoint)
        if not keys or keys[-1] in self.prefixes:
            return False
        req: dict[str, Any] = {"model": body.get("model"), "messages": body["messages"][:-1],
                               "add_generation_prompt": False, "return_token_strs": True}
        if body.get("tools"):
            req["tools"] = body["tools"]
        js = await self._client.post(endpoint, req)
        if js is None:
            return False
        toks = js.get("tokens")
        if not isinstance(toks, list):
            return False
        if isinstance(js.get("token_strs"), list) and len(js["token_strs"]) == len(toks):
            self.prefixes.observe_token_strs(endpoint, js["token_strs"])
        return self.prefixes.put(keys[-1], toks, full_ids)

    async def close(self) -> None:
        await self._client.aclose()

    def _key(self, endpoint: str | None, body: dict[str, Any]) -> bytes:
        sub = {k: body.get(k) for k in ("model", "messages", "prompt", "tools", "chat_template_kwargs")}
        return xxhash.xxh3_128_digest(orjson.dumps(sub, option=orjson.OPT_SORT_KEYS, default=str)) + \
            (endpoint or "").encode()

    async def tokens(self, endpoint: str | None, body: dict[str, Any], retain: bool = True, form: str = "vllm"
                     ) -> tuple[list[int], str]:
        """Token ids for the request's prompt and the source that produced them ("local"/"engine"/"approx");
        `form`: the engine's /tokenize dialect (vllm | sglang).

        retain=False (zero retention): resolve without touching the cache, so nothing of the prompt outlives
        the call here."""
        if not retain:
            self.uncached += 1
            res = await self._resolve(endpoint, body, form)
            self.by_source[res[1]] = self.by_source.get(res[1], 0) + 1
            return res
        key = self._key(endpoint if self._local is None else None, body)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        res = await self._resolve(endpoint, body, form)
        self._cache[key] = res
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        self.by_source[res[1]] = self.by_source.get(res[1], 0) + 1
        return res

    async def _resolve(self, endpoint: str | None, body: dict[str, Any], form: str = "vllm"
                       ) -> tuple[list[int], str]:
        if self._local is not None:
            try:
                return self._local.encode_body(body), "local"
            except Exception:
                pass
        if self.mode in ("auto", "engine") or self._local is None and self.mode != "approx":
            if endpoint:
                ids = await self._engine_tokenize(endpoint, body, form)
                if ids is not None:
                    return ids, "engine"
        if "messages" in body:
            text = render_messages_plain(body["messages"])
        else:
            p = body.get("prompt", "")
            text = p if isinstance(p, str) else "".join(map(str, p))
        return approx_tokens(text), "approx"

    async def _engine_tokenize(self, server_root: str, body: dict[str, Any], form: str = "vllm") -> list[int] | None:
        """The engine's POST /tokenize: {model, messages, add_generation_prompt} or {model, prompt} (vLLM). SGLang's
        (sglang/srt/entrypoints/openai/serving_tokenize.py, 0.5.23) renders messages "as for a chat completion"
        only without `add_generation_prompt` (given, it is passed to a Jinja template as it is, and refused for a
        named template), so an SGLang engine is asked without it; both answer {"tokens": [...], ...}."""
        req: dict[str, Any] = {"model": body.get("model")}
        if "messages" in body:
            req["messages"] = body["messages"]
            if form != "sglang":
                req["add_generation_prompt"] = True
            if body.get("tools"):
                req["tools"] = body["tools"]
        else:
            p = body.get("prompt", "")
            req["prompt"] = p if isinstance(p, str) else "".join(map(str, p))
        js = await self._client.post(server_root, req)
        toks = js.get("tokens") if js is not None else None
        return toks if isinstance(toks, list) else None
