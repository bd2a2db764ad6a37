"""tests/support/wait.py: a wait returns the predicate's value once it holds and fails the test when it never does."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.wait import ManualClock, async_wait_until, wait_until


def test_wait_until_returns_the_value_once_it_holds_and_fails_when_it_never_does():
    t0 = time.monotonic()
    assert wait_until(lambda: time.monotonic() - t0 > 0.05 and "done", timeout=2) == "done"
    with pytest.raises(AssertionError, match=r"the index did not hold within 0.1 s \(last value: \[\]\)"):
        wait_until(lambda: [], timeout=0.1, what="the index")


async def test_async_wait_until_lets_the_loop_run_and_awaits_coroutine_predicates():
    seen: list[int] = []

    async def later() -> None:
        await asyncio.sleep(0.05)
        seen.append(1)

    task = asyncio.create_task(later())

    async def has_run() -> bool:
        return bool(seen)

    assert await async_wait_until(has_run, timeout=2) is True
    await task
    with pytest.raises(AssertionError, match=r"the condition did not hold within 0.1 s \(last value: 0\)"):
        await async_wait_until(lambda: 0, timeout=0.1)


def test_manual_clock_moves_only_when_advanced():
    c = ManualClock(start=100.0)
    assert c.time() == c.monotonic() == 100.0
    c.advance(0.5)
    assert c.time() == c.monotonic() == 100.5
