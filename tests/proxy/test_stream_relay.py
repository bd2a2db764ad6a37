"""The streamed relay's per-read path (issue 24): complete events leave as one region per upstream read, plain
content chunks are counted without being parsed (OpenAIWire.relay), anything that needs a look (usage, finish
reasons, [DONE], the first id, a budget allowance, odd framing) goes through `process` per event; the native
client hands buffered pieces over as one and times a stream's reads with one timer (h1client `read_within`)."""
from __future__ import annotations

import asyncio
import random
import time

import orjson
import pytest
import yaml

from gateway.api.wire.anthropic import ANTHROPIC
from gateway.api.wire.base import StreamState
from gateway.api.wire.openai import OPENAI
from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy import sse
from gateway.proxy.forward import StreamStart, stream_body
from gateway.proxy.h1client import H1Transport
from gateway.routing.plan import Candidate
from tests.proxy.test_h1client import Server, backend

CFG = parse_config(yaml.safe_dump({"backends": [{
    "name": "e1", "kind": "openai", "url": "http://127.0.0.1:9/v1", "models": ["m"],
    "timeouts": {"idle_s": 0.3}}]}))


def chunk(content: str | None = "tok ", finish: str | None = None, **extra) -> bytes:
    c: dict = {"index": 0, "delta": {"content": content} if content is not None else {}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [c], **extra}) + b"\n\n"


FIRST = chunk("hi")
USAGE = (b"data: " + orjson.dumps({"id": "c1", "choices": [], "usage": {
    "prompt_tokens": 5, "completion_tokens": 1001, "total_tokens": 1006}}) + b"\n\n")
DONE = b"data: [DONE]\n\n"


class _Resp:
    status, headers = 200, {}

    async def aclose(self) -> None:
        return None


def _ctx(endpoint: str = "chat", **kw) -> RequestContext:
    ctx = RequestContext(request_id="r", endpoint=endpoint, headers={}, body={"model": "m"}, stream=True)
    for k, v in kw.items():
        setattr(ctx, k, v)
    return ctx


async def _relay(ctx: RequestContext, reads: list[bytes], first: bytes = FIRST) -> bytes:
    """stream_body over these upstream reads, after a first event that already went out (`first`)."""
    async def it():
        for r in reads:
            yield r

    start = StreamStart(_Resp(), Candidate(CFG.backend("e1"), "m"), sse.split_events(first), sse.EventSplitter(), it(),
                        time.perf_counter())

    async def on_end() -> None:
        return None

    return b"".join([c async for c in stream_body(ctx, start, on_end)])


def _cut(raw: bytes, rng: random.Random, crlf: bool = False) -> list[bytes]:
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    out, i = [], 0
    while i < len(raw):
        n = rng.randint(1, 700)
        out.append(raw[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("crlf", [False, True])
async def test_a_1000_event_stream_in_arbitrary_reads_counts_every_event_and_relays_every_byte(crlf):
    body = chunk() * 998 + chunk("!", "stop") + DONE  # + FIRST: 1000 events; no usage event, the count settles
    ctx = _ctx(response_id="c1")
    out = await _relay(ctx, _cut(body, random.Random(7), crlf))
    assert out == FIRST + body  # CRLF framing leaves normalised to LF, as before
    assert ctx.usage is not None and ctx.usage.completion_tokens == 1000 == ctx.delivered_completion_tokens
    assert ctx.finish_reasons == ("stop",) and ctx.error is None


async def test_usage_event_split_across_two_reads_and_mid_data_boundaries():
    body = chunk() * 50 + chunk("!", "stop") + USAGE + DONE
    k = body.index(USAGE) + 30  # inside the usage event's JSON
    j = body.index(b"data:", 1000) + 3  # inside a 'data:' field name
    reads = [body[:j], body[j:k], body[k:]]
    ctx = _ctx(response_id="c1", client_wants_usage=True)
    out = await _relay(ctx, reads)
    assert out == FIRST + body
    assert ctx.usage is not None and ctx.usage.completion_tokens == 1001 and ctx.usage.prompt_tokens == 5
    ctx = _ctx(response_id="c1")  # the client did not ask for usage: the usage-only event is stripped
    assert await _relay(ctx, reads) == FIRST + body.replace(USAGE, b"")
    assert ctx.usage is not None and ctx.usage.completion_tokens == 1001


async def test_a_cr_split_from_its_lf_between_reads():
    body = (chunk() * 3 + DONE).replace(b"\n", b"\r\n")
    i = body.index(b"\r\n\r\n") + 1  # ...}\r | \n\r\n...
    ctx = _ctx(response_id="c1")
    assert await _relay(ctx, [body[:i], body[i:]]) == FIRST + chunk() * 3 + DONE
    assert ctx.delivered_completion_tokens == 4  # with FIRST


async def test_budget_cut_inside_a_region_of_plain_chunks():
    ctx = _ctx(response_id="c1", completion_token_allowance=10)
    out = await _relay(ctx, [chunk() * 40 + DONE])  # one read: the cut still falls on the 10th token
    assert ctx.cut_by_budget and ctx.error == "insufficient_quota" and ctx.delivered_completion_tokens == 10
    assert out.count(b'"content":"tok "') == 9 and b"insufficient_quota" in out and b"[DONE]" in out


def test_relay_takes_the_leading_plain_content_chunks():
    st = StreamState()
    ctx = _ctx(response_id="c1")
    plain = chunk() * 5
    assert OPENAI.relay(ctx, st, plain) == len(plain) and st.delivered_tokens == 5 == ctx.delivered_completion_tokens
    nulls = (b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],'
             b'"usage":null}\n\n')
    assert OPENAI.relay(ctx, st, nulls * 2) == len(nulls) * 2 and st.delivered_tokens == 7  # OpenAI's usage: null
    # the plain prefix goes, the events that need a look stay for `process`
    for tail in (USAGE, chunk("x", "length"), DONE, chunk("x", "stop") + USAGE + DONE):
        s2 = StreamState()
        assert OPENAI.relay(ctx, s2, plain + tail) == len(plain) and s2.delivered_tokens == 5, tail
    for region in (plain + b": ping\n\n", plain + b"event: x\n" + chunk(), plain + b"\n", b"\n\n" + plain,
                   chunk(usage={"prompt_tokens": 1}), USAGE + plain, DONE,
                   b'data: {"choices":[],"usage": null}\n\n', b'data: {"choices":[{"finish_reason": null}]}\n\n'):
        s2 = StreamState()
        assert OPENAI.relay(ctx, s2, region) == 0 and s2.delivered_tokens == 0, region
    assert OPENAI.relay(_ctx(), StreamState(), plain) == 0  # the id is still to be taken
    assert OPENAI.relay(_ctx(response_id="c1", completion_token_allowance=100), StreamState(), plain) == 0


def _delta(text: str = "hi") -> bytes:
    return (b"event: content_block_delta\ndata: " + orjson.dumps(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}) + b"\n\n")


def test_anthropic_relay_takes_the_leading_run_of_content_block_deltas():
    st = StreamState()
    ctx = _ctx()
    plain = _delta() * 4
    assert ANTHROPIC.relay(ctx, st, plain) == len(plain) and st.delivered_tokens == 4
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    md = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":4}}\n\n'
    cbs = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    for tail in (stop, md + stop, cbs + md + stop, b'event: ping\ndata: {"type":"ping"}\n\n'):
        assert ANTHROPIC.relay(ctx, StreamState(), plain + tail) == len(plain), tail
    for region in (stop + plain, plain + _delta().split(b"\n", 1)[1],
                   _delta().replace(b"\ndata: ", b"\nid: 1\ndata: "), b"event: x\ndata: {}\n\n" + plain):
        assert ANTHROPIC.relay(ctx, StreamState(), region) == 0, region
    assert ANTHROPIC.relay(_ctx(completion_token_allowance=5), StreamState(), plain) == 0


@pytest.mark.parametrize("wire,region", [(OPENAI, chunk() * 7), (ANTHROPIC, _delta() * 7)])
def test_relay_agrees_with_process_event_by_event(wire, region):
    a, b = _ctx(response_id="c1"), _ctx(response_id="c1")
    sa, sb = StreamState(), StreamState()
    fast = region[:wire.relay(a, sa, region)]
    slow = b"".join(wire.process(b, sb, e) or b"" for e in sse.split_events(region))
    assert fast == slow == region and sa.delivered_tokens == sb.delivered_tokens == 7
    assert a.delivered_completion_tokens == b.delivered_completion_tokens and a.usage == b.usage


async def test_anthropic_stream_in_arbitrary_reads_counts_deltas_and_takes_usage():
    ms = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","usage":'
          b'{"input_tokens":7,"output_tokens":0}}}\n\n')
    md = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
          b'"usage":{"output_tokens":300}}\n\n')
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    cbs = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    body = _delta() * 299 + cbs + md + stop
    ctx = _ctx("messages")
    out = await _relay(ctx, _cut(body, random.Random(3)), first=ms + _delta())
    assert out == ms + _delta() + body and ctx.error is None
    assert ctx.delivered_completion_tokens == 300 and ctx.finish_reasons == ("end_turn",)
    assert ctx.usage is not None and (ctx.usage.prompt_tokens, ctx.usage.completion_tokens) == (7, 300)


def test_feed_region_keeps_the_torn_tail():
    sp = sse.EventSplitter()
    assert sp.feed_region(b"data: a\n\nda") == b"data: a\n\n"
    assert sp.feed_region(b"ta: b\n") == b""
    assert sp.feed_region(b"\ndata: c\r\n\r\n") == b"data: b\n\ndata: c\n\n"
    assert sse.split_events(b"data: b\n\n\n\ndata: c\n\n") == [b"data: b", b"data: c"]
    assert sp.rest() == b""


# ---- the native client: buffered pieces as one, one timer per stream


async def test_buffered_http_chunks_are_handed_over_as_one_piece() -> None:
    evs = [chunk(str(i)) for i in range(30)]

    async def burst(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in evs) + b"0\r\n\r\n")
        await w.drain()

    async with Server(lambda req: burst) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        await asyncio.sleep(0.05)  # all 30 HTTP chunks arrive before the first read
        parts = [c async for c in r.aiter_raw()]
        await r.aclose()
        await t.aclose()
    assert b"".join(parts) == b"".join(evs) and len(parts) == 1


async def test_read_within_one_timer_for_many_reads_then_idle_and_total_timeouts(monkeypatch) -> None:
    async def paced(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(20):  # 20 events 10 ms apart (0.2 s in all, idle limit 0.1 s), then silence
            e = chunk(str(i))
            w.write(b"%x\r\n%s\r\n" % (len(e), e))
            await w.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(5)

    loop = asyncio.get_running_loop()
    armed = []
    real_call_at = loop.call_at

    def call_at(when, cb, *args, **kw):
        if getattr(cb, "__name__", "") == "_check_wait":
            armed.append(when)
        return real_call_at(when, cb, *args, **kw)

    monkeypatch.setattr(loop, "call_at", call_at)
    async with Server(lambda req: paced) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        got = b""
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            while True:
                c = await r.read_within(0.1, loop.time() + 10)
                assert c is not None
                got += c
        waited = time.monotonic() - t0
        assert got.count(b"\n\n") == 20 and 0.25 < waited < 1.5
        assert len(armed) <= 6  # ~one per idle period, not one per read
        await r.aclose()
        r = await t.post("chat/completions", b"{}", {})
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # the total deadline holds while bytes keep coming
            while (c := await r.read_within(1.0, loop.time() + 0.05 - (time.monotonic() - t0))) is not None:
                pass
        assert time.monotonic() - t0 < 0.5
        await r.aclose()
        await t.aclose()


async def test_stream_body_idle_timeout_through_the_native_client() -> None:
    async def stall(w: asyncio.StreamWriter, req: bytes) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        e = chunk()
        w.write(b"%x\r\n%s\r\n" % (len(e), e))
        await w.drain()
        await asyncio.sleep(5)

    async with Server(lambda req: stall) as s:
        t = H1Transport(backend(s.port))
        r = await t.post("chat/completions", b"{}", {})
        start = StreamStart(r, Candidate(CFG.backend("e1"), "m"), [FIRST[:-2]], sse.EventSplitter(), r.aiter_raw(),
                            time.perf_counter())
        ctx = _ctx(response_id="c1")

        async def on_end() -> None:
            return None

        t0 = time.monotonic()
        out = b"".join([c async for c in stream_body(ctx, start, on_end)])
        assert 0.25 < time.monotonic() - t0 < 2.0  # idle_s 0.3
        assert out.startswith(FIRST + chunk()) and b"upstream_timeout" in out and ctx.status == 504
        assert ctx.delivered_completion_tokens == 2  # FIRST and the one chunk
        await t.aclose()


# ---- the dispatcher: what follows the first token in the first read stays one region


class _OneRead:
    from gateway.proxy.scrub import GENERIC as scrubber  # Upstreams.scrubber: no configured secret

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def post(self, path: str, body: bytes, headers: dict[str, str]):
        reads = self.reads

        class R:
            status, headers = 200, {}

            async def aiter_raw(self):
                for r in reads:
                    yield r

            async def aclose(self) -> None:
                return None

        return R()

    def client(self, name: str):
        return self

    def auth(self, name: str) -> None:
        return None


async def test_first_read_with_the_whole_stream_splits_only_up_to_the_first_token():
    from gateway.proxy.forward import Dispatcher
    from gateway.proxy.health import Health
    from gateway.routing.plan import RoutePlan

    role = b'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    body = role + chunk() * 999 + chunk("!", "stop") + USAGE + DONE
    ups = _OneRead([body])
    disp = Dispatcher(lambda: ups, Health(CFG), lambda c, cand: None)  # type: ignore[arg-type, return-value]
    ctx = _ctx()
    ctx.model, ctx.model_chain = "m", ("m",)
    ctx.route = RoutePlan(candidates=[Candidate(CFG.backend("e1"), "m")])
    start = await disp.open(ctx)
    assert isinstance(start, StreamStart)
    assert start.first == [role[:-2], chunk()[:-2]] and start.rest == body[len(role) + len(chunk()):]

    async def on_end() -> None:
        return None

    out = b"".join([c async for c in stream_body(ctx, start, on_end)])
    assert out == body.replace(USAGE, b"")  # the client did not ask for usage
    assert ctx.usage is not None and ctx.usage.completion_tokens == 1001 and ctx.finish_reasons == ("stop",)
    assert ctx.delivered_completion_tokens == 1001  # role chunk + 1000 content chunks, one token each
