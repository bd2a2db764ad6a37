"""Passive outlier detection covers streams that already started: an engine that breaks, closes early or
stalls after its first token counts as a failure of that backend (gateway/proxy/forward.py stream_body)."""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest
import yaml

from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.proxy import sse
from gateway.proxy.forward import StreamStart, stream_body
from gateway.proxy.health import Health
from gateway.proxy.transport import UpstreamBroken
from gateway.routing.plan import Candidate

CFG = parse_config(yaml.safe_dump({"backends": [{
    "name": "e1", "kind": "openai", "url": "http://127.0.0.1:9/v1", "models": ["m"],
    "timeouts": {"idle_s": 0.2}, "health": {"failures_to_open": 1}}]}))
FIRST = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
MORE = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": " there"}}]}) + b"\n\n"


class _Resp:
    status, headers = 200, {}

    async def aclose(self) -> None:
        return None


async def _run(rest) -> tuple[Health, bytes, RequestContext]:
    health = Health(CFG)
    ctx = RequestContext(request_id="r", endpoint="chat", headers={}, body={"model": "m"}, stream=True)

    async def it():
        for step in rest:
            if isinstance(step, Exception):
                raise step
            if step == "stall":
                await asyncio.sleep(5)
            yield step

    start = StreamStart(_Resp(), Candidate(CFG.backend("e1"), "m"), [FIRST], sse.EventSplitter(), it(), 0.0,
                        health=health)
    start.started_at = time.perf_counter()  # deadline base (total_s is long)

    async def on_end() -> None:
        return None

    out = b"".join([c async for c in stream_body(ctx, start, on_end)])
    return health, out, ctx


@pytest.mark.parametrize("rest,code", [([MORE, UpstreamBroken("reset")], b"upstream_error"),
                                       ([MORE], b"upstream_error"),  # closed before [DONE]
                                       (["stall"], b"upstream_timeout")])
async def test_a_stream_that_fails_after_its_first_token_counts_against_the_backend(rest, code):
    health, out, ctx = await _run(rest)
    assert code in out and ctx.status in (502, 504)
    assert health.snapshot()["e1"]["consecutive_failures"] == 1
    assert health.snapshot()["e1"]["state"] == "open"  # failures_to_open: 1


async def test_a_stream_that_finishes_is_no_failure():
    health, out, ctx = await _run([MORE, b"data: [DONE]\n\n"])
    assert out.endswith(b"data: [DONE]\n\n") and ctx.error is None
    assert health.snapshot().get("e1", {}).get("consecutive_failures", 0) == 0
