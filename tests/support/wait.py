"""Waiting for an asynchronous effect instead of sleeping a guessed time: `wait_until(predicate)` polls until the
predicate is true (returning its value) and fails the test with `what` and the predicate's last value when
`timeout` passes first; the assertion that follows still checks the effect. `async_wait_until` is the same for
coroutines (the event loop keeps running between polls). `ManualClock` is a clock a test advances by hand (wall
and monotonic time move together)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
               what: str = "the condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout, value))
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0,
                           interval: float = 0.02, what: str = "the condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout, value))
        await asyncio.sleep(interval)


def _timed_out(what: str, timeout: float, value: Any) -> str:
    last = repr(value)
    return f"{what} did not hold within {timeout} s (last value: {last if len(last) <= 300 else last[:300] + '...'})"


class ManualClock:
    """`time()` and `monotonic()` that move only by `advance(seconds)` (the shape of gateway.identity.clock.Clock)."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
