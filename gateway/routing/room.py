"""Room on an engine: the most requests it had in flight in the last minute without its TTFT rising.

The fair queue holds a request when its model says the engine cannot start it soon. A model can be wrong (a
learned rate too slow, a burst the features do not explain): then the gateway holds work while the engine has
room, and serves less than a plain proxy would. This is the gateway's own check on that, from what it measured
rather than what it predicted: an engine with fewer requests in flight than `healthy_peak` of its recent
samples is known to take another without its TTFT rising, so holding a request for it is a defect. The flow
gate (`gate.py`) then opens the engine, and says so once per change of state.

A sample is (when, requests in flight on the engine when the request was sent, including itself, its TTFT).
TTFT "rose" when it is over `RISE` x the baseline + `RISE_ABS_S`; the baseline is the median TTFT of the
window's samples sent at or below the window's median concurrency.
"""
from __future__ import annotations

import statistics
from collections import deque

WINDOW_S = 60.0
MAX_SAMPLES = 512  # per engine: the newest ones (enough for a minute at the rates one engine serves)
MIN_SAMPLES = 8  # fewer: no claim of room
RISE = 1.5
RISE_ABS_S = 0.02
RECOMPUTE_S = 0.5


def healthy_peak(samples: list[tuple[int, float]]) -> int:
    """The largest concurrency among `samples` ((in flight at send, TTFT s)) whose TTFT did not rise over the
    baseline of the low-concurrency half (module doc); 0 when there are too few samples to say."""
    if len(samples) < MIN_SAMPLES:
        return 0
    mid = statistics.median(n for n, _ in samples)
    base = statistics.median(t for n, t in samples if n <= mid)
    limit = base * RISE + RISE_ABS_S
    return max((n for n, t in samples if t <= limit), default=0)


class Room:
    """Samples per engine and their healthy peak (recomputed at most every RECOMPUTE_S)."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int, float]]] = {}
        self._peak: dict[str, tuple[float, int]] = {}  # engine -> (computed at, peak)

    def observe(self, engine: str, now: float, inflight: int, ttft_s: float) -> None:
        q = self._samples.get(engine)
        if q is None:
            q = self._samples[engine] = deque(maxlen=MAX_SAMPLES)
        q.append((now, inflight, ttft_s))

    def peak(self, engine: str, now: float) -> int:
        hit = self._peak.get(engine)
        if hit is not None and now - hit[0] < RECOMPUTE_S:
            return hit[1]
        q = self._samples.get(engine)
        while q and q[0][0] < now - WINDOW_S:
            q.popleft()
        p = healthy_peak([(n, t) for _, n, t in q]) if q else 0
        self._peak[engine] = (now, p)
        return p

    def snapshot(self, now: float) -> dict[str, int]:
        return {e: self.peak(e, now) for e in sorted(self._samples)}
