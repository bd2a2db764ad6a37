"""The generated text of a running simulated request as stream events, for the non-chat stream shapes
(Anthropic Messages, OpenAI Responses): the events differ, the pacing is the engine's own."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable


async def text_deltas(server: Any, req: Any, opening: Callable[[str], bytes],
                      delta: Callable[[str], bytes]) -> AsyncIterator[bytes]:
    """After the first token: `opening(text so far)`, then `delta(new text)` every `stream_interval_s`, then the
    last delta when the request finishes. Raises EngineDead if the engine died (the connection drops); a
    consumer that stops early aborts the request on the engine, as vLLM does for a client that left."""
    interval = server.engine.profile.stream_interval_s
    w = req.listener
    finished = False
    try:
        await w.first
        sent = req.num_output
        yield opening(server._text(req, 0, sent))
        while not w.done.done():
            await asyncio.wait((w.done,), timeout=interval)
            n = req.num_output
            if w.done.done():
                break
            if n > sent:
                yield delta(server._text(req, sent, n))
                sent = n
        w.done.result()
        finished = True
        tail = server._text(req, sent, req.num_output)
        if tail:
            yield delta(tail)
    finally:
        if not finished:
            server.engine.abort(req)
