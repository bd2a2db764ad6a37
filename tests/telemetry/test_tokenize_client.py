"""The engine /tokenize client (TokenizeClient, native HTTP/1.1): a 200 with a JSON object is the answer; every
other outcome (error status, a body that is not JSON or not an object, a connection refused or cut, an engine
that does not answer within the timeout) is None, so the caller falls back instead of failing the request."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import orjson

from gateway.telemetry.tokens import TokenizeClient, TokenSource


@asynccontextmanager
async def engine(answer: Callable[[bytes], bytes | None]) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A raw HTTP/1.1 server on 127.0.0.1: reads one request (head + Content-Length body) per turn and writes
    what `answer(body)` returns (None: never answers). Yields (server root, bodies received)."""
    seen: list[bytes] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = next(int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n")
                         if ln.lower().startswith(b"content-length:"))
                body = await r.readexactly(n)
                seen.append(head + body)
                out = answer(body)
                if out is None:
                    await asyncio.sleep(3600)
                w.write(out)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        srv.close()


def http(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(body), body)


async def test_a_200_json_object_is_the_answer_and_the_connection_is_kept():
    def ok(body: bytes) -> bytes:
        req = orjson.loads(body)
        return http(200, orjson.dumps({"count": 3, "tokens": [1, 2, len(req["messages"])]}))

    async with engine(ok) as (root, seen):
        c = TokenizeClient(1.0)
        try:
            req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
            assert await c.post(root, req) == {"count": 3, "tokens": [1, 2, 1]}
            assert await c.post(root + "/", req) == {"count": 3, "tokens": [1, 2, 1]}
            assert seen[0].startswith(b"POST /tokenize HTTP/1.1\r\n")
            assert orjson.loads(seen[0].split(b"\r\n\r\n", 1)[1]) == req
        finally:
            await c.aclose()


async def test_a_server_root_with_a_path_keeps_it():
    async with engine(lambda b: http(200, b'{"tokens": []}')) as (root, seen):
        c = TokenizeClient(1.0)
        try:
            assert await c.post(root + "/engine-a", {"model": "m", "prompt": "x"}) == {"tokens": []}
            assert seen[0].startswith(b"POST /engine-a/tokenize HTTP/1.1\r\n")
        finally:
            await c.aclose()


async def test_anything_but_a_200_json_object_is_none():
    answers = iter([http(500, b'{"error": "boom"}'), http(200, b"not json"), http(200, b"[1, 2]"),
                    http(404, b"")])
    async with engine(lambda b: next(answers)) as (root, _):
        c = TokenizeClient(1.0)
        try:
            for _ in range(4):
                assert await c.post(root, {"model": "m", "prompt": "x"}) is None
        finally:
            await c.aclose()


async def test_an_engine_that_does_not_answer_is_none_within_the_timeout():
    async with engine(lambda b: None) as (root, _):
        c = TokenizeClient(0.2)
        try:
            t0 = asyncio.get_running_loop().time()
            assert await c.post(root, {"model": "m", "prompt": "x"}) is None
            assert asyncio.get_running_loop().time() - t0 < 2.0
        finally:
            await c.aclose()


async def test_a_refused_connection_and_an_unencodable_body_are_none():
    c = TokenizeClient(0.5)
    try:
        assert await c.post("http://127.0.0.1:9", {"model": "m", "prompt": "x"}) is None
        assert await c.post("http://127.0.0.1:9", {"model": "m", "prompt": 1 << 70}) is None
    finally:
        await c.aclose()


async def test_token_source_falls_back_to_approx_when_the_engine_answers_an_error():
    async with engine(lambda b: http(503, b'{"error": "loading"}')) as (root, seen):
        ts = TokenSource("auto", timeout_s=1.0)
        try:
            toks, src = await ts.tokens(root, {"model": "m", "messages": [{"role": "user", "content": "hello"}]})
            assert src == "approx" and toks and len(seen) == 1
        finally:
            await ts.close()
