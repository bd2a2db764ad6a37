"""A deliberately minimal, fast OpenAI-compatible upstream (asyncio protocol, keep-alive) for overhead benchmarks,
so the upstream is never the bottleneck when measuring what the gateway adds."""
from __future__ import annotations

import asyncio
import sys

import orjson

JSON_BODY = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hello world"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
CHUNK = b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
USAGE = b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":16,"total_tokens":21}}\n\n'
SSE_BODY = CHUNK * 16 + USAGE + b"data: [DONE]\n\n"


def _resp(body: bytes, ctype: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


JSON_RESP = _resp(JSON_BODY, b"application/json")
SSE_RESP = _resp(SSE_BODY, b"text/event-stream")
HEALTH_RESP = _resp(b"", b"text/plain")


class Proto(asyncio.Protocol):
    def connection_made(self, transport):
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = self.buf[:i].lower()
            j = head.find(b"content-length:")
            n = int(head[j + 15:].split(b"\r\n", 1)[0]) if j >= 0 else 0
            if len(self.buf) < i + 4 + n:
                return
            body = self.buf[i + 4:i + 4 + n]
            self.buf = self.buf[i + 4 + n:]
            if head.startswith(b"get"):
                self.t.write(HEALTH_RESP)
            elif b'"stream":true' in body:
                self.t.write(SSE_RESP)
            else:
                self.t.write(JSON_RESP)


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Proto, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(int(sys.argv[1])))
