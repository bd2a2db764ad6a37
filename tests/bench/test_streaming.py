"""bench/streaming.py and the fast upstream's streams: the event count is the request's max_tokens, paced
streams arrive one HTTP chunk per event, and a tiny run of the bench prints its one table (so it cannot rot)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench import fast_upstream as fu
from bench import streaming

ROOT = Path(__file__).resolve().parents[2]


def test_stream_has_max_tokens_content_events_then_usage_and_done() -> None:
    events = fu.sse_body(5).split(b"\n\n")[:-1]
    assert len(events) == 7 and events[-1] == b"data: [DONE]"
    assert all(e == fu.CHUNK[:-2] for e in events[:5])
    usage = orjson.loads(events[5][6:])["usage"]
    assert usage == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert fu.stream_params(b'{"stream":true,"max_tokens":1000,"x_bench_gap_ms":2}') == (1000, 2.0)
    assert fu.stream_params(b'{"stream":true}') == (16, 0.0)
    assert fu.sse_resp(16).endswith(fu.sse_body(16)) and b"content-length: " in fu.sse_resp(16)


async def test_paced_stream_is_one_http_chunk_per_event() -> None:
    written: list[bytes] = []

    class T:
        def write(self, b: bytes) -> None:
            written.append(b)

        def is_closing(self) -> bool:
            return False

    await fu.paced(T(), 3, 0.0)  # type: ignore[arg-type]
    assert b"transfer-encoding: chunked" in written[0] and written[-1] == b"0\r\n\r\n"
    body = written[1:-1]
    assert len(body) == 3 + 2  # 3 content events, usage, [DONE]
    assert all(c.split(b"\r\n", 1)[1].endswith(b"\n\n\r\n") for c in body)


def test_table_has_ratios_and_per_event_slopes() -> None:
    w = [(None, 0.0), (20, 0.0), (1000, 0.0), (20, 2.0), (200, 2.0)]
    g = {streaming.IDLE: (1e6, 0), w[0]: (1e6, 9), w[1]: (1.2e6, 9), w[2]: (3.16e6, 9), w[3]: (2e6, 9),
         w[4]: (5.6e6, 9)}
    b = {k: (v[0] / 4, v[1]) for k, v in g.items()}
    out = streaming.table(w, ["gateway", "bare"], {"gateway": g, "bare": b}, {})
    assert "| stream, 20 events, one upstream write | 1.200 M | 0.300 M | 1.20x | 4.00x |" in out
    assert "| per event (20 -> 1000, one write) | 2.0 k | 0.5 k |  | 4.00x |" in out
    assert "| per event (20 -> 200, 2 ms apart) | 20.0 k | 5.0 k |  | 4.00x |" in out


@pytest.mark.e2e
def test_tiny_run_prints_the_table() -> None:
    r = subprocess.run([sys.executable, "bench/streaming.py", "--no-callgrind", "--seconds", "0.3",
                        "--events", "3,30", "--paced", "3", "--gap-ms", "1", "--connections", "2",
                        "--paced-connections", "2"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    for row in ("| JSON |", "| stream, 3 events, one upstream write |", "| stream, 30 events, one upstream write |",
                "| stream, 3 events, one upstream write each, 1 ms apart |", "| per event (3 -> 30, one write) |"):
        assert row in r.stdout, r.stdout
    assert "gateway CPU µs" in r.stdout and "bare CPU µs" in r.stdout and "gateway vs bare" in r.stdout


def test_request_asks_for_the_stream_it_measures() -> None:
    head, body = streaming.request((200, 2.0)).split(b"\r\n\r\n", 1)
    assert orjson.loads(body)["max_tokens"] == 200 and orjson.loads(body)["stream"] is True
    assert orjson.loads(body)["x_bench_gap_ms"] == 2.0
    assert "stream" not in orjson.loads(streaming.request((None, 0.0)).split(b"\r\n\r\n", 1)[1])
    assert asyncio.iscoroutinefunction(fu.paced)
