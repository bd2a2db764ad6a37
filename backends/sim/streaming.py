"""The generated text of a running simulated request as stream events, for the non-chat stream shapes
(Anthropic Messages, OpenAI Responses): the events differ, the pacing is the engine's own."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable


async def text_deltas(server: Any, req: Any, opening: Callable[[str], bytes], delta: Callable[[str], bytes],
                      text: Callable[[int, int], str] | None = None) -> AsyncIterator[bytes]:
    """After the first token: `opening(text so far)`, then `delta(new text)` every `stream_interval_s`, then the
    last delta when the request finishes. `text(start, end)`: the text of output tokens [start, end) (default:
    the engine's own tokens; a transcription has its own words). Raises EngineDead if the engine died (the
    connection drops); a consumer that stops early aborts the request on the engine, as vLLM does for a client
    that left."""
    interval = server.engine.profile.stream_interval_s
    if text is None:
        def text(start: int, end: int) -> str:
            return server._text(req, start, end)
    w = req.listener
    finished = False
    try:
        await w.first
        sent = req.num_output
        yield opening(text(0, sent))
        while not w.done.done():
            await asyncio.wait((w.done,), timeout=interval)
            n = req.num_output
            if w.done.done():
                break
            if n > sent:
                yield delta(text(sent, n))
                sent = n
        w.done.result()
        finished = True
        tail = text(sent, req.num_output)
        if tail:
            yield delta(tail)
    finally:
        if not finished:
            server.engine.abort(req)
