"""A lean HTTP/1.1 load generator: raw asyncio protocols over keep-alive connections, one pre-built request.

Why: bench/overhead.py's httpx client spends more CPU per request than the gateway does, so on a 2-core box
it cannot push the gateway to saturation and "requests per core" there is measured off a mostly idle event
loop. This client costs a fraction of that (no header objects, no per-request allocation beyond the read
buffer), so a gateway pinned to one core can be driven until that core is full.

Usage (library): `await drive(host, port, request_bytes, connections, seconds)` -> (completed, errors, latencies).
"""
from __future__ import annotations

import asyncio
import time


def build_request(path: str, body: bytes, headers: dict[str, str] | None = None, host: str = "127.0.0.1") -> bytes:
    head = [f"POST {path} HTTP/1.1", f"host: {host}", "content-type: application/json",
            f"content-length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Conn(asyncio.Protocol):
    """Sends the request, waits for one full response (Content-Length or chunked), sends the next."""

    def __init__(self, req: bytes, stop_at: float, stats: dict) -> None:
        self.req = req
        self.stop_at = stop_at
        self.stats = stats
        self.buf = bytearray()
        self.t0 = 0.0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.tr = transport
        self._send()

    def _send(self) -> None:
        self.t0 = time.perf_counter()
        self.tr.write(self.req)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self.buf[:i]).lower()
            j = head.find(b"content-length:")
            if j >= 0:
                n = int(head[j + 15:].split(b"\r\n", 1)[0])
                end = i + 4 + n
                if len(self.buf) < end:
                    return
            elif b"transfer-encoding: chunked" in head:
                k = self.buf.find(b"\r\n0\r\n\r\n", i)
                if k < 0:
                    return
                end = k + 7
            else:
                self.stats["errors"] += 1
                self.tr.close()
                return
            ok = head.startswith(b"http/1.1 200")
            del self.buf[:end]
            self.stats["ok" if ok else "errors"] += 1
            self.stats["lat"].append(time.perf_counter() - self.t0)
            if time.perf_counter() >= self.stop_at:
                self.tr.close()
                return
            self._send()

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        if not self.done.done():
            self.done.set_result(None)


async def drive(host: str, port: int, req: bytes, connections: int, seconds: float) -> tuple[int, int, list[float]]:
    loop = asyncio.get_running_loop()
    stats: dict = {"ok": 0, "errors": 0, "lat": []}
    stop_at = time.perf_counter() + seconds
    conns = []
    for _ in range(connections):
        _, proto = await loop.create_connection(lambda: _Conn(req, stop_at, stats), host, port)
        conns.append(proto)
    await asyncio.wait_for(asyncio.gather(*(c.done for c in conns)), seconds + 30)
    return stats["ok"], stats["errors"], stats["lat"]
