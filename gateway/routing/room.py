"""Room on an engine: the most requests it had in flight in the last minute without its TTFT rising.

The fair queue holds a request when its model says the engine cannot start it soon. A model can be wrong (a
learned rate too slow, a burst the features do not explain): then the gateway holds work while the engine has
room, and serves less than a plain proxy would. This is the gateway's own check on that, from what it measured
rather than what it predicted: an engine with fewer requests in flight than `healthy_peak` of its recent
samples is known to take another without its TTFT rising, so holding a request for it is a defect. The flow
gate (`gate.py`) then opens the engine, and says so once per change of state.

A sample is (when, requests in flight on the engine when the request was sent, including itself, its TTFT).
The baseline is the median TTFT of the samples sent at the window's lowest concurrency (or one above it), and
only when that is low (at most LOW_LOAD in flight): an engine never seen lightly loaded gives no evidence of
room. Going up from there, concurrency level by level, TTFT "rose" at the first level whose median TTFT is over
`RISE` x the baseline + `RISE_ABS_S`; the healthy peak is the level below it (typical TTFTs, not the luckiest
request's).
"""
from __future__ import annotations

import statistics
from collections import deque

WINDOW_S = 60.0
MAX_SAMPLES = 512  # per engine: the newest ones (enough for a minute at the rates one engine serves)
MIN_SAMPLES = 8  # fewer: no claim of room
LOW_LOAD = 2  # the baseline needs samples sent with at most this many in flight
RISE = 1.5
RISE_ABS_S = 0.02
RECOMPUTE_S = 0.5


def healthy_peak(samples: list[tuple[int, float]]) -> int:
    """The highest concurrency up to which the median TTFT per level of `samples` ((in flight at send, TTFT s))
    stayed within the rise over the low-load baseline (module doc); 0 when there is no evidence to say."""
    if len(samples) < MIN_SAMPLES:
        return 0
    lo = min(n for n, _ in samples)
    base = [t for n, t in samples if n <= lo + 1]
    if lo > LOW_LOAD or len(base) < 2:
        return 0
    limit = statistics.median(base) * RISE + RISE_ABS_S
    by_level: dict[int, list[float]] = {}
    for n, t in samples:
        by_level.setdefault(n, []).append(t)
    peak = 0
    for n in sorted(by_level):
        if statistics.median(by_level[n]) > limit:
            break
        peak = n
    return peak


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
