"""bench/loadgen.py counts exactly the responses a server sent, over keep-alive, Content-Length or chunked."""
from __future__ import annotations

import asyncio

from bench.loadgen import build_request, drive


async def _server(responses: list[bytes]) -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        i = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                seen.append(head + await reader.readexactly(n))
                writer.write(responses[i % len(responses)])
                i += 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], seen


def test_counts_ok_and_errors_over_keep_alive() -> None:
    ok_cl = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    ok_chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    bad = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\n\r\n"

    async def go():
        srv, port, seen = await _server([ok_cl, ok_chunked, bad])
        req = build_request("/v1/x", b'{"a":1}', {"authorization": "Bearer k"})
        ok, err, lat = await drive("127.0.0.1", port, req, 2, 0.3)
        srv.close()
        await srv.wait_closed()
        return ok, err, lat, seen

    ok, err, lat, seen = asyncio.run(go())
    assert ok > 10 and err > 5 and len(lat) == ok + err
    assert abs(ok - 2 * err) <= 4  # two 200s (length, chunked) per 429 on each connection
    assert all(s.startswith(b"POST /v1/x HTTP/1.1\r\n") and s.endswith(b'{"a":1}') for s in seen)
    assert len(seen) >= ok + err
