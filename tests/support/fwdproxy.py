"""A small HTTP forward proxy for tests: CONNECT tunnels (what clients do for https:// through HTTPS_PROXY)
and absolute-form requests (http:// through HTTP_PROXY), each logged as one line "METHOD TARGET" to a file,
so a test can tell which requests went through it.
Run: python -m tests.support.fwdproxy LISTEN_PORT LOG_PATH
"""
from __future__ import annotations

import asyncio
import sys
from urllib.parse import urlsplit


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        w.close()


async def main(listen: int, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            head = await cr.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            cw.close()
            return
        line, _, rest = head.partition(b"\r\n")
        method, target, version = line.decode("latin-1").split(" ", 2)
        log.write(f"{method} {target}\n")
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            try:
                ur, uw = await asyncio.open_connection(host.strip("[]"), int(port))
            except OSError:
                cw.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                cw.close()
                return
            cw.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await cw.drain()
        else:  # absolute-form: forward to the origin in origin-form; one request per connection
            u = urlsplit(target)
            try:
                ur, uw = await asyncio.open_connection(u.hostname, u.port or 80)
            except OSError:
                cw.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                cw.close()
                return
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            headers = [h for h in rest.split(b"\r\n") if h and not h.lower().startswith((b"proxy-", b"connection:"))]
            uw.write(f"{method} {path} {version}\r\n".encode("latin-1") + b"\r\n".join(headers)
                     + b"\r\nconnection: close\r\n\r\n")
        await asyncio.gather(_pipe(cr, uw), _pipe(ur, cw))

    server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
