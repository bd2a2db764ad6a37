"""Limits repeated failed authentication per client address (fixed one-minute windows).

After `limit` failures inside a window the address is refused with 429 until the window ends, before any
store lookup, so guessing keys cannot load the store. Successes do not reset the count.
"""
from __future__ import annotations

import time

from gateway.errors import GatewayError, retry_headers

WINDOW_S = 60.0


class FailureLimiter:
    def __init__(self, limit_per_minute: int, window_s: float = WINDOW_S, max_clients: int = 100_000) -> None:
        self.limit = limit_per_minute
        self.window_s = window_s
        self.max_clients = max_clients
        self._state: dict[str, list[float]] = {}  # addr -> [window_start, failures]

    def check(self, addr: str, now: float | None = None) -> None:
        """Raise 429 auth_rate_limited if `addr` used up its failures in the current window."""
        st = self._state.get(addr)
        if st is None or self.limit <= 0:
            return
        now = time.monotonic() if now is None else now
        end = st[0] + self.window_s
        if st[1] >= self.limit and now < end:
            raise GatewayError(
                429,
                "Too many failed authentication attempts from this client; retry later.",
                code="auth_rate_limited",
                headers=retry_headers(end - now),
            )

    def failure(self, addr: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        st = self._state.get(addr)
        if st is None or now >= st[0] + self.window_s:
            if len(self._state) >= self.max_clients:
                self._prune(now)
            self._state[addr] = [now, 1.0]
        else:
            st[1] += 1

    def _prune(self, now: float) -> None:
        for a in [a for a, st in self._state.items() if now >= st[0] + self.window_s]:
            del self._state[a]
        if len(self._state) >= self.max_clients:  # all active: drop the oldest half
            for a in sorted(self._state, key=lambda a: self._state[a][0])[: self.max_clients // 2]:
                del self._state[a]
