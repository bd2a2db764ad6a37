"""Operator-set in-flight limits per upstream (`backends[].max_inflight`): the one reason the gateway holds a
request bound for an upstream it has no model of (gateway/routing/mode.py).

A request takes a slot on the upstream it is sent to and gives it back when it finishes. When every candidate
with a limit is full and no candidate without one is left, it waits in FIFO order for a slot: a request with a
TTFT target is refused at once instead (429 `backend_inflight_limit`: the wait for an operator's limit is not
something the gateway can predict), one without waits up to `routing.flow_control.max_wait_s`. Counted per
gateway process: with N replicas or workers an upstream sees at most N x the limit.
"""
from __future__ import annotations

import asyncio
from collections import deque


class InflightLimits:
    """Slots in use per upstream and the requests waiting for one (FIFO)."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.stats = {"waited": 0, "refused": 0, "timeouts": 0}

    def free(self, name: str, limit: int | None) -> bool:
        return limit is None or self.used.get(name, 0) < limit

    def take(self, name: str) -> None:
        self.used[name] = self.used.get(name, 0) + 1

    def give(self, name: str) -> None:
        n = self.used.get(name, 0) - 1
        if n > 0:
            self.used[name] = n
        else:
            self.used.pop(name, None)
        waiters, self._waiters = self._waiters, deque()  # each re-checks (they may want other upstreams) and
        for fut in waiters:  # those still without a slot queue again, in the order they woke
            if not fut.done():
                fut.set_result(None)

    async def wait(self, timeout_s: float) -> bool:
        """Until some slot is given back (True) or `timeout_s` passes (False)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False
        finally:
            if not fut.done():
                fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    def snapshot(self) -> dict[str, object]:
        return {"in_use": dict(self.used), "waiting": len(self._waiters), **self.stats}
