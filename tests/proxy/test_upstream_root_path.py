"""Upstream paths: relative to a backend's URL (`chat/completions` -> /v1/chat/completions), or, with a leading
'/', relative to its server root (the URL without a trailing /v1: `/tokenize` -> /tokenize, where vLLM serves
it). Every transport (native, aiohttp, httpx) against a real HTTP server recording the request targets."""
from __future__ import annotations

import asyncio

import pytest

from gateway.config import BackendConfig
from gateway.proxy.upstream import make_transport
from tests.support.procs import free_port


async def _serve(seen: list[str]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode()
            seen.append(line.split(" ")[1])
            n = 0
            for h in head.split(b"\r\n")[1:]:
                if h.lower().startswith(b"content-length:"):
                    n = int(h.split(b":", 1)[1])
            await reader.readexactly(n)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()

    port = free_port()
    return await asyncio.start_server(handle, "127.0.0.1", port), port


@pytest.mark.parametrize("kind", ["native", "aiohttp", "httpx"])
@pytest.mark.parametrize("base,expect", [
    ("/v1", {"chat/completions": "/v1/chat/completions", "/tokenize": "/tokenize"}),
    ("/v1/", {"rerank": "/v1/rerank", "/tokenize": "/tokenize"}),
    ("/team-a/v1", {"responses": "/team-a/v1/responses", "/tokenize": "/team-a/tokenize"}),
    ("", {"score": "/score", "/tokenize": "/tokenize"}),
])
async def test_relative_and_server_root_paths(kind: str, base: str, expect: dict[str, str]) -> None:
    seen: list[str] = []
    server, port = await _serve(seen)
    t = make_transport(kind, BackendConfig(name="b", url=f"http://127.0.0.1:{port}{base}"))
    try:
        for path in expect:
            r = await t.post(path, b"{}", {"content-type": "application/json"})
            assert r.status == 200 and await r.aread() == b"{}"
            await r.aclose()
    finally:
        await t.aclose()
        server.close()
    assert seen == list(expect.values())
