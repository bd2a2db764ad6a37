"""A hostile upstream for the gateway's end-to-end tests: a raw HTTP/1.1 server on asyncio streams, run on a
loop of its own in a thread of the test process, whose every answer is scripted by the test.

A request is recognised by a tag anywhere in its body (e.g. a message's content): `script(tag, raw, close)`
says what the server writes back for it (raw bytes: a status line, headers and any part of a body) and
whether it then closes the connection or holds it open, sending nothing more, until the peer closes it.
Per tag the test can wait for (threading events, no timing): the request fully received and the scripted
bytes written (`received`), and
the gateway's side of its connection closed (`closed`: the read returned EOF or the connection was reset).
Untagged requests (health probes) get `200 {}`.
"""
from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field

_TAG = re.compile(rb"probe-[A-Za-z0-9_\-]+")


@dataclass
class Seen:
    received: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    path: str = ""


class HostileUpstream:
    def __init__(self) -> None:
        self.scripts: dict[str, tuple[bytes, bool]] = {}
        self.seen: dict[str, Seen] = {}
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-upstream", daemon=True)
        self._thread.start()
        self._ready.wait()

    # -- the test's side
    def script(self, tag: str, raw: bytes, close: bool) -> Seen:
        with self._lock:
            self.scripts[tag] = (raw, close)
            return self.seen.setdefault(tag, Seen())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # -- the server
    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: requests one after another on this connection
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                m = _TAG.search(body)
                if m is None:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                tag = m.group(0).decode()
                with self._lock:
                    seen = self.seen.setdefault(tag, Seen())
                    raw, close = self.scripts.get(tag, (b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0"
                                                          b"\r\n\r\n", True))
                seen.headers, seen.body, seen.path = headers, body, lines[0].split(" ")[1]
                if raw:
                    writer.write(raw)
                    await writer.drain()
                seen.received.set()  # the request is in and the scripted bytes are on their way
                if close:
                    return
                # hold the connection open, sending nothing, until the gateway closes its side
                try:
                    while await reader.read(65536):
                        pass
                except ConnectionError:
                    pass
                seen.closed.set()
                return
        finally:
            writer.close()
