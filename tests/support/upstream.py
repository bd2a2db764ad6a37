"""A small OpenAI-compatible upstream process for the gateway's core tests, with faults on request.

Faults come in the request body (`x_test_fault`), which the gateway forwards untouched:
  "error500" | "error503" | "error400" | "hang" | "slow_first:<s>" | "die_mid" | "slow_chunks:<s>" | "bad_json".
Latency per request, like a partner API's: `x_test_latency: {"first_s": 0.2, "chunk_s": 0.01}` (the time to the
first token, then between chunks).
GET /stats tells what the upstream saw (requests, streams cancelled by a disconnecting gateway, hung requests whose
caller went away, last body).
Run: python -m tests.support.upstream --port P [--key KEY]
"""
from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

STATS = {"requests": 0, "streams_started": 0, "streams_cancelled": 0, "streams_completed": 0, "last_body": None,
         "last_headers": None, "in_flight": 0, "hangs_abandoned": 0}
WORDS = ["hello", " world", " from", " the", " upstream", " test", " engine", " ok"]


def _fault(body: dict) -> tuple[str, float]:
    f = str(body.get("x_test_fault") or "")
    name, _, arg = f.partition(":")
    return name, float(arg) if arg else 0.0


def _auth_ok(request: Request, key: str | None) -> bool:
    return key is None or request.headers.get("authorization") == f"Bearer {key}"


def make_app(key: str | None = None) -> Starlette:
    async def completions(request: Request) -> Response:
        STATS["requests"] += 1
        if not _auth_ok(request, key):
            return JSONResponse({"error": {"message": "bad upstream key", "type": "auth", "code": "invalid_api_key"}},
                                status_code=401)
        body = orjson.loads(await request.body())
        STATS["last_body"] = body
        STATS["last_headers"] = dict(request.headers)
        fault, arg = _fault(body)
        chat = request.url.path.endswith("chat/completions")
        if fault == "error500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if fault == "error503":
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=503)
        if fault == "error400":
            return JSONResponse({"error": {"message": "context too long", "type": "invalid_request_error",
                                           "param": "messages", "code": "context_length_exceeded"}}, status_code=400)
        if fault == "hang":  # never answers; counts the caller closing the connection on it
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            STATS["hangs_abandoned"] += 1
            return Response(b"")
        lat = body.get("x_test_latency") or {}
        if fault == "slow_first":
            await asyncio.sleep(arg)
        if lat.get("first_s"):
            await asyncio.sleep(float(lat["first_s"]))
        if fault == "bad_json":
            return Response(b"{not json", media_type="application/json")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        prompt_tokens = 11
        rid = "cmpl-test"
        if not body.get("stream"):
            text = "".join(WORDS[i % len(WORDS)] for i in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": body["model"], "choices": [choice],
                                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                           "total_tokens": prompt_tokens + n,
                                           "prompt_tokens_details": {"cached_tokens": 0}}})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def gen():
            STATS["streams_started"] += 1
            STATS["in_flight"] += 1
            try:
                obj = "chat.completion.chunk" if chat else "text_completion"
                if chat:
                    yield b"data: " + orjson.dumps({"id": rid, "object": obj, "model": body["model"], "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + b"\n\n"
                for i in range(n):
                    if fault == "die_mid" and i == n // 2:
                        raise RuntimeError("simulated engine death")
                    if fault == "slow_chunks" and i > 0:
                        await asyncio.sleep(arg)
                    if lat.get("chunk_s") and i > 0:
                        await asyncio.sleep(float(lat["chunk_s"]))
                    w = WORDS[i % len(WORDS)]
                    ch = ({"index": 0, "delta": {"content": w}, "finish_reason": None} if chat
                          else {"index": 0, "text": w, "finish_reason": None})
                    if i == n - 1:
                        ch["finish_reason"] = "length"
                    yield b"data: " + orjson.dumps({"id": rid, "object": obj, "model": body["model"],
                                                    "choices": [ch], "usage": None}) + b"\n\n"
                if include_usage:
                    yield b"data: " + orjson.dumps({"id": rid, "object": obj, "model": body["model"], "choices": [],
                                                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                              "total_tokens": prompt_tokens + n,
                                                              "prompt_tokens_details": {"cached_tokens": 0}}}) + b"\n\n"
                yield b"data: [DONE]\n\n"
                STATS["streams_completed"] += 1
            except asyncio.CancelledError:
                STATS["streams_cancelled"] += 1
                raise
            finally:
                STATS["in_flight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def embeddings(request: Request) -> Response:
        STATS["requests"] += 1
        body = orjson.loads(await request.body())
        STATS["last_body"] = body
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return JSONResponse({"object": "list", "model": body["model"], "data": [
            {"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i, _ in enumerate(inputs)],
            "usage": {"prompt_tokens": 3 * len(inputs), "total_tokens": 3 * len(inputs)}})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "mock-model", "object": "model"}]})

    async def health(request: Request) -> Response:
        return Response(b"")

    async def stats(request: Request) -> Response:
        return JSONResponse(STATS)

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models), Route("/health", health), Route("/stats", stats)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--key")
    ap.add_argument("--tls-cert", help="serve https with this certificate (PEM; --tls-key its key)")
    ap.add_argument("--tls-key")
    a = ap.parse_args()
    uvicorn.run(make_app(a.key), host="127.0.0.1", port=a.port, log_level="warning", loop="uvloop", http="httptools",
                ssl_certfile=a.tls_cert, ssl_keyfile=a.tls_key)


if __name__ == "__main__":
    main()
