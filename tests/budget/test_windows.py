"""Window arithmetic: the bucketed rolling counter against a brute-force sum, calendar periods across DST."""
from __future__ import annotations

import math
from datetime import datetime
from zoneinfo import ZoneInfo

from hypothesis import given, settings, strategies as st

from gateway.budget.windows import RollingCounter, calendar_period, format_reset, resolve

events = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 5), st.integers(0, 1000)), max_size=60)


@given(events, st.integers(1, 60), st.lists(st.integers(0, 500), max_size=10))
def test_rolling_counter_matches_brute_force(evs, n, probes):
    """After any in-order sequence of adds, totals equal the sum of events in the last n buckets."""
    evs = sorted(evs)
    c = RollingCounter(n)
    seen: list[tuple[int, int, int]] = []
    for b, r, t in evs:
        c.add(b, r, t, r * t)
        seen.append((b, r, t))
        want = [sum(x[1] for x in seen if x[0] > b - n), sum(x[2] for x in seen if x[0] > b - n)]
        got = c.totals(b)
        assert [got[0], got[1]] == want
        assert got[2] == sum(x[1] * x[2] for x in seen if x[0] > b - n)
    last = evs[-1][0] if evs else 0
    for p in sorted(probes):
        q = last + p
        assert c.totals(q)[1] == sum(x[2] for x in seen if x[0] > q - n)
        old = c.oldest(q)
        in_window = [x[0] for x in seen if x[0] > q - n and (x[1] or x[2] or True)]
        assert old == (min(in_window) if in_window else q)


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 9)), max_size=40), st.integers(1, 30))
def test_rolling_counter_never_leaks_with_lagging_clock(evs, n):
    """A replica whose clock lags writes into the oldest bucket still in the window, and it is evicted later."""
    c = RollingCounter(n)
    for b, t in evs:  # arbitrary order: clocks of replicas disagree
        c.add(b, 0, t, 0)
    far = max((b for b, _ in evs), default=0) + 3 * n
    assert c.totals(far) == (0, 0, 0, 0)


@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 5)), max_size=30))
def test_rolling_state_roundtrip(evs):
    c = RollingCounter(60)
    for b, t in sorted(evs):
        c.add(b, 1, t, 0)
    d = RollingCounter.from_state(c.to_state())
    q = max((b for b, _ in evs), default=0)
    assert d.totals(q) == c.totals(q)


zones = st.sampled_from(["UTC", "Europe/Amsterdam", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata",
                         "Pacific/Chatham"])


@settings(max_examples=300)
@given(st.floats(0, 4_102_444_800), zones, st.sampled_from(["day", "month"]))
def test_calendar_period_contains_now_and_tiles(now, zone, window):
    """start <= now < end; the next period starts exactly at end; ids are the local calendar date."""
    tz = ZoneInfo(zone)
    pid, start, end = calendar_period(window, now, tz)
    assert start <= now < end
    nxt_pid, nxt_start, _ = calendar_period(window, end, tz)
    assert nxt_start == end and nxt_pid > pid
    local = datetime.fromtimestamp(start, tz)  # (fromtimestamp(now) rounds to the microsecond)
    assert local.hour == 0 and local.minute == 0 and (window == "day" or local.day == 1)
    assert pid == (local.strftime("%Y-%m-%d") if window == "day" else local.strftime("%Y-%m"))
    if window == "day":
        assert 22 * 3600 <= end - start <= 26 * 3600  # DST days are 23 or 25 hours (Lord Howe: 23.5)


def test_dst_day_in_amsterdam_is_23_hours():
    tz = ZoneInfo("Europe/Amsterdam")
    t = datetime(2025, 3, 30, 12, tzinfo=tz).timestamp()
    pid, start, end = calendar_period("day", t, tz)
    assert pid == "2025-03-30" and end - start == 23 * 3600


def test_month_resets_at_local_midnight():
    tz = ZoneInfo("Europe/Amsterdam")
    just_before = datetime(2025, 1, 31, 23, 59, 59, tzinfo=tz).timestamp()
    assert calendar_period("month", just_before, tz)[0] == "2025-01"
    assert calendar_period("month", just_before + 1, tz)[0] == "2025-02"
    # 23:30 UTC on Jan 31 is already February in Amsterdam
    assert calendar_period("month", datetime(2025, 1, 31, 23, 30, tzinfo=ZoneInfo("UTC")).timestamp(), tz)[0] == "2025-02"


@given(st.floats(0, 4e9))
def test_resolve_rolling_buckets(now):
    m = resolve("minute", now, ZoneInfo("UTC"))
    assert m.rolling and m.bucket == math.floor(now) and m.buckets == 60
    h = resolve("hour", now, ZoneInfo("UTC"))
    assert h.bucket == math.floor(now / 60) and h.bucket_s == 60
    assert resolve("lifetime", now, ZoneInfo("UTC")).end == math.inf


def test_format_reset():
    assert format_reset(0.02) == "20ms"
    assert format_reset(1) == "1s"
    assert format_reset(360) == "6m0s"
    assert format_reset(3723) == "1h2m3s"
