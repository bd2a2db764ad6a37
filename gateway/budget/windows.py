"""Pure window arithmetic for budgets: rolling minute/hour buckets, calendar day/month in a zone, lifetime.

Rolling windows are bucketed (minute: 60 x 1 s, hour: 60 x 60 s) so a limit holds over any 60 buckets, never
the 2x burst a fixed window allows at its edge. Calendar windows are keyed by their period id in the configured
IANA zone (DST-aware); lifetime has one period. Nothing here does I/O; both stores and the Lua script share
these definitions (the Lua mirrors `RollingCounter`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gateway.budget.dimensions import COUNTED

ROLLING: dict[str, tuple[int, int]] = {"minute": (1, 60), "hour": (60, 60)}  # window -> (bucket_s, buckets)
CALENDAR = ("day", "month")
WINDOWS = ("minute", "hour", "day", "month", "lifetime")
_WIDTH = len(COUNTED)  # sums per counter: one per counted budget dimension


@dataclass(frozen=True, slots=True)
class WindowRef:
    """Where one window's counter lives at time `now`.

    rolling: `bucket` is the current bucket index, counters cover buckets (bucket - buckets, bucket].
    calendar/lifetime: one counter per `period`; `end` is when it resets (inf for lifetime).
    """

    window: str
    period: str  # part of the store key: "r" for rolling, "2025-03-30" / "2025-03" / "all" otherwise
    rolling: bool
    bucket_s: int = 0
    buckets: int = 0
    bucket: int = 0
    end: float = math.inf
    start_ts: float = -math.inf  # calendar: when the period began

    def key_suffix(self) -> str:
        return f"{self.window}:{self.period}"


def bucket_index(now: float, bucket_s: int) -> int:
    """The bucket a timestamp falls in (floor division, so bucket k covers [k*s, (k+1)*s))."""
    return math.floor(now / bucket_s)


def calendar_period(window: str, now: float, tz: ZoneInfo) -> tuple[str, float, float]:
    """(period id, start, end) of the calendar day or month containing `now` in zone `tz`."""
    pid, start, end = _period_of(window, datetime.fromtimestamp(now, tz), tz)
    if now < start:  # fromtimestamp rounds to the microsecond; a hair before midnight belongs to the day before
        pid, start, end = _period_of(window, datetime.fromtimestamp(start - 1, tz), tz)
    return pid, start, end


def _period_of(window: str, local: datetime, tz: ZoneInfo) -> tuple[str, float, float]:
    if window == "day":
        start = datetime(local.year, local.month, local.day, tzinfo=tz)
        nxt = start.date() + timedelta(days=1)
        end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz)
        pid = start.strftime("%Y-%m-%d")
    elif window == "month":
        start = datetime(local.year, local.month, 1, tzinfo=tz)
        y, m = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
        end = datetime(y, m, 1, tzinfo=tz)
        pid = start.strftime("%Y-%m")
    else:
        raise ValueError(f"not a calendar window: {window!r}")
    return pid, start.timestamp(), end.timestamp()


def resolve(window: str, now: float, tz: ZoneInfo) -> WindowRef:
    """The counter location of `window` at `now`."""
    if window in ROLLING:
        bs, n = ROLLING[window]
        b = bucket_index(now, bs)
        return WindowRef(window, "r", True, bs, n, b, (b + 1) * bs)
    if window in CALENDAR:
        pid, start, end = calendar_period(window, now, tz)
        return WindowRef(window, pid, False, end=end, start_ts=start)
    if window == "lifetime":
        return WindowRef(window, "all", False)
    raise ValueError(f"unknown budget window {window!r}; use one of {', '.join(WINDOWS)}")


def format_reset(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: "20ms", "1s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = int(math.ceil(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


class RollingCounter:
    """A bucketed sliding-window sum per counted budget dimension (gateway/budget/dimensions.py COUNTED: requests,
    tokens, money, GPU-seconds), exact at bucket granularity.

    The reference model the Lua script mirrors: `lo` is the oldest bucket that may hold data; `advance` evicts
    buckets that fell out of the window in amortized O(1) and keeps running totals.
    """

    __slots__ = ("buckets", "n", "lo", "tot")

    def __init__(self, n: int) -> None:
        self.n = n
        self.buckets: dict[int, list[int]] = {}
        self.lo: int | None = None
        self.tot = [0] * _WIDTH

    def advance(self, now_b: int) -> None:
        floor_b = now_b - self.n  # buckets <= floor_b are out of the window
        if self.lo is None:
            self.lo = now_b
            return
        if floor_b - self.lo >= self.n:  # idle longer than a window: everything is stale
            self.buckets.clear()
            self.tot = [0] * _WIDTH
            self.lo = now_b
            return
        b = self.lo
        while b <= floor_b:
            v = self.buckets.pop(b, None)
            if v is not None:
                self.tot = [t - x for t, x in zip(self.tot, v)]
            b += 1
        while b < now_b and b not in self.buckets:  # skip empty buckets so `lo` marks the oldest data
            b += 1
        self.lo = b

    def add(self, now_b: int, *vals: int) -> None:
        """Add one amount per counted dimension (fewer: the rest 0) in bucket `now_b`."""
        self.advance(now_b)
        assert self.lo is not None
        v = self.buckets.setdefault(max(now_b, self.lo), [0] * _WIDTH)  # a lagging clock never writes below lo
        tot = self.tot
        for i, x in enumerate(vals):
            v[i] += x
            tot[i] += x

    def totals(self, now_b: int) -> tuple[int, ...]:
        self.advance(now_b)
        return tuple(self.tot)

    def oldest(self, now_b: int) -> int:
        """Oldest bucket still holding data (now_b if none); when it expires, capacity frees up."""
        self.advance(now_b)
        assert self.lo is not None
        return self.lo if self.lo in self.buckets else now_b

    def to_state(self) -> dict:
        return {"n": self.n, "lo": self.lo, "b": {str(k): v for k, v in self.buckets.items()}, "tot": self.tot}

    @classmethod
    def from_state(cls, d: dict) -> "RollingCounter":
        c = cls(int(d["n"]))
        c.lo = d["lo"]
        # a snapshot written before a dimension was counted has fewer sums per bucket: the rest start at 0
        c.buckets = {int(k): pad_sums(v) for k, v in d["b"].items()}
        c.tot = pad_sums(d["tot"])
        return c


def pad_sums(v: list, width: int = 0) -> list[int]:
    """A stored list of sums (one per counted dimension, or `width`), padding what older versions wrote with 0."""
    out = [int(x) for x in v]
    return out + [0] * ((width or _WIDTH) - len(out))
