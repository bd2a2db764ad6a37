"""Push mode of the stream relay (issue 24, paced streams): after the first read, each upstream read of a stream
is processed and written to the client inside the native client's read callback (h1client `push_within`,
forward.stream_body with a DirectBody), with no task switch, future or ASGI message per event. Pins: the bytes
and the accounting are those of the pull path; a stream task is not woken per event; back-pressure from the
client pauses the relay until it drains; idle/total timeouts, a broken upstream and the budget cut end it as in
the pull path."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway.proxy import sse
from gateway.proxy.forward import StreamStart, stream_body
from gateway.proxy.h1client import H1Transport
from gateway.proxy.transport import UpstreamBroken
from gateway.routing.plan import Candidate
from tests.proxy.test_h1client import Server, backend
from tests.proxy.test_stream_relay import CFG, DONE, FIRST, USAGE, _ctx, chunk

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def framed(e: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(e), e)


def _start(r) -> StreamStart:  # type: ignore[no-untyped-def]
    """A stream whose first event (FIRST) already went out, reading the rest from `r`."""
    return StreamStart(r, Candidate(CFG.backend("e1"), "m"), [FIRST[:-2]], sse.EventSplitter(), r.aiter_raw(),
                       time.perf_counter())


async def _no_end() -> None:
    return None


def paced(events: list[bytes], gap_s: float = 0.005, then_sleep: float = 0.0):
    async def go(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(HEAD)
        for e in events:
            w.write(framed(e))
            await w.drain()
            await asyncio.sleep(gap_s)
        if then_sleep:
            await asyncio.sleep(then_sleep)
            return
        w.write(b"0\r\n\r\n")
        await w.drain()
    return go


class Direct:
    """A client connection as DirectBody presents it: writes recorded, `paused` settable, `drain` waits for it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.paused = False
        self.gone = False
        self.drains = 0
        self._resumed = asyncio.Event()

    def write(self, body: bytes) -> None:
        self.writes.append(body)

    async def drain(self) -> None:
        self.drains += 1
        await self._resumed.wait()
        self._resumed.clear()

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()


async def _run(events: list[bytes], direct: Direct | None, **kw) -> tuple[bytes, list[bytes], object]:
    """stream_body over the native client against a paced upstream; (all bytes the client got, what the
    generator yielded, ctx)."""
    async with Server(lambda req: paced(events, **kw)) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        start = _start(r)
        ctx = _ctx(response_id="c1", client_wants_usage=True)

        yielded: list[bytes] = []
        got: list[bytes] = []
        async for c in stream_body(ctx, start, _no_end, direct):  # type: ignore[arg-type]
            yielded.append(c)
            if direct is not None:  # the direct writes since the last yield reached the client before it
                got.extend(direct.writes)
                direct.writes.clear()
            got.append(c)
        if direct is not None:
            got.extend(direct.writes)
        await t.aclose()
    return b"".join(got), yielded, ctx


async def test_push_mode_relays_the_same_bytes_and_counts_as_the_pull_path():
    events = [chunk() for _ in range(40)] + [chunk("!", "stop"), USAGE, DONE]
    pulled, _, c1 = await _run(events, None)
    d = Direct()
    pushed, yielded, c2 = await _run(events, d)
    assert pushed == pulled == FIRST + b"".join(events)
    assert yielded == [FIRST]  # only the first read went through the generator: every later read was pushed
    assert c1.delivered_completion_tokens >= 42  # type: ignore[attr-defined]
    for ctx in (c1, c2):
        assert ctx.usage is not None and ctx.usage.completion_tokens == 1001  # type: ignore[attr-defined]
        assert ctx.delivered_completion_tokens == c1.delivered_completion_tokens and ctx.finish_reasons == ("stop",)  # type: ignore[attr-defined]
        assert ctx.error is None  # type: ignore[attr-defined]


async def test_push_mode_does_not_wake_the_stream_task_per_event():
    """40 paced events: the relaying task is resumed a handful of times (start, end), not once per event."""
    events = [chunk() for _ in range(40)] + [chunk("!", "stop"), DONE]
    d = Direct()
    resumed = [0]
    async with Server(lambda req: paced(events)) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        start = _start(r)
        ctx = _ctx(response_id="c1")

        gen = stream_body(ctx, start, _no_end, d)  # type: ignore[arg-type]

        class Counting:  # drives the generator's coroutine by hand, counting each resumption
            def __await__(self):
                it = gen.__anext__().__await__()
                try:
                    v = it.send(None)
                    while True:
                        resumed[0] += 1
                        v = it.send((yield v))
                except StopIteration as e:
                    return e.value

        out = [await Counting()]
        with pytest.raises(StopAsyncIteration):
            out.append(await Counting())
        await t.aclose()
    assert b"".join(out + d.writes) == FIRST + b"".join(events)
    assert len(d.writes) >= 20  # paced: written read by read, from the connection's callback
    assert resumed[0] <= 6, resumed[0]


async def test_client_back_pressure_pauses_the_push_until_it_drains():
    events = [chunk(str(i)) for i in range(30)] + [chunk("!", "stop"), DONE]
    d = Direct()
    writes_at_pause: list[int] = []
    real_write = d.write

    def write(body: bytes) -> None:
        real_write(body)
        if len(d.writes) == 5 and not writes_at_pause:  # the client's socket buffer fills after 5 writes
            d.paused = True
            writes_at_pause.append(len(d.writes))
            asyncio.get_running_loop().call_later(0.1, d.resume)

    d.write = write  # type: ignore[method-assign]
    out, _, ctx = await _run(events, d, gap_s=0.002)
    assert out == FIRST + b"".join(events) and ctx.error is None  # type: ignore[attr-defined]
    assert d.drains == 1 and writes_at_pause == [5]


async def test_push_mode_idle_timeout_counts_from_the_last_read_and_ends_with_the_error_event():
    events = [chunk() for _ in range(10)]  # 10 reads 5 ms apart, then silence (idle_s is 0.3)
    d = Direct()
    t0 = time.monotonic()
    out, yielded, ctx = await _run(events, d, then_sleep=5)
    took = time.monotonic() - t0
    assert 0.3 < took < 2.0
    assert out.startswith(FIRST + b"".join(events)) and b"upstream_timeout" in yielded[-1]
    assert ctx.status == 504 and ctx.delivered_completion_tokens == 11  # type: ignore[attr-defined]


async def test_push_mode_budget_cut_stops_the_relay():
    events = [chunk() for _ in range(30)] + [DONE]
    d = Direct()
    async with Server(lambda req: paced(events)) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        start = _start(r)
        ctx = _ctx(response_id="c1", completion_token_allowance=8)

        yielded = [c async for c in stream_body(ctx, start, _no_end, d)]  # type: ignore[arg-type]
        await t.aclose()
    got = b"".join(yielded + d.writes)
    assert ctx.cut_by_budget and ctx.delivered_completion_tokens == 8
    assert got.count(b'"content":"tok "') == 7 and b"insufficient_quota" in got


async def test_push_within_raises_what_the_handler_raised_and_a_broken_connection():
    async def broken(w: asyncio.StreamWriter, req: bytes) -> str:
        w.write(HEAD + framed(chunk()))
        await w.drain()
        await asyncio.sleep(0.05)
        return "close"  # mid-body

    loop = asyncio.get_running_loop()
    async with Server(lambda req: broken) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        seen: list[bytes] = []
        with pytest.raises(UpstreamBroken):
            await r.push_within(lambda b: seen.append(b) is None, 5.0, loop.time() + 10)  # type: ignore[attr-defined]
        assert b"".join(seen) == chunk()
        await r.aclose()

        r = await t.post("chat/completions", b"{}", {})

        def bad(b: bytes) -> bool:
            raise ValueError("handler failed")

        with pytest.raises(ValueError, match="handler failed"):
            await r.push_within(bad, 5.0, loop.time() + 10)  # type: ignore[attr-defined]
        await r.aclose()
        await t.aclose()


def burst_after_first(events: list[bytes], pause_s: float = 0.05):
    """The first event, then (after `pause_s`) every other event and the body's end in one write."""
    async def go(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(HEAD + framed(events[0]))
        await w.drain()
        await asyncio.sleep(pause_s)
        w.write(b"".join(framed(e) for e in events[1:]) + b"0\r\n\r\n")
        await w.drain()
    return go


async def _run_burst(events: list[bytes], d: Direct) -> tuple[bytes, object]:
    async with Server(lambda req: burst_after_first(events)) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        start = _start(r)
        ctx = _ctx(response_id="c1")

        got: list[bytes] = []
        async for c in stream_body(ctx, start, _no_end, d):  # type: ignore[arg-type]
            got.extend(d.writes)
            d.writes.clear()
            got.append(c)
        got.extend(d.writes)
        await t.aclose()
    return b"".join(got), ctx


async def test_a_read_larger_than_the_join_limit_is_pushed_whole():
    """~300 KB in one upstream write (more than the 64 KiB a piece joins up to): every byte is relayed, the
    stream ends with its [DONE], not with "closed before it finished"."""
    events = [chunk() for _ in range(2500)] + [chunk("!", "stop"), DONE]
    d = Direct()
    out, ctx = await _run_burst(events, d)
    assert out == FIRST + b"".join(events)
    assert ctx.error is None and ctx.finish_reasons == ("stop",)  # type: ignore[attr-defined]


async def test_what_arrives_while_the_client_is_paused_is_relayed_after_the_drain_even_if_the_upstream_ended():
    events = [chunk(str(i)) for i in range(2500)] + [chunk("!", "stop"), DONE]
    d = Direct()
    real_write = d.write

    def write(body: bytes) -> None:  # the client's buffer is full after the first write; it drains in 0.2 s
        real_write(body)
        if not d.drains and not d.paused:
            d.paused = True
            asyncio.get_running_loop().call_later(0.2, d.resume)

    d.write = write  # type: ignore[method-assign]
    out, ctx = await _run_burst(events, d)
    assert out == FIRST + b"".join(events) and ctx.error is None  # type: ignore[attr-defined]
    assert d.drains == 1


async def test_a_read_after_the_client_left_is_neither_written_nor_counted():
    """Between the client's disconnect and its task's cancellation an upstream read may still arrive: push mode
    hands it back unprocessed, so delivered tokens count only what reached the client."""
    events = [chunk() for _ in range(10)] + [DONE]
    d = Direct()
    real_write = d.write
    tasks: list[asyncio.Future] = []

    def write(body: bytes) -> None:
        real_write(body)
        d.gone = True  # the connection drops right after the first pushed write; the cancellation comes later
        asyncio.get_running_loop().call_later(0.1, tasks[0].cancel)  # (5 more reads arrive meanwhile)

    d.write = write  # type: ignore[method-assign]
    async with Server(lambda req: paced(events, gap_s=0.02)) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        start = _start(r)
        ctx = _ctx(response_id="c1")

        gen = stream_body(ctx, start, _no_end, d)  # type: ignore[arg-type]
        assert await gen.__anext__() == FIRST
        task = asyncio.ensure_future(gen.__anext__())
        tasks.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()
        await t.aclose()
    assert len(d.writes) == 1 and ctx.delivered_completion_tokens == 2  # FIRST and the one written event

