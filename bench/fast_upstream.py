"""A deliberately minimal, fast OpenAI-compatible upstream (asyncio protocol, keep-alive) for overhead benchmarks,
so the upstream is never the bottleneck when measuring what the gateway adds.

A streamed request gets `max_tokens` content events (16 when absent; at most 100,000), then a usage-only
event and `data: [DONE]`, all in one write (bench/streaming.py asks for 20/200/1000-event streams); with
`"x_bench_gap_ms": G` in the body, as a chunked response with one write (and one HTTP chunk) per event, G ms
apart, the way an engine sends tokens as it generates them.
`fast_upstream.py PORT [FIRST_MS [GAP_MS]]`: every answer waits FIRST_MS before its first token (a JSON answer:
before it is sent), and a stream then sends its events GAP_MS apart: a partner API's shape (bench/harm.py)."""
from __future__ import annotations

import asyncio
import sys

import orjson

JSON_BODY = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hello world"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
CHUNK = b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
USAGE = b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":16,"total_tokens":21}}\n\n'


def sse_body(n: int) -> bytes:
    usage = USAGE.replace(b'"completion_tokens":16,"total_tokens":21', f'"completion_tokens":{n},"total_tokens":{n + 5}'
                          .encode())
    return CHUNK * n + usage + b"data: [DONE]\n\n"


def _resp(body: bytes, ctype: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


JSON_RESP = _resp(JSON_BODY, b"application/json")
_SSE: dict[int, bytes] = {}


def stream_params(body: bytes) -> tuple[int, float]:
    """(content events, ms between events: 0 = all in one write) of a streamed request."""
    try:
        obj = orjson.loads(body)
        n = int(obj.get("max_tokens") or 16)
        gap = float(obj.get("x_bench_gap_ms") or 0.0)
    except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
        n, gap = 16, 0.0
    return max(1, min(n, 100_000)), max(0.0, gap)


def sse_resp(n: int) -> bytes:
    """The canned stream of n content events in one response (cached per event count)."""
    r = _SSE.get(n)
    if r is None:
        r = _SSE[n] = _resp(sse_body(n), b"text/event-stream")
    return r


HEALTH_RESP = _resp(b"", b"text/plain")


def _chunk(b: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(b), b)


async def paced(t: asyncio.Transport, n: int, gap_s: float, first_s: float | None = None) -> None:
    """One HTTP chunk per event: the first after first_s (gap_s when not given), the rest gap_s apart. Headers at
    once, as a partner API sends them before its first token."""
    t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    events = sse_body(n).split(b"\n\n")[:-1]
    for i, ev in enumerate(events):
        wait = gap_s if i or first_s is None else first_s
        if wait:
            await asyncio.sleep(wait)
        if t.is_closing():
            return
        t.write(_chunk(ev + b"\n\n"))
    t.write(b"0\r\n\r\n")


FIRST_S = 0.0  # set from the command line: the time to the first token of every answer
GAP_S = 0.0


async def delayed(t: asyncio.Transport, data: bytes, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    if not t.is_closing():
        t.write(data)


class Proto(asyncio.Protocol):
    def connection_made(self, transport):
        self.t = transport
        self.buf = b""
        self.task: asyncio.Task | None = None

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
            elif FIRST_S and b'"stream":true' in body:
                n, _ = stream_params(body)
                self.task = asyncio.ensure_future(paced(self.t, n, GAP_S, FIRST_S))
            elif FIRST_S:
                n, _ = stream_params(body)
                self.task = asyncio.ensure_future(delayed(self.t, JSON_RESP, FIRST_S + GAP_S * max(0, n - 1)))
            elif b'"stream":true' in body:
                n, gap = stream_params(body)
                if gap > 0:
                    self.task = asyncio.ensure_future(paced(self.t, n, gap / 1000))
                else:
                    self.t.write(sse_resp(n))
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
    if len(sys.argv) > 2:
        FIRST_S = float(sys.argv[2]) / 1000
    if len(sys.argv) > 3:
        GAP_S = float(sys.argv[3]) / 1000
    asyncio.run(main(int(sys.argv[1])))
