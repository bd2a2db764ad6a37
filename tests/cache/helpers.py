"""Build request contexts and drive the cache stage directly (no network)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.cache.config import CacheConfig, CacheLocation
from gateway.cache.embed import LexicalEmbedder
from gateway.cache.spec import CacheSpec
from gateway.cache.stage import CacheStage
from gateway.cache.store import MemoryStore
from gateway.pipeline import RequestContext
from gateway.types import Decision, Principal, Usage


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_stage(location: str | None = "DE", stores: Any = None, **cfg: Any) -> tuple[CacheStage, Any, Clock]:
    """A stage over a fresh store: `stores` (the conftest fixture) picks memory / sqlite / redis."""
    cc = CacheConfig(location=CacheLocation(country=location) if location else None, **cfg)
    store = stores(cc.max_entries, cc.location, cc.max_partition_entries) if stores is not None else \
        MemoryStore(cc.max_entries, cc.location)
    clock = Clock()
    stage = CacheStage(lambda: SimpleNamespace(raw=SimpleNamespace(cache=cc)), store, LexicalEmbedder(), None, clock)
    return stage, store, clock


_n = 0


def make_ctx(messages: list[dict[str, Any]] | None = None, *, tenant: str = "a", team: str | None = None,
             model: str = "m", mode: str = "semantic", similarity: float | None = 0.9, ttl_s: float | None = 60,
             scope: str = "tenant", retention: str | None = None, countries: frozenset[str] | None = None,
             stream: bool = False, endpoint: str = "chat", **body: Any) -> RequestContext:
    global _n
    _n += 1
    b = {"model": model, "messages": messages or [{"role": "user", "content": "hello"}], **body}
    ctx = RequestContext(request_id=f"req_{_n}", endpoint=endpoint, headers={}, body=b)
    ctx.model = model
    ctx.stream = stream
    ctx.principal = Principal(id=f"key:{tenant}", kind="static_key", tenant=tenant, team=team)
    spec = CacheSpec(mode=mode, ttl_s=ttl_s, similarity=similarity if mode == "semantic" else None, scope=scope)
    ctx.decision = Decision(retention=retention, allowed_countries=countries, cache=spec)  # type: ignore[arg-type]
    return ctx


def completion(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


async def serve(stage: CacheStage, ctx: RequestContext, answer: str) -> str:
    """Run the stage; on a miss complete the request with `answer` as the upstream's; return the cache header."""
    await stage.run(ctx)
    if ctx.cache is not None:
        ctx.cache.capture.json(completion(answer))
        ctx.usage = Usage(10, 5)
        ctx.status = 200
    await stage.finish(ctx)
    return ctx.extra_headers.get("x-gateway-cache", "")


def answer_of(ctx: RequestContext) -> str | None:
    import orjson

    a = ctx.answer
    if a is None:
        return None
    obj = a.obj if hasattr(a, "obj") else orjson.loads(a.body)
    return obj["choices"][0]["message"]["content"]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]
